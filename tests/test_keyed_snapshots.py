"""Keyed snapshots: a snapshot whose idempotency key its run applied already is never listed again.

The reference's stores ignore a keyed write they applied for the run, even after retention pruned
it: a key `N:...` repeats below the highest `N` applied or again at it, any other key repeats when
seen before (decision 0058). The projector decides the same in log order, so every batching and a
rebuild agree, and the repeated snapshot's delta stays for the ones written after it.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelRequest, UserPromptPart

from stepstream.projector._apply import EVENTS, Applier, SourceRecord
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import SnapshotDelta, StepEvent, encode
from stepstream.storage import LiveShards, MemoryShard

pytestmark = pytest.mark.fast

RUN = 'keyed-1'


def _log(keys: list[str | None]) -> list[SourceRecord]:
    """`run_started`, then one snapshot per key, each adding message `m<i>`."""
    events = [StepEvent(run_id=RUN, seq=0, writer_id='w', timestamp=datetime.now(UTC), kind='run_started')]
    for i, key in enumerate(keys):
        tail = [ModelRequest(parts=[UserPromptPart(f'm{i}')])]
        events.append(
            StepEvent(
                run_id=RUN,
                seq=i + 1,
                writer_id='w',
                timestamp=datetime.now(UTC),
                kind='snapshot_saved',
                idempotency_key=key,
                snapshot=SnapshotDelta(
                    snapshot_seq=i,
                    state='complete',
                    prefix_len=i,
                    messages=ModelMessagesTypeAdapter.dump_json(tail).decode(),
                ),
            )
        )
    return [SourceRecord(EVENTS, 0, offset, RUN.encode(), encode(e)) for offset, e in enumerate(events)]


def _project(records: list[SourceRecord], cuts: list[int], max_snapshots: int | None = None) -> MemoryShard:
    shard = MemoryShard()
    applier = Applier(('e', 't'), partitions=1, max_snapshots_per_run=max_snapshots)
    start = 0
    for cut in [*sorted(set(cuts)), len(records)]:
        txn, _ = applier.stage(shard, records[start:cut])
        txn.commit()
        start = cut
    return shard


class _Projected:
    """One in-memory shard, as `ProjectionReader.of` reads a projector's."""

    def __init__(self, shard: MemoryShard) -> None:
        self.shard = shard

    def live_shards(self) -> LiveShards:
        return LiveShards(
            {0: self.shard}, partitions=1, media_store=None, keys=None, stale_after_s=20.0, scope=None
        )


def _read(shard: MemoryShard) -> tuple[list[int], int | None, list[str]]:
    """(listed snapshot_seqs, the latest one's, the latest one's prompts)."""
    reader = ProjectionReader.of(_Projected(shard))

    async def read() -> tuple[list[int], int | None, list[str]]:
        listed = await reader.list_snapshots(RUN)
        latest = await reader.latest_snapshot(RUN)
        prompts = [] if latest is None else [str(p.content) for m in latest.messages for p in m.parts]
        return [s.snapshot_seq for s in listed], None if latest is None else latest.snapshot_seq, prompts

    return asyncio.run(read())


def test_two_keyed_snapshots_saved_twice_each_list_twice() -> None:
    listed, latest, prompts = _read(_project(_log(['1:a', '2:b', '1:a', '2:b']), []))
    assert listed == [0, 1] and latest == 1
    assert prompts == ['m0', 'm1']


def test_an_older_keyed_snapshot_saved_again_does_not_become_the_latest_under_a_bound_of_one() -> None:
    listed, latest, prompts = _read(_project(_log(['1:a', '2:b', '1:a']), [], max_snapshots=1))
    assert (listed, latest) == ([1], 1)
    assert prompts == ['m0', 'm1']


def test_a_key_without_a_sequence_repeats_after_retention_dropped_its_snapshot() -> None:
    listed, latest, prompts = _read(
        _project(
            _log(
                ['x', 'y', 'x'],
            ),
            [],
            max_snapshots=1,
        )
    )
    assert (listed, latest) == ([1], 1)  # 'x' was no longer listed when it came again
    assert prompts == ['m0', 'm1']
    listed, latest, prompts = _read(_project(_log(['x', 'x', None]), []))
    assert (listed, latest) == ([0, 2], 2)  # an unkeyed snapshot always lists
    assert prompts == ['m0', 'm1', 'm2']  # the repeated one's delta still counts


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(st.one_of(st.none(), st.sampled_from(['0:a', '1:a', '1:b', '2:a', 'x', 'y'])), max_size=8),
    cuts=st.lists(st.integers(0, 9), max_size=4),
    bound=st.one_of(st.none(), st.integers(1, 3)),
)
def test_which_snapshots_list_depends_on_the_log_not_on_its_batches(
    keys: list[str | None], cuts: list[int], bound: int | None
) -> None:
    """Any keys, any batching: the reference's rule in log order, the same in one pass and in many."""
    records = _log(keys)
    whole = _read(_project(records, [], bound))
    assert _read(_project(records, cuts, bound)) == whole
    expected: list[int] = []
    high, at_high, seen = -1, set[str](), set[str]()
    for i, key in enumerate(keys):
        head, colon, _ = (key or '').partition(':')
        if key is None:
            expected.append(i)
        elif colon and head.isdecimal():
            n = int(head)
            if n > high or (n == high and key not in at_high):
                at_high = {key} if n > high else at_high | {key}
                high = max(high, n)
                expected.append(i)
        elif key not in seen:
            seen.add(key)
            expected.append(i)
    listed, latest, prompts = whole
    assert latest == (expected[-1] if expected else None)
    assert set(listed) <= set(expected) and (bound is not None or listed == expected)
    assert prompts == ([f'm{j}' for j in range(expected[-1] + 1)] if expected else [])
