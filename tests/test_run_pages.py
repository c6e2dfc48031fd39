"""Run lists are bounded walks: pages read from the index's end or a seek, never its whole prefix.

Generated projections of runs (ties in started_at, conversations, parents, every status, live
and stale among the running) over one to three shards, in memory and on RocksDB: every listing,
paged in either order from any cursor, is the reference order cut into pages; the counts match;
a cursor outside the listing is refused; and a page reads only about its own keys per shard,
whatever the number of runs.
"""

from __future__ import annotations

import asyncio
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepstream.projector._listing import list_run, relist_run
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import RUN_STATUSES
from stepstream.storage import (
    RUN,
    MemoryShard,
    RunState,
    Shard,
)
from stepstream.timestamps import micros
from stepstream.topics import murmur2_partition

from memory_projection import CountingShard

pytestmark = pytest.mark.fast

RunSpec = tuple[str, int, str | None, str | None, str, str | None]
"""run_id, started_at (micros), conversation_id, parent_run_id, status, agent_name."""


@st.composite
def projections(draw: st.DrawFn) -> list[RunSpec]:
    count = draw(st.integers(0, 40))
    ids = [f'run-{i:03d}' for i in draw(st.permutations(range(count)))]
    runs: list[RunSpec] = []
    for i, run_id in enumerate(ids):
        started = draw(st.integers(1, 12)) * 1_000_000  # few values: ties are common
        conversation = draw(st.sampled_from([None, 'c1', 'c2']))
        parent = draw(st.sampled_from([None, *ids[:i]])) if i else None
        status = draw(st.sampled_from(['running', 'stale', 'completed', 'failed', 'cancelled']))
        agent = draw(st.sampled_from([None, 'a1', 'a2']))
        runs.append((run_id, started, conversation, parent, status, agent))
    return runs


def _write(shards: dict[int, Any], runs: list[RunSpec], partitions: int) -> None:
    """Each run's state, listed as the applier lists it: `running` is live, `stale` quiet."""
    now = micros(datetime.now(UTC))
    txns = {p: shard.begin() for p, shard in shards.items()}
    for run_id, started, conversation, parent, status, agent in runs:
        txn = txns[murmur2_partition(run_id.encode(), partitions)]
        state = RunState(
            run_id=run_id,
            owner='w',
            started_at=started,
            conversation_id=conversation,
            parent_run_id=parent,
            agent_name=agent,
            status='running' if status == 'stale' else status,
            last_record_at=now if status == 'running' else 0,
        )
        txn.put_state(RUN.key(run_id), state)
        list_run(txn, state)
        relist_run(txn, state, None)  # filed as a batch leaves it
    for txn in txns.values():
        txn.commit()


def _pages(reader: ProjectionReader, newest_first: bool, limit: int, **filters: str) -> list[str]:
    async def walk() -> list[str]:
        seen: list[str] = []
        after = None
        while True:
            page = await reader.list_runs(**filters, newest_first=newest_first, after=after, limit=limit)
            seen += [r.run_id for r in page]
            if len(page) < limit:
                return seen
            after = page[-1].run_id

    return asyncio.run(walk())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    runs=projections(),
    partitions=st.sampled_from([1, 3]),
    rocksdb=st.booleans(),
    limit=st.integers(1, 7),
    newest_first=st.booleans(),
)
def test_every_listing_pages_in_its_order_from_any_cursor(
    runs: list[RunSpec], partitions: int, rocksdb: bool, limit: int, newest_first: bool
) -> None:
    with tempfile.TemporaryDirectory() as root:
        shards: dict[int, Any] = {
            p: Shard.open(Path(root) / str(p), create=True) if rocksdb else MemoryShard()
            for p in range(partitions)
        }
        try:
            _write(shards, runs, partitions)
            reader = ProjectionReader(shards, partitions=partitions)
            listings: list[tuple[dict[str, str], list[RunSpec]]] = [({}, runs)]
            for conversation in ('c1', 'c2'):
                listings.append(
                    ({'conversation_id': conversation}, [r for r in runs if r[2] == conversation])
                )
            for parent in {r[3] for r in runs if r[3] is not None}:
                listings.append(({'parent_run_id': parent}, [r for r in runs if r[3] == parent]))
            for status in RUN_STATUSES:  # through `STATUS`; `running` through `LATEST`
                listings.append(({'status': status}, [r for r in runs if r[4] == status]))
            for agent in ('a1', 'a2'):  # through `AGENT`, a walk per status merged
                listings.append(({'agent_name': agent}, [r for r in runs if r[5] == agent]))
                for status in ('running', 'stale', 'failed'):
                    both = [r for r in runs if r[5] == agent and r[4] == status]
                    listings.append(({'agent_name': agent, 'status': status}, both))
            counts = asyncio.run(reader.status()).runs
            assert counts is not None
            assert counts.by_status == {s: sum(r[4] == s for r in runs) for s in RUN_STATUSES}
            agents = sorted({r[5] for r in runs if r[5] is not None})
            assert counts.by_agent == {a: sum(r[5] == a for r in runs) for a in agents}
            for filters, members in listings:
                expected = [r[0] for r in sorted(members, key=lambda r: (r[1], r[0]), reverse=newest_first)]
                assert _pages(reader, newest_first, limit, **filters) == expected, filters
                if 'conversation_id' in filters or 'parent_run_id' in filters:
                    outside = next((r[0] for r in runs if r not in members), 'no-such-run')
                else:  # any run is a place in the order of every run, filtered or not
                    outside = 'no-such-run'
                with pytest.raises(LookupError, match='is not a run of this listing'):
                    asyncio.run(reader.list_runs(**filters, newest_first=newest_first, after=outside))
        finally:
            for shard in shards.values():
                if rocksdb:
                    shard.close()


@pytest.mark.parametrize('newest_first', [True, False])
def test_a_page_reads_about_its_own_keys_whatever_the_number_of_runs(newest_first: bool) -> None:
    partitions = 3
    runs: list[RunSpec] = [(f'run-{i:05d}', i * 1000, None, None, 'completed', None) for i in range(3000)]
    shards: dict[int, Any] = {p: CountingShard() for p in range(partitions)}
    _write(shards, runs, partitions)
    reader = ProjectionReader(shards, partitions=partitions)
    middle = runs[1500][0]
    for after in (None, middle):
        CountingShard.handed = 0
        page = asyncio.run(reader.list_runs(newest_first=newest_first, after=after, limit=50))
        assert len(page) == 50
        assert CountingShard.handed <= 50 + 2 * partitions, (after, CountingShard.handed)
