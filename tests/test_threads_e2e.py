"""One `EventLog`, started on one loop, serving agents on worker threads and loops of their own.

The way a web or task-queue worker runs agents: the process opens one `EventLog` (docs/recording.md's
advice) on its loop, and each request runs its agent on a thread of the server's pool, with
`run_sync` or with `asyncio.run`. Every run must complete with every record in the log, in `seq`
order on its partition, durability points included. The acknowledgement timeout is short: a
log that completes another loop's futures from its own thread (as it did) left each durability
point waiting it out, and then failing; a log that cannot serve another loop must refuse at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from pydantic_ai import Agent

from stepstream import Settings, StepStreamError, StepStreamUnavailable
from stepstream.embedded import EmbeddedStack
from stepstream.kafka_client import client_options
from stepstream.producer import EventLog, StepPersistence
from stepstream.producer._liveness import CLOSED_WHILE_OPEN
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import UNCHAINED_KINDS, LogRecord, StepEvent, decode

from agents import calls_then_answers
from waits import until

pytestmark = pytest.mark.broker

THREADS = 4
RUNS_PER_THREAD = 3
CALLS = 2


def agent_for(log: EventLog, name: str) -> Agent[None, str]:
    agent = Agent(
        calls_then_answers('lookup', calls=CALLS), capabilities=[StepPersistence(log=log, agent_name=name)]
    )

    @agent.tool_plain
    def lookup() -> str:
        return 'found'

    return agent


def work(log: EventLog, worker: int, *, ready: threading.Barrier) -> list[str]:
    """One worker thread: its runs, by `run_sync` on even workers and `asyncio.run` on odd ones."""
    ready.wait()  # every thread runs at once, beside the others
    agent = agent_for(log, f'worker-{worker}')
    outputs = []
    for n in range(RUNS_PER_THREAD):
        conversation = f'conv-{worker}-{n}'
        if worker % 2 == 0:
            result = agent.run_sync('find', conversation_id=conversation)
        else:
            result = asyncio.run(agent.run('find', conversation_id=conversation))
        outputs.append(result.output)
    return outputs


async def test_one_log_serves_runs_on_worker_threads_at_once(settings: Settings, db_path: Path) -> None:
    settings = settings.replace(ack_timeout_s=2.0)
    async with EventLog(settings) as log:  # started on this test's loop; the runs are on others
        ready = threading.Barrier(THREADS)
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(THREADS) as pool:
            outputs = await asyncio.gather(
                *(loop.run_in_executor(pool, lambda w=w: work(log, w, ready=ready)) for w in range(THREADS))
            )
        assert outputs == [[f'answered after {CALLS} tool calls'] * RUNS_PER_THREAD] * THREADS
        # A flush from another thread's loop waits for the log's records like one on the log's loop.
        position = await asyncio.to_thread(asyncio.run, log.flush())
        assert position == await log.flush()
    async with Projector(settings, db_path=db_path) as projector:
        await projector.wait_for(position)
        reader = ProjectionReader.of(projector)
        for worker in range(THREADS):
            for n in range(RUNS_PER_THREAD):
                [run] = await reader.list_runs(conversation_id=f'conv-{worker}-{n}')
                assert run.status == 'completed', run
                assert run.agent_name == f'worker-{worker}'
                assert (run.gaps, run.rejected, run.chain) == ([], {}, 'intact'), run
                assert run.event_count == run.last_seq + 1
                kinds = [e.kind for e in await reader.list_events(run.run_id)]
                assert kinds[0] == 'run_started' and kinds[-1] == 'run_completed', kinds
                assert kinds.count('tool_call_completed') == CALLS
    # As written: each run's records in seq order on its partition of each topic.
    by_run = await seqs_by_run(settings, position)
    assert len({run_id for run_id, _topic in by_run}) == THREADS * RUNS_PER_THREAD
    for (run_id, topic), seqs in by_run.items():
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), (run_id, topic, seqs)


async def test_a_durability_point_on_a_worker_thread_fails_when_the_broker_is_away(tmp_path: Path) -> None:
    async with EmbeddedStack(tmp_path / 'stack', partitions=1, durable=True) as stack:
        settings = stack.settings.replace(ack_timeout_s=2.0)
        async with EventLog(settings) as log:
            in_tool, broker_stopped = threading.Event(), threading.Event()
            agent = Agent(calls_then_answers('work'), capabilities=[StepPersistence(log=log, run_id='away')])

            @agent.tool_plain
            def work() -> str:  # runs on the worker's loop's thread pool
                in_tool.set()
                broker_stopped.wait()
                return 'worked'

            loop = asyncio.get_running_loop()
            running = loop.run_in_executor(None, outcome_of, lambda: agent.run_sync('go'))
            await asyncio.to_thread(in_tool.wait)
            await asyncio.to_thread(stack.stop_broker)
            broker_stopped.set()
            # The snapshot after the tool is a durability point: it waits, then fails as on the log's loop.
            error = await running
            assert isinstance(error, StepStreamUnavailable), error
            assert 'did not acknowledge' in str(error)
            await asyncio.to_thread(stack.start_broker)
            position = await log.flush(timeout=60)  # its kept records, run_failed included, go now
        async with Projector(settings) as projector:
            await projector.wait_for(position)
            run = await ProjectionReader.of(projector).get_run('away')
            assert run is not None and run.status == 'failed' and run.gaps == [], run


async def test_the_logs_loop_keeps_a_worker_run_alive_and_ends_it_on_close(
    settings: Settings, db_path: Path
) -> None:
    settings = settings.replace(ack_timeout_s=2.0, heartbeat_interval_s=0.2)
    release = threading.Event()
    log = EventLog(settings)
    await log.start()
    agent = Agent(calls_then_answers('wait'), capabilities=[StepPersistence(log=log, run_id='open')])

    @agent.tool_plain
    def wait() -> str:
        release.wait()
        return 'done'

    running = asyncio.get_running_loop().run_in_executor(None, outcome_of, lambda: agent.run_sync('go'))
    try:
        await until(lambda: log.liveness.sent, "a heartbeat of the worker thread's run")
        await log.close()  # on this loop: the run's end is appended on the worker's loop
    finally:
        release.set()
    assert isinstance(await running, StepStreamError)  # its next record found the log closed
    position = log.position
    by_run = await records_by_run(settings, position)
    kinds = [kind_of(record) for record in by_run['open', settings.topics.step_events_topic]]
    assert 'run_heartbeat' in kinds and kinds[-1] == 'run_cancelled', kinds
    async with Projector(settings, db_path=db_path) as projector:
        await projector.wait_for(position)
        run = await ProjectionReader.of(projector).get_run('open')
        assert run is not None and run.status == 'cancelled' and run.gaps == [], run
        assert run.error == CLOSED_WHILE_OPEN


def test_a_log_whose_loop_has_gone_refuses_the_first_append(settings: Settings) -> None:
    log = EventLog(settings.replace(ack_timeout_s=2.0))
    asyncio.run(log.start())  # its loop ends here: nothing drives its producer any more
    agent = agent_for(log, 'late')
    with pytest.raises(StepStreamError, match='event loop it was started on was closed') as refused:
        agent.run_sync('find')
    assert 'One EventLog per process' in str(refused.value)  # where docs/recording.md says what to do
    asyncio.run(log.close())  # says what is lost, does not hang


def outcome_of(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except BaseException as error:
        return error
    return None


async def seqs_by_run(
    settings: Settings, position: dict[TopicPartition, int]
) -> dict[tuple[str, str], list[int]]:
    """Every chained record's seq, per run and topic, in the order its partition holds them."""
    return {
        key: [r.seq for r in records if not (isinstance(r, StepEvent) and r.kind in UNCHAINED_KINDS)]
        for key, records in (await records_by_run(settings, position)).items()
    }


async def records_by_run(
    settings: Settings, position: dict[TopicPartition, int]
) -> dict[tuple[str, str], list[LogRecord]]:
    """Every record up to `position`, per run and topic, in the order its partition holds them."""
    consumer = AIOKafkaConsumer(**client_options(settings.kafka), enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(list(position))
        await consumer.seek_to_beginning(*position)
        by_run: dict[tuple[str, str], list[LogRecord]] = defaultdict(list)
        while [tp for tp, end in position.items() if await consumer.position(tp) < end]:
            for tp, batch in (await consumer.getmany(timeout_ms=1000)).items():
                for message in batch:
                    if message.value is not None and message.offset < position[tp]:
                        record = decode(message.value)
                        by_run[record.run_id, tp.topic].append(record)
        return dict(by_run)
    finally:
        await consumer.stop()


def kind_of(record: LogRecord) -> str:
    return record.kind if isinstance(record, StepEvent) else f'effect {record.status}'
