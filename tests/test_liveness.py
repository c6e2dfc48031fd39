"""Writer liveness without a broker: heartbeats, ends written on close, and how readers judge them.

The same rules run end to end on both brokers in test_liveness_e2e.py (a SIGKILLed writer, a slow
live tool, SIGSTOP/SIGCONT, SIGTERM); here the capability appends to `InMemoryLog` and its records
are applied by the projector's `Applier` into RocksDB, so each rule is checked in milliseconds.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent, RunContext

from stepstream import Settings
from stepstream.errors import EffectInFlight
from stepstream.media import DiskMediaStore
from stepstream.producer import InMemoryLog, StepPersistence, resolution_for
from stepstream.producer._liveness import unwatch_sigterm, watch_sigterm
from stepstream.projector._apply import EFFECTS, EVENTS, Applier, SourceRecord
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import StepEvent, ToolEffectRecord, ToolEffectTransition, encode
from stepstream.storage import MemoryShard
from stepstream.topics import murmur2_partition

from agents import calls_then_answers

pytestmark = [pytest.mark.fast, pytest.mark.once]

QUIET = 60.0
"""A heartbeat interval no test waits out: each test runs a heartbeat pass itself (`beat(now=...)`)."""


class Projection:
    """The records of an `InMemoryLog` (or any list), applied by the projector's rules to an in-memory
    shard (test_liveness_e2e.py proves the same rules through the broker and RocksDB)."""

    def __init__(self, path: Path, settings: Settings) -> None:
        self.settings = settings
        self.db = MemoryShard()
        self.applier = Applier(
            (settings.topics.step_events_topic, settings.topics.tool_effects_topic),
            partitions=settings.topics.partitions,
        )
        self.dead: list[str] = []
        self.offsets: dict[tuple[int, int], int] = {}

    def apply(self, records: list[StepEvent | ToolEffectTransition]) -> None:
        sources = []
        for record in records:
            topic = EVENTS if isinstance(record, StepEvent) else EFFECTS
            key = record.run_id.encode()
            partition = murmur2_partition(key, self.settings.topics.partitions)
            offset = self.offsets.get((topic, partition), 0)
            self.offsets[(topic, partition)] = offset + 1
            sources.append(SourceRecord(topic, partition, offset, key, encode(record)))
        txn, outcome = self.applier.stage(self.db, sources)
        txn.commit()
        self.dead += [d.reason for d in outcome.dead]

    def reader(self, stale_after_s: float = 20.0) -> ProjectionReader:
        return ProjectionReader(self.db, stale_after_s=stale_after_s)


@pytest.fixture
def projection(tmp_path: Path) -> Iterator[Projection]:
    p = Projection(tmp_path / 'proj', Settings(partitions=3))
    yield p
    p.db.close()


def quiet_log() -> InMemoryLog:
    return InMemoryLog(Settings(partitions=3, heartbeat_interval_s=QUIET))


def heartbeats(log: InMemoryLog, run_id: str | None = None) -> list[StepEvent]:
    return [
        r.record
        for r in log.records
        if isinstance(r.record, StepEvent)
        and r.record.kind == 'run_heartbeat'
        and (run_id is None or r.record.run_id == run_id)
    ]


class InTool:
    """An agent whose one tool waits until released: a run that is open and quiet."""

    def __init__(self, log: InMemoryLog, run_id: str, tmp_path: Path) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.agent = Agent(
            calls_then_answers('work'),
            capabilities=[StepPersistence(log=log, run_id=run_id, media_store=DiskMediaStore(tmp_path))],
        )

        @self.agent.tool
        async def work(ctx: RunContext[Any]) -> str:
            self.entered.set()
            await self.release.wait()
            return 'done'

    async def start(self) -> asyncio.Task[Any]:
        task = asyncio.create_task(self.agent.run('go'))
        await asyncio.wait_for(self.entered.wait(), 10)
        return task


async def test_a_quiet_run_gets_one_heartbeat_per_interval_and_a_busy_one_none(tmp_path: Path) -> None:
    log = quiet_log()
    tool = InTool(log, 'quiet-run', tmp_path)
    task = await tool.start()
    assert await log.liveness.beat() == 0  # it just wrote its tool_call_started: busy enough
    written = len(log.records)

    later = time.monotonic() + QUIET
    assert await log.liveness.beat(now=later) == 1
    assert await log.liveness.beat(now=later) == 0  # one per run per interval at most
    [beat] = heartbeats(log, 'quiet-run')
    run_records = [r.record for r in log.records[:written] if r.record.run_id == 'quiet-run']
    assert beat.seq == len(run_records)  # names the next seq; takes none
    assert beat.writer_id == run_records[0].writer_id  # the run's own writer

    tool.release.set()
    await task
    await log.flush()
    seqs = [r.record.seq for r in log.records if r.record.run_id == 'quiet-run' and r.record is not beat]
    assert seqs == list(range(len(seqs)))  # the heartbeat left no gap and took no seq
    assert await log.liveness.beat(now=later + 10 * QUIET) == 0  # an ended run is not kept alive
    assert log.liveness.open_runs == 0


async def test_ten_thousand_open_runs_cost_one_heartbeat_each_and_leave_the_loop_free() -> None:
    log = quiet_log()
    handles = []
    for i in range(10_000):
        handles.append(
            log.liveness.open(
                f'idle-{i}',
                heartbeat=lambda i=i: StepEvent(
                    run_id=f'idle-{i}',
                    seq=1,
                    writer_id='w',
                    timestamp=datetime.now(UTC),
                    kind='run_heartbeat',
                ),
                end=_no_end,
            )
        )
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count_turns())
    later = time.monotonic() + QUIET
    assert await log.liveness.beat(now=later) == 10_000
    assert await log.liveness.beat(now=later + QUIET / 2) == 0
    counter.cancel()
    assert len(heartbeats(log)) == 10_000
    assert len({b.run_id for b in heartbeats(log)}) == 10_000
    assert turns >= 10_000 // 256 - 1  # the pass yielded to the loop as it went
    for handle in handles:
        log.liveness.close(handle)


async def _no_end(reason: str) -> None:
    return None


async def test_closing_the_log_ends_open_runs_as_cancelled_once(
    tmp_path: Path, projection: Projection
) -> None:
    log = quiet_log()
    tool = InTool(log, 'closed-run', tmp_path)
    task = await tool.start()
    await log.close()
    task.cancel()  # the process goes on to cancel the run: its end is written already
    with pytest.raises(asyncio.CancelledError):
        await task
    ends = [
        r.record
        for r in log.records
        if isinstance(r.record, StepEvent) and r.record.kind in ('run_cancelled', 'run_failed')
    ]
    assert [(e.kind, e.error) for e in ends] == [
        ('run_cancelled', 'the process closed its EventLog while the run was open')
    ]
    projection.apply([r.record for r in log.records])
    run = await projection.reader().get_run('closed-run')
    assert run is not None and run.status == 'cancelled' and run.error == ends[0].error
    [effect] = await projection.reader().list_unresolved_tool_effects('closed-run')
    assert effect.doubt == 'unknown_after_crash'  # a cancelled run will not finish its call


def record(kind: str, seq: int, at: datetime, *, writer: str = 'owner', run_id: str = 'r') -> StepEvent:
    return StepEvent(
        run_id=run_id,
        seq=seq,
        writer_id=writer,
        timestamp=at,
        kind=kind,  # type: ignore[arg-type]
        tool_call_id='call-1' if kind.startswith('tool_call') else None,
        tool_name='send' if kind.startswith('tool_call') else None,
    )


def started(seq: int, at: datetime) -> ToolEffectTransition:
    return ToolEffectTransition(
        run_id='r',
        seq=seq,
        writer_id='owner',
        timestamp=at,
        tool_call_id='call-1',
        tool_name='send',
        status='started',
    )


async def test_a_run_is_live_while_its_writer_speaks_and_stale_once_it_stops(projection: Projection) -> None:
    now = datetime.now(UTC)
    long_ago = now - timedelta(minutes=10)
    projection.apply(
        [record('run_started', 0, long_ago), started(1, long_ago), record('tool_call_started', 2, long_ago)]
    )
    reader = projection.reader(stale_after_s=20)
    assert (await reader.get_run('r')).status == 'stale'  # type: ignore[union-attr]
    [effect] = await reader.list_unresolved_tool_effects()
    assert (effect.doubt, effect.unknown_after_crash, effect.in_flight) == (
        'unknown_after_crash',
        True,
        False,
    )

    projection.apply([record('run_heartbeat', 3, now - timedelta(seconds=2))])  # the writer is back
    run = await reader.get_run('r')
    assert run is not None and run.status == 'running' and run.event_count == 3  # it took no seq
    [effect] = await reader.list_unresolved_tool_effects()
    assert (effect.doubt, effect.unknown_after_crash, effect.in_flight) == ('in_flight', False, True)
    assert [e.kind for e in await reader.list_events('r')] == ['run_started', 'tool_call_started']
    assert (await reader.list_tool_effects('r'))[0].in_flight
    assert (await reader.get_tool_effect('r', 'call-1')).in_flight  # type: ignore[union-attr]
    assert (await projection.reader(stale_after_s=1).get_run('r')).status == 'stale'  # type: ignore[union-attr]
    assert projection.dead == []


async def test_only_the_owner_speaks_for_its_run(projection: Projection) -> None:
    now = datetime.now(UTC)
    long_ago = now - timedelta(minutes=10)
    projection.apply(
        [
            record('run_heartbeat', 0, now, run_id='unborn'),  # before any run_started of its run
            record('run_started', 0, long_ago),
            record('run_heartbeat', 1, now, writer='intruder'),
        ]
    )
    assert projection.dead == ['stray_heartbeat', 'stray_heartbeat']
    reader = projection.reader()
    assert (await reader.get_run('r')).status == 'stale'  # type: ignore[union-attr]
    assert await reader.get_run('unborn') is None
    assert (await reader.get_run('r')).conflicting_writers == []  # type: ignore[union-attr]


async def test_a_writer_clock_in_the_future_buys_no_life(projection: Projection) -> None:
    now = datetime.now(UTC)
    projection.apply([record('run_started', 0, now - timedelta(minutes=10))])
    projection.apply([record('run_heartbeat', 1, now + timedelta(days=365))])
    assert (await projection.reader(stale_after_s=20).get_run('r')).status == 'stale'  # type: ignore[union-attr]
    projection.apply([record('run_heartbeat', 1, now + timedelta(seconds=5))])  # small skew: still a max fold
    assert (await projection.reader(stale_after_s=20).get_run('r')).status == 'stale'  # type: ignore[union-attr]


async def test_a_storm_of_heartbeats_costs_one_run_write(projection: Projection) -> None:
    now = datetime.now(UTC)
    projection.apply([record('run_started', 0, now)])
    keys_before = sum(1 for _ in projection.db.items())
    storm = [record('run_heartbeat', 5, now + timedelta(microseconds=i)) for i in range(5_000)]
    projection.apply(storm)
    assert sum(1 for _ in projection.db.items()) == keys_before  # nothing kept per heartbeat
    run = await projection.reader().get_run('r')
    assert run is not None and run.last_record_at == now + timedelta(microseconds=4_999)


def effect(*, in_flight: bool) -> ToolEffectRecord:
    return ToolEffectRecord(
        tool_call_id='call-1',
        tool_name='send',
        run_id='r',
        status='started',
        status_seq=1,
        in_flight=in_flight,
    )


def test_an_in_flight_call_is_resolved_only_with_force() -> None:
    with pytest.raises(EffectInFlight, match=r'in flight.*--force'):
        resolution_for(effect(in_flight=True), resolution='happened', note='x', operator='bob', writer_id='w')
    forced = resolution_for(
        effect(in_flight=True), resolution='happened', note='x', operator='bob', writer_id='w', force=True
    )
    assert forced.status == 'resolved' and forced.seq == 1
    assert resolution_for(
        effect(in_flight=False), resolution='happened', note='x', operator='bob', writer_id='w'
    )


async def test_sigterm_is_watched_only_where_nobody_else_handles_it() -> None:
    log = quiet_log()

    def theirs(signum: int, frame: object) -> None:
        return None

    previous = signal.signal(signal.SIGTERM, theirs)
    try:
        assert not watch_sigterm(log)  # a framework's graceful shutdown closes the log itself
        assert signal.getsignal(signal.SIGTERM) is theirs
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert watch_sigterm(log) and watch_sigterm(log)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        unwatch_sigterm(log)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the default action is back
    finally:
        signal.signal(signal.SIGTERM, previous)


async def test_a_run_hooked_from_another_loop_gets_no_timer() -> None:
    """A Temporal workflow's deterministic loop, say: no heartbeat timer may run there."""
    log = InMemoryLog(Settings(heartbeat_interval_s=QUIET))
    elsewhere = asyncio.new_event_loop()
    try:
        log.liveness.bind(elsewhere)  # the loop the log sends on
        assert log.liveness.open('r', heartbeat=lambda: _heartbeat_of('r'), end=_no_end) is None
        assert log.liveness.open_runs == 0
    finally:
        elsewhere.close()


def _heartbeat_of(run_id: str) -> StepEvent:
    return StepEvent(run_id=run_id, seq=0, writer_id='w', timestamp=datetime.now(UTC), kind='run_heartbeat')
