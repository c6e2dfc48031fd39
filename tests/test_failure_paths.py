"""Failure paths that tell the truth: every failed run ends `failed` in the log, with no gaps.

S3 and the broker are stopped and started again in the middle of runs (each test has its own
embedded stack, so the shared one stays up for everyone else).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream import MediaUnavailable, RecordTooLarge, Settings, StepStreamUnavailable
from stepstream.embedded import EmbeddedStack
from stepstream.kafka_client import client_options
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import RunRecord, ToolEffectTransition, decode

from agents import calls_then_answers

pytestmark = pytest.mark.broker

RUNS = 4


def ended_failed_without_gaps(run: RunRecord | None, error: str) -> bool:
    return (
        run is not None
        and run.status == 'failed'
        and error in (run.error or '')
        and run.gaps == []
        and run.event_count == run.last_seq + 1
        and run.conflicting_writers == []
    )


async def test_s3_down_mid_run_still_ends_every_run_failed(tmp_path: Path) -> None:
    async with EmbeddedStack(tmp_path / 'stack', partitions=1) as stack:
        # Every snapshot of these runs needs S3: the prompt alone is above the media threshold.
        settings = stack.settings.replace(media_threshold_bytes=1024)
        prompt = 'a long brief ' * 200
        async with EventLog(settings) as log, Projector(settings) as projector:
            in_tool = asyncio.Barrier(RUNS + 1)
            s3_stopped = asyncio.Event()
            agent = Agent(
                calls_then_answers('work'), capabilities=[StepPersistence(log=log, agent_name='s3')]
            )

            @agent.tool_plain
            async def work() -> str:
                await in_tool.wait()
                await s3_stopped.wait()
                return 'worked'

            runs = [asyncio.create_task(agent.run(prompt, conversation_id='s3-down')) for _ in range(RUNS)]
            await in_tool.wait()  # every run is inside its tool: S3 goes away now
            await asyncio.to_thread(stack.stop_s3)
            s3_stopped.set()
            results = await asyncio.gather(*runs, return_exceptions=True)
            assert all(isinstance(r, MediaUnavailable) for r in results), results
            assert all(
                'could not save or confirm the failure snapshot' in ' '.join(r.__notes__) for r in results
            )  # type: ignore[union-attr]
            await asyncio.to_thread(stack.start_s3)

            await projector.wait_for(await log.flush())
            runs_seen = await ProjectionReader.of(projector).list_runs(conversation_id='s3-down')
            assert len(runs_seen) == RUNS
            assert all(ended_failed_without_gaps(run, 'MediaUnavailable') for run in runs_seen), runs_seen
            assert all('(failure snapshot: MediaUnavailable' in (run.error or '') for run in runs_seen)


async def test_broker_down_mid_run_every_failed_run_ends_failed_once_it_is_back(tmp_path: Path) -> None:
    async with EmbeddedStack(tmp_path / 'stack', partitions=1, durable=True) as stack:
        settings = stack.settings.replace(ack_timeout_s=2)
        async with EventLog(settings) as log:
            in_tool = asyncio.Barrier(RUNS + 1)
            broker_stopped = asyncio.Event()

            def agent(run_id: str) -> Agent[None, str]:
                persisted = Agent(
                    calls_then_answers('work'), capabilities=[StepPersistence(log=log, run_id=run_id)]
                )

                @persisted.tool_plain
                async def work() -> str:
                    await in_tool.wait()
                    await broker_stopped.wait()
                    return 'worked'

                return persisted

            mid_run = [asyncio.create_task(agent(f'mid-{i}').run('go')) for i in range(RUNS)]
            await in_tool.wait()  # every run is inside its tool: the broker goes away now
            await asyncio.to_thread(stack.stop_broker)
            broker_stopped.set()
            # Runs that start while the broker is away fail at their `run_started`.
            during = [asyncio.create_task(agent(f'during-{i}').run('go')) for i in range(2)]
            results = await asyncio.gather(*mid_run, *during, return_exceptions=True)
            assert all(isinstance(r, StepStreamUnavailable) for r in results), results
            # Two operators' resolutions of one call share its seq: both are kept, neither merged.
            resolutions = [resolution('mid-0', note) for note in ('first look', 'second look')]
            for record in resolutions:
                await log.append(record)

            await asyncio.to_thread(stack.start_broker)
            position = await log.flush(timeout=60)  # the kept records, run_failed included, go now
        logged = await read_log(settings, position)
        assert [r for r in logged if getattr(r, 'status', None) == 'resolved'] == resolutions
        async with Projector(settings) as projector:
            await projector.wait_for(position)
            reader = ProjectionReader.of(projector)
            for run_id in [*(f'mid-{i}' for i in range(RUNS)), 'during-0', 'during-1']:
                run = await reader.get_run(run_id)
                assert ended_failed_without_gaps(run, 'StepStreamUnavailable'), run
                kinds = [e.kind for e in await reader.list_events(run_id)]
                assert kinds[0] == 'run_started' and kinds[-1] == 'run_failed', kinds
            assert [e.tool_call_id for e in await reader.list_unresolved_tool_effects()] == []
            assert [(await reader.get_run(f'during-{i}')).event_count for i in range(2)] == [2, 2]  # type: ignore[union-attr]


def resolution(run_id: str, note: str) -> ToolEffectTransition:
    return ToolEffectTransition(
        run_id=run_id,
        seq=3,
        writer_id='stepstream-cli@test:1',
        timestamp=datetime.now(UTC),
        tool_call_id='call-1',
        tool_name='work',
        status='resolved',
        resolution='happened',
        resolved_by='operator',
        note=note,
    )


async def read_log(settings: Settings, position: dict[TopicPartition, int]) -> list[object]:
    """Every record in the log up to `position`, decoded, in partition order."""
    consumer = AIOKafkaConsumer(**client_options(settings.kafka), enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(list(position))
        await consumer.seek_to_beginning(*position)
        records: list[object] = []
        while [tp for tp, end in position.items() if await consumer.position(tp) < end]:
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                records.extend(decode(m.value) for m in batch if m.value is not None)
        return records
    finally:
        await consumer.stop()


async def test_a_record_too_large_takes_no_seq(settings: Settings, projector: Projector) -> None:
    def huge_call(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        # Each value under the threshold, none free-form: nothing can move, the record is too large.
        many = [TextPart(f'{i}' + 'x' * 900) for i in range(20)]
        return ModelResponse(parts=[*many, ToolCallPart('store', {}, tool_call_id='c')])

    async with EventLog(settings.replace(media_threshold_bytes=1024), max_record_bytes=4096) as log:
        agent = Agent(FunctionModel(huge_call), capabilities=[StepPersistence(log=log, run_id='too-large')])

        @agent.tool_plain
        def store() -> str:
            return 'stored'

        with pytest.raises(RecordTooLarge):
            await agent.run('say a lot')
        await projector.wait_for(await log.flush())
    run = await ProjectionReader.of(projector).get_run('too-large')
    assert ended_failed_without_gaps(run, 'RecordTooLarge'), run


async def test_a_record_refused_by_the_id_rule_takes_no_seq(
    event_log: EventLog, projector: Projector
) -> None:
    def long_call_id(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[ToolCallPart('lookup', {}, tool_call_id='c' * 2000)])

    agent = Agent(FunctionModel(long_call_id), capabilities=[StepPersistence(log=event_log, run_id='bad-id')])

    @agent.tool_plain
    def lookup() -> str:
        return 'found'

    with pytest.raises(ValueError, match='tool_call_id is 2000 bytes'):
        await agent.run('go')
    await projector.wait_for(await event_log.flush())
    run = await ProjectionReader.of(projector).get_run('bad-id')
    assert ended_failed_without_gaps(run, 'tool_call_id is 2000 bytes'), run


async def test_a_run_that_fails_at_once_still_has_its_run_started(
    event_log: EventLog, projector: Projector
) -> None:
    def broken(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise RuntimeError('model is down')

    agent = Agent(
        FunctionModel(broken), capabilities=[StepPersistence(log=event_log, run_id='fails-at-once')]
    )
    with pytest.raises(RuntimeError):
        await agent.run('go')
    await projector.wait_for(await event_log.flush())
    run = await ProjectionReader.of(projector).get_run('fails-at-once')
    assert ended_failed_without_gaps(run, 'model is down'), run


async def test_records_the_broker_never_took_are_named_when_the_log_closes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with EmbeddedStack(tmp_path / 'stack', partitions=1) as stack:
        settings = stack.settings.replace(ack_timeout_s=1)
        log = EventLog(settings)
        await log.start()
        agent = Agent(calls_then_answers('work'), capabilities=[StepPersistence(log=log, run_id='lost-1')])

        @agent.tool_plain
        async def work() -> str:
            await asyncio.to_thread(stack.stop_broker)
            return 'worked'

        with pytest.raises(StepStreamUnavailable) as failure:
            await agent.run('go')
        assert 'kept and sent again' in ' '.join(failure.value.__notes__)
        with pytest.raises(StepStreamUnavailable, match='did not take'):
            await log.flush()
        with caplog.at_level('WARNING', logger='stepstream.producer'):
            await log.close()
    assert 'did not take' in caplog.text and "'lost-1'" in caplog.text
