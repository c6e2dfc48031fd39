"""One log shared by agents on worker threads and event loops of their own, without a broker.

A web server or a task queue runs agents on its pool's threads: with `run_sync`, with `asyncio.run`
per request, or on a loop each worker keeps. The process shares one log (docs/recording.md's advice), so
records arrive from every loop at once. Here the log is an `InMemoryLog` and its records are
applied by the projector's rules (`MemoryProjection`); test_threads_e2e.py runs the same shapes
through one `EventLog` and the broker. No test sleeps: each waits for the record or event it needs.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream import Settings, StepStreamUnavailable
from stepstream.media import DiskMediaStore
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.schemas import UNCHAINED_KINDS, LogRecord, StepEvent, ToolEffectTransition

from agents import calls_then_answers
from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast

T = TypeVar('T')

THREADS = 4
RUNS = 3
CALLS = 2
QUIET = 60.0
"""A heartbeat interval no test waits out."""

STALL_S = 60.0
"""How long a test waits for what worker threads do before it calls them stalled (they never should)."""


def in_threads(*calls: Callable[[], T]) -> Awaitable[list[T]]:
    """Run each call on a daemon thread of its own, at once; their results, in order.

    Daemon threads, not a pool: a stalled worker must fail its test (`stalled`), not hang the
    interpreter's exit joining it.
    """
    loop = asyncio.get_running_loop()
    results: list[asyncio.Future[T]] = [loop.create_future() for _ in calls]

    def run(call: Callable[[], T], result: asyncio.Future[T]) -> None:
        try:
            value = call()
        except BaseException as error:
            loop.call_soon_threadsafe(result.set_exception, error)
        else:
            loop.call_soon_threadsafe(result.set_result, value)

    for call, result in zip(calls, results, strict=True):
        threading.Thread(target=run, args=(call, result), daemon=True).start()
    return asyncio.gather(*results)


async def stalled(waiting: Awaitable[T], what: str) -> T:
    """`waiting`, or a failure naming `what` if it has not come after `STALL_S` (a stall, not a slow run)."""
    try:
        return await asyncio.wait_for(waiting, STALL_S)
    except TimeoutError:
        raise AssertionError(f'{what} did not come in {STALL_S:g}s: stalled') from None


class LoopThread:
    """A thread that keeps an event loop of its own running until closed: a server's worker."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name='worker-loop', daemon=True)
        self.thread.start()

    def submit(self, work: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture
def worker() -> Iterator[LoopThread]:
    running = LoopThread()
    yield running
    running.close()


def agent_for(log: InMemoryLog, name: str, store: DiskMediaStore) -> Agent[None, str]:
    agent = Agent(
        calls_then_answers('lookup', calls=CALLS),
        capabilities=[StepPersistence(log=log, agent_name=name, media_store=store)],
    )

    @agent.tool_plain
    def lookup() -> str:
        return 'found'

    return agent


def work(log: InMemoryLog, n: int, store: DiskMediaStore, ready: threading.Barrier) -> list[str]:
    """Worker `n`'s runs: `run_sync`, one `asyncio.run` per run, or concurrent runs on one loop."""
    agent = agent_for(log, f'worker-{n}', store)
    ready.wait()  # every worker at once
    conversations = [f'conv-{n}-{i}' for i in range(RUNS)]
    if n % 3 == 0:
        results = [agent.run_sync('find', conversation_id=c) for c in conversations]
    elif n % 3 == 1:
        results = [asyncio.run(agent.run('find', conversation_id=c)) for c in conversations]
    else:

        async def together() -> list[Any]:
            return await asyncio.gather(*(agent.run('find', conversation_id=c) for c in conversations))

        results = asyncio.run(together())
    return [result.output for result in results]


def chained_seqs(log: InMemoryLog) -> dict[tuple[str, str], list[int]]:
    """Each run's seqs on each topic, in the order the log stored them (heartbeats aside)."""
    seqs: dict[tuple[str, str], list[int]] = defaultdict(list)
    for stored in log.records:
        record = stored.record
        if not (isinstance(record, StepEvent) and record.kind in UNCHAINED_KINDS):
            seqs[record.run_id, stored.topic].append(record.seq)
    return dict(seqs)


def kind_of(record: LogRecord) -> str:
    return record.kind if isinstance(record, StepEvent) else f'effect {record.status}'


async def test_runs_on_worker_threads_and_loops_at_once_are_recorded_whole_and_in_order(
    tmp_path: Path,
) -> None:
    log = InMemoryLog(Settings(partitions=3))
    store = DiskMediaStore(tmp_path)
    ready = threading.Barrier(THREADS)
    workers = in_threads(*(functools.partial(work, log, n, store, ready) for n in range(THREADS)))
    outputs = await stalled(workers, "the worker threads' runs")
    assert outputs == [[f'answered after {CALLS} tool calls'] * RUNS] * THREADS
    # A flush from another thread's loop sees what every loop stored, as one from this loop does.
    [position] = await stalled(in_threads(lambda: asyncio.run(log.flush())), 'a flush on another loop')
    assert position == await log.flush()
    assert sum(position.values()) == len(log.records)

    projection = MemoryProjection(log)
    await projection.wait_for(position)
    reader = projection.reader()
    for n in range(THREADS):
        for i in range(RUNS):
            [run] = await reader.list_runs(conversation_id=f'conv-{n}-{i}')
            assert (run.status, run.agent_name) == ('completed', f'worker-{n}'), run
            assert (run.gaps, run.rejected, run.chain) == ([], {}, 'intact'), run
            kinds = [e.kind for e in await reader.list_events(run.run_id)]
            assert kinds[0] == 'run_started' and kinds[-1] == 'run_completed', kinds
            assert kinds.count('tool_call_completed') == CALLS
    assert projection.dead == [] and projection.duplicates_ignored == 0
    by_run = chained_seqs(log)
    assert len({run_id for run_id, _topic in by_run}) == THREADS * RUNS
    for key, seqs in by_run.items():
        assert seqs == sorted(set(seqs)), (key, seqs)  # stored in seq order, none twice
    offsets: dict[tuple[str, int], list[int]] = defaultdict(list)
    for stored in log.records:
        offsets[stored.topic, stored.partition].append(stored.offset)
    assert all(o == list(range(len(o))) for o in offsets.values())  # one order per partition


async def test_a_durability_point_on_a_worker_thread_fails_after_the_timeout(tmp_path: Path) -> None:
    log = InMemoryLog(Settings(partitions=3, ack_timeout_s=0.2))
    ran = threading.Event()
    agent = Agent(
        calls_then_answers('act'),
        capabilities=[StepPersistence(log=log, run_id='held', media_store=DiskMediaStore(tmp_path))],
    )

    @agent.tool_plain
    def act() -> str:
        ran.set()
        return 'done'

    log.hold_acks()  # a broker that does not answer, held from this loop
    with pytest.raises(StepStreamUnavailable, match='did not acknowledge'):
        await stalled(in_threads(lambda: agent.run_sync('go')), 'the run')
    assert not ran.is_set()
    with pytest.raises(StepStreamUnavailable, match='did not acknowledge'):
        await stalled(in_threads(lambda: asyncio.run(log.flush())), 'a flush on another loop')
    log.release_acks()
    await log.flush()
    assert [kind_of(r.record) for r in log.records] == ['run_started', 'run_failed']


async def test_acknowledgements_released_from_another_thread_let_the_tool_run(tmp_path: Path) -> None:
    log = InMemoryLog(Settings(partitions=3))
    ran = threading.Event()
    calls = calls_then_answers('act')

    def holding(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:  # the first turn, on the worker's loop: run_started is acknowledged
            log.hold_acks()  # the "broker" stops answering
        assert calls.function is not None
        response = calls.function(messages, info)
        assert isinstance(response, ModelResponse)
        return response

    agent = Agent(
        FunctionModel(holding),
        capabilities=[StepPersistence(log=log, run_id='w', media_store=DiskMediaStore(tmp_path))],
    )

    @agent.tool_plain
    def act() -> str:
        ran.set()
        return 'done'

    running = in_threads(lambda: agent.run_sync('go'))
    started = await stalled(
        log.wait_for_record(lambda r: isinstance(r, ToolEffectTransition) and r.status == 'started'),
        'the `started` transition',
    )
    assert not ran.is_set()  # write-ahead: the held `started` keeps the tool from running
    log.release_acks()  # this loop releases the worker loop's acknowledgements
    [result] = await stalled(running, 'the run')
    assert ran.is_set() and result.output == 'answered after 1 tool calls'
    assert started.record.tool_name == 'act'
    kinds = [kind_of(r.record) for r in log.records if r.record.run_id == 'w']
    assert kinds[0] == 'run_started' and kinds[-1] == 'run_completed'


async def test_closing_from_another_loop_ends_a_run_open_on_a_worker_loop(
    tmp_path: Path, worker: LoopThread
) -> None:
    log = InMemoryLog(Settings(partitions=3, heartbeat_interval_s=QUIET))
    entered = threading.Event()
    agent = Agent(
        calls_then_answers('wait'),
        capabilities=[StepPersistence(log=log, run_id='open', media_store=DiskMediaStore(tmp_path))],
    )

    @agent.tool_plain
    async def wait() -> str:
        entered.set()
        await asyncio.Event().wait()  # until cancelled
        return 'never'

    running = worker.submit(agent.run('go'))
    assert await asyncio.to_thread(entered.wait, STALL_S), 'the tool did not start: stalled'
    assert log.liveness.open_runs == 1  # kept by the worker's loop, the first to open a run
    await log.close()  # on this loop: the run's end is appended on the worker's loop
    running.cancel()  # the process goes on to cancel the run: its end is written already
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wrap_future(running)
    ends = [
        (r.record.kind, r.record.error)
        for r in log.records
        if isinstance(r.record, StepEvent)
        and r.record.kind in ('run_cancelled', 'run_failed', 'run_completed')
    ]
    assert ends == [('run_cancelled', 'the process closed its EventLog while the run was open')]
    projection = MemoryProjection(log)
    await projection.wait_for()
    run = await projection.reader().get_run('open')
    assert run is not None and run.status == 'cancelled' and run.gaps == [] and run.chain == 'intact'


async def test_this_loop_keeps_a_worker_loops_run_alive(tmp_path: Path) -> None:
    log = InMemoryLog(Settings(partitions=3, heartbeat_interval_s=0.05))
    log.liveness.bind(asyncio.get_running_loop())  # as `EventLog.start` binds it to the log's loop
    release = threading.Event()
    agent = Agent(
        calls_then_answers('wait'),
        capabilities=[StepPersistence(log=log, run_id='quiet', media_store=DiskMediaStore(tmp_path))],
    )

    @agent.tool_plain
    def wait() -> str:
        release.wait()
        return 'done'

    running = in_threads(lambda: agent.run_sync('go'))
    try:
        beat = await stalled(
            log.wait_for_record(lambda r: isinstance(r, StepEvent) and r.kind == 'run_heartbeat'),
            "a heartbeat of the worker thread's run",
        )
    finally:
        release.set()
    await stalled(running, 'the run')
    assert beat.record.run_id == 'quiet'
    await log.flush()
    seqs = [r.record.seq for r in log.records if kind_of(r.record) != 'run_heartbeat']
    assert seqs == list(range(len(seqs)))  # heartbeats took no seq
    assert log.liveness.open_runs == 0
    await log.close()


async def test_records_of_many_threads_each_keep_their_order() -> None:
    log = InMemoryLog(Settings(partitions=1))
    per_thread = 200

    async def append_all(name: str) -> None:
        acks = [
            await log.append(
                StepEvent(run_id=name, seq=i, writer_id='w', timestamp=datetime.now(UTC), kind='run_started')
            )
            for i in range(per_thread)
        ]
        await log.wait_acked(acks)
        assert [ack.result().offset for ack in acks] == sorted(ack.result().offset for ack in acks)

    names = [f't{n}' for n in range(THREADS)]
    await stalled(
        in_threads(*(functools.partial(asyncio.run, append_all(name)) for name in names)), 'the appends'
    )
    assert {name: seqs for (name, _topic), seqs in chained_seqs(log).items()} == {
        name: list(range(per_thread)) for name in names
    }
    assert [r.offset for r in log.records] == list(range(THREADS * per_thread))
