"""The waiting listing is a bounded walk: every filter has an index, a page reads about its own keys.

Generated waiting calls (ties in their time, three kinds, agents and conversations, calls that
ended or were decided among them) over one to three shards, in memory and on RocksDB: every listing
(unfiltered, by kind, agent, conversation and their pairs, and filters that match nothing), paged
in either order from any cursor, is the reference order cut into pages. The applier keeps the
indexes as the calls' states say (through waits and decisions), retention's drop takes them with
the run, a shard made before them is walked and filtered, and a filter that matches nothing reads
no more keys than a page.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepstream.producer import InMemoryLog, decide_deferred_call
from stepstream.projector._listing import list_run, relist_run
from stepstream.projector._retention import drop_run
from stepstream.projector._tool_effects import effect_index, reindex
from stepstream.readmodel import ProjectionReader
from stepstream.storage import (
    EFFECT,
    RUN,
    WAITING_AGENT,
    WAITING_CONVERSATION,
    WAITING_KIND,
    EffectState,
    Identity,
    MemoryShard,
    RunState,
    Shard,
)
from stepstream.topics import murmur2_partition

from deferred_runs import run_until_waiting
from memory_projection import CountingShard, MemoryProjection

pytestmark = pytest.mark.fast

CallSpec = tuple[str, str, int, str, str, str | None, str | None]
"""run_id, tool_call_id, since (micros), status, kind, agent_name, conversation_id."""

KINDS = ('approval', 'question', 'external')


@st.composite
def calls(draw: st.DrawFn) -> list[CallSpec]:
    """Runs with one to three calls each, most of them waiting."""
    out: list[CallSpec] = []
    for r in range(draw(st.integers(0, 14))):
        agent = draw(st.sampled_from([None, 'a1', 'a2']))
        conversation = draw(st.sampled_from([None, 'c1', 'c2']))
        for c in range(draw(st.integers(1, 3))):
            since = draw(st.integers(1, 6)) * 1_000_000  # few values: ties are common
            status = draw(st.sampled_from(['deferred', 'deferred', 'deferred', 'completed']))
            out.append(
                (
                    f'run-{r:02d}',
                    f'call-{c}',
                    since,
                    status,
                    draw(st.sampled_from(KINDS)),
                    agent,
                    conversation,
                )
            )
    return out


def _write(shards: dict[int, Any], specs: list[CallSpec], partitions: int) -> None:
    """Each run and call state, indexed as the applier indexes them."""
    txns = {p: shard.begin() for p, shard in shards.items()}
    runs: dict[str, RunState] = {}
    for run_id, call, since, status, kind, agent, conversation in specs:
        txn = txns[murmur2_partition(run_id.encode(), partitions)]
        run = runs.get(run_id)
        if run is None:
            run = runs[run_id] = RunState(
                run_id=run_id, owner='w', started_at=1, agent_name=agent, conversation_id=conversation
            )
            run.status = 'waiting'
            txn.put_state(RUN.key(run_id), run)
            list_run(txn, run)
            relist_run(txn, run, None)  # filed as a batch leaves it
        effect = EffectState(
            run_id=run_id,
            tool_call_id=call,
            tool_name='tool',
            tool_name_seq=1,
            status=status,
            status_seq=2,
            started_at=since,
            ended_at=since,
            deferral=kind if status == 'deferred' else None,
        )
        txn.put_state(EFFECT.key(run_id, call), effect)
        reindex(txn, (), effect_index(effect, run))
    for txn in txns.values():
        txn.commit()


def _pages(reader: ProjectionReader, newest_first: bool, limit: int, **filters: Any) -> list[tuple[str, str]]:
    async def walk() -> list[tuple[str, str]]:
        seen: list[tuple[str, str]] = []
        after = None
        while True:
            page = await reader.list_waiting(newest_first=newest_first, after=after, limit=limit, **filters)
            seen += [(w.effect.run_id, w.effect.tool_call_id) for w in page]
            if len(page) < limit:
                return seen
            after = page[-1].cursor

    return asyncio.run(walk())


def _listings(specs: list[CallSpec]) -> list[tuple[dict[str, str], list[CallSpec]]]:
    """Every filter (and pair of filters) with the calls it lists, those that match nothing among them."""
    waiting = [s for s in specs if s[3] == 'deferred']
    listings: list[tuple[dict[str, str], list[CallSpec]]] = [({}, waiting)]
    for kind in KINDS:
        listings.append(({'deferral': kind}, [s for s in waiting if s[4] == kind]))
    for agent in ('a1', 'a2', 'nope'):
        listings.append(({'agent_name': agent}, [s for s in waiting if s[5] == agent]))
        listings.append(
            (
                {'agent_name': agent, 'deferral': 'question'},
                [s for s in waiting if s[5] == agent and s[4] == 'question'],
            )
        )
    for conversation in ('c1', 'c2', 'nope'):
        mine = [s for s in waiting if s[6] == conversation]
        listings.append(({'conversation_id': conversation}, mine))
        listings.append(
            (
                {'conversation_id': conversation, 'deferral': 'approval'},
                [s for s in mine if s[4] == 'approval'],
            )
        )
        listings.append(
            ({'conversation_id': conversation, 'agent_name': 'a1'}, [s for s in mine if s[5] == 'a1'])
        )
    return listings


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=calls(),
    partitions=st.sampled_from([1, 3]),
    rocksdb=st.booleans(),
    limit=st.integers(1, 5),
    newest_first=st.booleans(),
    older=st.booleans(),
)
def test_every_waiting_listing_pages_in_its_order_from_any_cursor(
    specs: list[CallSpec], partitions: int, rocksdb: bool, limit: int, newest_first: bool, older: bool
) -> None:
    """`older`: the shards say they were made before the filter indexes, and hold none: walked whole."""
    with tempfile.TemporaryDirectory() as root:
        shards: dict[int, Any] = {
            p: Shard.open(Path(root) / str(p), create=True) if rocksdb else MemoryShard()
            for p in range(partitions)
        }
        try:
            _write(shards, specs, partitions)
            if older:
                for p, shard in shards.items():
                    txn = shard.begin()
                    for space in (WAITING_KIND, WAITING_AGENT, WAITING_CONVERSATION):
                        for k, _ in list(shard.scan(space.prefix())):
                            txn.delete(k)
                    txn.commit()
                    shard.write_identity(
                        Identity(
                            format=Identity.FORMAT,
                            topic_prefix='t',
                            cluster='c',
                            max_snapshots_per_run=None,
                            partitions=partitions,
                            partition=p,
                            run_index=4,
                        )
                    )
            reader = ProjectionReader(shards, partitions=partitions)
            for filters, members in _listings(specs):
                ordered = sorted(members, key=lambda s: (s[2], s[0], s[1]), reverse=newest_first)
                assert _pages(reader, newest_first, limit, **filters) == [(s[0], s[1]) for s in ordered], (
                    filters
                )
            counts = asyncio.run(reader.counts())
            waiting = [s for s in specs if s[3] == 'deferred']
            assert counts is not None and counts.waiting_calls == {
                k: sum(s[4] == k for s in waiting) for k in sorted(KINDS)
            }
        finally:
            for shard in shards.values():
                if rocksdb:
                    shard.close()


@pytest.mark.parametrize('newest_first', [True, False])
def test_a_page_of_waiting_calls_reads_about_its_own_keys_whatever_matches(newest_first: bool) -> None:
    """3,000 approvals of one agent wait in one conversation: a filter that matches none reads no key."""
    partitions = 3
    specs: list[CallSpec] = [
        (f'run-{i:05d}', 'call-0', i * 1000, 'deferred', 'approval', 'a1', 'c1') for i in range(3000)
    ]
    shards: dict[int, Any] = {p: CountingShard() for p in range(partitions)}
    _write(shards, specs, partitions)
    reader = ProjectionReader(shards, partitions=partitions)
    middle = asyncio.run(reader.list_waiting(limit=1500))[-1].cursor
    for filters, found in (
        ({}, 50),
        ({'after': middle}, 50),
        ({'deferral': 'approval'}, 50),
        ({'agent_name': 'a1'}, 50),
        ({'conversation_id': 'c1', 'after': middle}, 50),
        ({'deferral': 'question'}, 0),
        ({'agent_name': 'nope'}, 0),
        ({'agent_name': 'a1', 'deferral': 'external'}, 0),
        ({'conversation_id': 'nope'}, 0),
        ({'conversation_id': 'c1', 'deferral': 'question'}, 0),
    ):
        CountingShard.handed = 0
        page = asyncio.run(reader.list_waiting(newest_first=newest_first, limit=50, **filters))
        assert len(page) == found, filters
        assert CountingShard.handed <= found + 2 * partitions * len(KINDS), (filters, CountingShard.handed)


def _waiting_keys(shard: MemoryShard) -> set[bytes]:
    return {
        k
        for space in (WAITING_KIND, WAITING_AGENT, WAITING_CONVERSATION)
        for k, _ in shard.scan(space.prefix())
    }


def _expected_keys(shard: MemoryShard) -> set[bytes]:
    """The filter index keys the shard's run and call states call for."""
    runs = {s.run_id: s for s in (RunState.decode(v) for _, v in shard.scan(RUN.prefix()))}
    expected: set[bytes] = set()
    for _, v in shard.scan(EFFECT.prefix()):
        effect = EffectState.decode(v)
        if effect.waiting:
            assert effect.deferral is not None and effect.ended_at is not None
            run = runs[effect.run_id]
            place = (effect.ended_at, effect.run_id, effect.tool_call_id)
            expected.add(WAITING_KIND.key(effect.deferral, *place))
            if run.agent_name is not None:
                expected.add(WAITING_AGENT.key(run.agent_name, effect.deferral, *place))
            if run.conversation_id is not None:
                expected.add(WAITING_CONVERSATION.key(run.conversation_id, effect.deferral, *place))
    return expected


async def test_the_applier_keeps_the_filter_indexes_as_the_calls_wait_and_are_decided() -> None:
    log = InMemoryLog()
    for run_id, agent in (('w-1', 'refunds'), ('w-2', 'refunds'), ('w-3', 'exports')):
        await run_until_waiting(log, run_id, agent_name=agent)
    projection = MemoryProjection(log)
    await projection.wait_for()
    reader = projection.reader()
    keys = _waiting_keys(projection.shard)
    assert len(keys) == 9 * 3 and keys == _expected_keys(projection.shard)
    assert [
        w.effect.run_id for w in await reader.list_waiting(agent_name='refunds', deferral='question')
    ] == [
        'w-1',
        'w-2',
    ]
    [refund] = [w.effect for w in await reader.list_waiting(conversation_id='conv-w-2', deferral='approval')]
    await decide_deferred_call(log, refund, decision='approved', operator='alice', writer_id='test@here:1')
    await projection.wait_for()
    keys = _waiting_keys(projection.shard)
    assert len(keys) == 8 * 3 and keys == _expected_keys(projection.shard)
    assert await reader.list_waiting(conversation_id='conv-w-2', deferral='approval') == []
    assert [
        w.effect.run_id for w in await reader.list_waiting(agent_name='refunds', deferral='approval')
    ] == ['w-1']


def test_dropping_a_run_takes_its_waiting_entries_with_it() -> None:
    shard = MemoryShard()
    _write(
        {0: shard},
        [
            ('run-1', 'call-0', 5, 'deferred', 'approval', 'a1', 'c1'),
            ('run-2', 'call-0', 6, 'deferred', 'external', 'a1', 'c1'),
        ],
        1,
    )
    txn = shard.begin()
    drop_run(txn, 0, 'run-1')
    txn.commit()
    assert _waiting_keys(shard) == _expected_keys(shard) != set()
    assert not any(b'run-1' in k for k in _waiting_keys(shard))
