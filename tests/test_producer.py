"""The capability's write path on the real broker: identity, write-ahead, failure, limits."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import RecordMetadata
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream import MediaUnavailable, RecordTooLarge, Settings, StepStreamUnavailable
from stepstream.embedded import EmbeddedStack
from stepstream.ids import check_run_id, to_run_id
from stepstream.media import DiskMediaStore
from stepstream.producer import EventLog, StepPersistence, annotate_tool_effect
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import StepEvent, ToolEffectTransition, decode

from agents import answers, calls_then_answers


async def read_all(settings: Settings, topic: str) -> list[object]:
    """Everything on `topic` right now, decoded, via a plain consumer."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset='earliest',
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        ends = await consumer.end_offsets(list(consumer.assignment()) or [])
        records: list[object] = []
        for _ in range(50):
            for batch in (await consumer.getmany(timeout_ms=200)).values():
                records.extend(decode(m.value) for m in batch if m.value is not None)
            positions = {tp: await consumer.position(tp) for tp in consumer.assignment()}
            if consumer.assignment() and all(positions[tp] >= ends.get(tp, 0) for tp in positions):
                break
        return records
    finally:
        await consumer.stop()


def _event(run_id: str, seq: int) -> StepEvent:
    kind = 'run_started' if seq == 0 else 'model_request_started'
    return StepEvent(run_id=run_id, seq=seq, writer_id='w', timestamp=datetime.now(UTC), kind=kind)


@pytest.mark.broker
async def test_queued_records_leave_when_the_linger_ends_or_at_once_when_waited_for(
    settings: Settings,
) -> None:
    """A record nobody waits for leaves the log's queue when its linger ends; a durability point,
    `flush` and `close` send the queue at once, so with a ten-minute linger they still return."""
    async with EventLog(settings, linger_ms=600_000) as patient:
        queued = [await patient.append(_event('patient', seq)) for seq in range(3)]
        assert not any(ack.done() for ack in queued)  # still in the log's queue
        await patient.wait_acked(queued[1:2], timeout=30)  # one wait sends everything queued
        await patient.wait_acked(queued, timeout=30)
        await patient.append(_event('patient', 3))
        position = await patient.flush(timeout=30)
        assert sum(position.values()) == 4
        await patient.append(_event('patient', 4))  # sent by close
    async with EventLog(settings, linger_ms=200) as brief:
        ack = await brief.append(_event('brief', 0))
        await asyncio.wait_for(asyncio.shield(ack), 30)  # nobody calls for it: the linger sends it
    events = [
        r for r in await read_all(settings, settings.topics.step_events_topic) if isinstance(r, StepEvent)
    ]
    assert [(e.run_id, e.seq) for e in events if e.run_id == 'patient'] == [('patient', s) for s in range(5)]
    assert [(e.run_id, e.seq) for e in events if e.run_id == 'brief'] == [('brief', 0)]


_OPS = st.lists(
    st.tuples(
        # Appends the most; a wait is a durability point of one run (some have their caller
        # cancelled at once); a sleep of 0-6 ms lets linger timers fire.
        st.sampled_from(['append'] * 5 + ['wait', 'cancelled wait', 'sleep', 'flush']),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=30,
)


@pytest.mark.broker
@hypothesis_settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(ops=_OPS, linger_ms=st.sampled_from([0, 1, 5]))
def test_any_mix_of_appends_waits_and_lingers_keeps_each_runs_order(
    settings: Settings, ops: list[tuple[str, int]], linger_ms: int
) -> None:
    """Whatever the interleaving of appends, durability points (some cancelled), linger timers and
    flushes, every record is acknowledged once and each run's records are stored in append order."""
    prefix = uuid.uuid4().hex[:8]

    async def scenario() -> None:
        appended: dict[int, list[asyncio.Future[RecordMetadata]]] = {}
        unwaited: dict[int, list[asyncio.Future[RecordMetadata]]] = {}
        async with EventLog(settings, linger_ms=linger_ms) as log:
            for op, arg in ops:
                if op == 'append':
                    acks = appended.setdefault(arg, [])
                    ack = await log.append(_event(f'{prefix}-{arg}', len(acks)))
                    acks.append(ack)
                    unwaited.setdefault(arg, []).append(ack)
                elif op == 'wait':
                    waited = unwaited.pop(arg, [])
                    await log.wait_acked(waited, timeout=30)
                    assert all(a.done() and a.exception() is None for a in waited)
                elif op == 'cancelled wait':
                    task = asyncio.create_task(log.wait_acked(list(unwaited.get(arg, [])), timeout=30))
                    await asyncio.sleep(0)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                elif op == 'sleep':
                    await asyncio.sleep(arg * 2 / 1000)
                else:
                    await log.flush(timeout=30)
            await log.flush(timeout=30)
        for acks in appended.values():
            stored = [ack.result() for ack in acks]
            assert len({m.partition for m in stored}) == 1  # one run, one partition
            offsets = [m.offset for m in stored]
            assert offsets == sorted(set(offsets)), offsets  # stored once each, in append order

    asyncio.run(scenario())


@pytest.mark.broker
@hypothesis_settings(max_examples=10, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    runs=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=6), min_size=2, max_size=16),
    linger_ms=st.sampled_from([0, 5]),
)
def test_concurrent_runs_sharing_partitions_keep_each_runs_order(
    settings: Settings, runs: list[list[int]], linger_ms: int
) -> None:
    """Runs writing at once share partitions, so a hand-over meets partitions with another run's
    send open (their records then go as a batch behind it) and partitions with the run's own:
    whatever the mix, each durability point returns only once its records are acknowledged, and
    every run's records are stored once each, in append order."""
    prefix = uuid.uuid4().hex[:8]

    async def scenario() -> None:
        async with EventLog(settings, linger_ms=linger_ms) as log:

            async def run(number: int, steps: list[int]) -> list[RecordMetadata]:
                acks: list[asyncio.Future[RecordMetadata]] = []
                for records in steps:  # a step: some appends, then its durability point
                    step = [
                        await log.append(_event(f'{prefix}-{number}', len(acks) + i)) for i in range(records)
                    ]
                    acks += step
                    await log.wait_acked(step, timeout=30)
                    assert all(a.done() and a.exception() is None for a in step)
                return [ack.result() for ack in acks]

            stored = await asyncio.gather(*(run(n, steps) for n, steps in enumerate(runs)))
        for metas in stored:
            assert len({m.partition for m in metas}) == 1  # one run, one partition
            offsets = [m.offset for m in metas]
            assert offsets == sorted(set(offsets)), offsets  # stored once each, in append order

    asyncio.run(scenario())


@pytest.mark.broker
async def test_started_is_acknowledged_before_the_tool_body_runs(
    settings: Settings, event_log: EventLog
) -> None:
    seen_in_body: list[object] = []
    agent = Agent(
        calls_then_answers('charge_card'), capabilities=[StepPersistence(log=event_log, agent_name='pay')]
    )

    @agent.tool
    async def charge_card(ctx: RunContext[None]) -> str:
        # Another reader of the log, while the side effect has not happened yet.
        seen_in_body.extend(await read_all(settings, settings.topics.tool_effects_topic))
        return 'charged'

    await agent.run('pay')
    started = [r for r in seen_in_body if isinstance(r, ToolEffectTransition)]
    assert [(r.tool_name, r.status) for r in started] == [('charge_card', 'started')]


@pytest.mark.broker
@pytest.mark.parametrize('bad', ['', 'a/b', '../etc', 'x..y', 'a b', 'é', 'x' * 201])
def test_unsafe_run_ids_are_rejected(event_log: EventLog, bad: str) -> None:
    with pytest.raises(ValueError, match='not allowed'):
        StepPersistence(log=event_log, run_id=bad)


@pytest.mark.broker
async def test_explicit_run_id_is_single_shot(event_log: EventLog, projector: Projector) -> None:
    capability = StepPersistence(log=event_log, run_id='only-once')
    agent = Agent(answers(), capabilities=[capability])
    await agent.run('first')
    with pytest.raises(ValueError, match='already used'):
        await agent.run('second')
    await projector.wait_for(await event_log.flush())
    run = await ProjectionReader.of(projector).get_run('only-once')
    assert run is not None and run.event_count == len(
        await ProjectionReader.of(projector).list_events('only-once')
    )
    assert [e.kind for e in await ProjectionReader.of(projector).list_events('only-once')].count(
        'run_started'
    ) == 1


@pytest.mark.broker
async def test_annotation_survives_the_terminal_transition(event_log: EventLog, projector: Projector) -> None:
    agent = Agent(
        calls_then_answers('open_pr'), capabilities=[StepPersistence(log=event_log, run_id='annotated-1')]
    )

    @agent.tool
    async def open_pr(ctx: RunContext[None]) -> str:
        await annotate_tool_effect(ctx, idempotency_key='pr:42', effect_summary='opens PR 42')
        return 'opened'

    await agent.run('go')
    await projector.wait_for(await event_log.flush())
    effect = await ProjectionReader.of(projector).get_tool_effect('annotated-1', 'call-0')
    assert effect is not None
    assert (effect.status, effect.idempotency_key, effect.effect_summary) == (
        'completed',
        'pr:42',
        'opens PR 42',
    )
    assert effect.ended_at is not None and effect.started_at is not None


@pytest.mark.broker
@pytest.mark.parametrize(
    ('change', 'said'),
    [
        ({'s3_bucket': 'no-such-bucket'}, "bucket 'no-such-bucket' .*the bucket does not exist"),
        ({'s3_secret_access_key': 'not-the-secret'}, 'access was denied'),
    ],
)
async def test_a_wrong_bucket_or_key_fails_at_start_not_at_the_first_large_payload(
    settings: Settings, change: dict[str, str], said: str, tmp_path: Path
) -> None:
    log = EventLog(settings.replace(**change))
    StepPersistence(log=log)  # it uses the settings' bucket: the log checks it as it starts
    with pytest.raises(MediaUnavailable, match=said):
        await log.start()
    await log.close()
    # A log whose capabilities bring their own store never asks the settings' bucket.
    own = EventLog(settings.replace(**change))
    StepPersistence(log=own, media_store=DiskMediaStore(tmp_path))
    await own.start()
    await own.close()


@pytest.mark.broker
async def test_record_above_the_limit_fails_before_sending(settings: Settings) -> None:
    # Every value is under the threshold and no part's value is free-form JSON that could move as
    # one payload: twenty text parts of 900 bytes still make the record too large.
    def huge_call(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        many = [TextPart(f'{i}' + 'x' * 900) for i in range(20)]
        return ModelResponse(parts=[*many, ToolCallPart('store', {}, tool_call_id='c')])

    async with EventLog(settings.replace(media_threshold_bytes=1024), max_record_bytes=4096) as log:
        agent = Agent(FunctionModel(huge_call), capabilities=[StepPersistence(log=log, agent_name='big')])

        @agent.tool_plain
        def store() -> str:
            return 'stored'

        with pytest.raises(RecordTooLarge, match='media store'):
            await agent.run('say a lot')


@pytest.mark.broker
def test_threshold_must_stay_below_the_record_limit(settings: Settings) -> None:
    with pytest.raises(ValueError, match='below the record limit'):
        EventLog(settings.replace(media_threshold_bytes=8192), max_record_bytes=4096)


@pytest.mark.broker
async def test_a_refused_broker_is_named_and_not_blamed_on_the_timeout() -> None:
    settings = Settings(bootstrap_servers='127.0.0.1:9', ack_timeout_s=1)
    with pytest.raises(
        StepStreamUnavailable, match=r'nothing listens on 127\.0\.0\.1:9 \(connection refused\)'
    ) as caught:
        async with EventLog(settings):
            pass
    assert 'within' not in str(caught.value)


@pytest.mark.broker
async def test_broker_down_at_a_durability_point_fails_the_run_before_the_tool(tmp_path: Path) -> None:
    async with EmbeddedStack(tmp_path / 'stack', partitions=1) as stack:
        settings = stack.settings.replace(ack_timeout_s=2)
        body_ran = asyncio.Event()
        async with EventLog(settings) as log:
            agent = Agent(
                calls_then_answers('delete_files'), capabilities=[StepPersistence(log=log, agent_name='x')]
            )

            @agent.tool_plain
            def delete_files() -> str:
                body_ran.set()
                return 'deleted'

            await agent.run('warm up')  # the broker works: metadata is cached, records flow
            body_ran.clear()
            stack.stop_broker()
            with pytest.raises(StepStreamUnavailable, match='did not acknowledge') as failure:
                await agent.run('now the broker is gone')
            assert stack.settings.kafka.bootstrap_servers in str(failure.value)
            assert not body_ran.is_set()


@pytest.mark.broker
async def test_records_carry_the_active_trace(settings: Settings, event_log: EventLog) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    span = SpanContext(trace_id=0xABC, span_id=0x42, is_remote=False, trace_flags=TraceFlags(1))
    agent = Agent(answers(), capabilities=[StepPersistence(log=event_log, run_id='traced')])
    with trace.use_span(NonRecordingSpan(span)):
        await agent.run('hi')
    await event_log.flush()
    consumer = AIOKafkaConsumer(
        settings.topics.step_events_topic,
        bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset='earliest',
    )
    await consumer.start()
    try:
        batches = await consumer.getmany(timeout_ms=3000)
    finally:
        await consumer.stop()
    headers = [dict(m.headers) for batch in batches.values() for m in batch]
    assert headers and all(h['traceparent'] == f'00-{0xABC:032x}-{0x42:016x}-01'.encode() for h in headers)
    assert {h['stepstream-kind'] for h in headers} >= {b'run_started', b'run_completed'}


@pytest.mark.fast
@pytest.mark.parametrize(
    'text', ['tenant/caller-chosen', 'wf-7:1', '', '..', 'a..b', 'é', 'x' * 300, 'tenant_caller-chosen']
)
def test_any_text_maps_to_a_valid_run_id_deterministically(text: str) -> None:
    mapped = to_run_id(text)
    assert check_run_id(mapped) == mapped == to_run_id(text)
    if text and len(text) <= 200 and '..' not in text and text.isascii() and text.replace('_', '').isalnum():
        assert mapped == text


@pytest.mark.fast
def test_texts_that_read_alike_after_mapping_get_different_ids() -> None:
    alike = ['tenant/caller-chosen', 'tenant:caller-chosen', 'tenant_caller-chosen', 'tenant caller-chosen']
    assert len({to_run_id(t) for t in alike}) == len(alike)
    assert to_run_id('tenant/caller-chosen').startswith('tenant_caller-chosen-')
    assert len({to_run_id('x' * 300 + c) for c in 'ab'}) == 2


@pytest.mark.broker
async def test_an_unsafe_context_run_id_is_mapped_not_rejected(
    event_log: EventLog, projector: Projector
) -> None:
    plain = Agent(answers(), capabilities=[StepPersistence(log=event_log)])
    named = Agent(answers(), capabilities=[StepPersistence(log=event_log, agent_name='librarian')])
    await plain.run('hi', run_id='tenant/caller-chosen', conversation_id='conv-unsafe')
    await named.run('hi', run_id='tenant/caller-chosen', conversation_id='conv-unsafe')
    await projector.wait_for(await event_log.flush())
    runs = await ProjectionReader.of(projector).list_runs(conversation_id='conv-unsafe')
    assert [r.run_id for r in runs] == [
        to_run_id('tenant/caller-chosen'),
        to_run_id('librarian-tenant/caller-chosen'),
    ]
    assert all(r.status == 'completed' and r.conflicting_writers == [] for r in runs)


@pytest.mark.broker
async def test_a_re_executed_run_keeps_its_id_and_writer(event_log: EventLog, projector: Projector) -> None:
    # What a durable-execution engine does on recovery: the same run context runs again.
    agent = Agent(
        calls_then_answers('lookup'), capabilities=[StepPersistence(log=event_log, agent_name='re')]
    )

    @agent.tool_plain
    def lookup() -> str:
        return 'found'

    first = await agent.run('go', run_id='ctx-run-1', conversation_id='conv-re')
    again = await agent.run('go', run_id='ctx-run-1', conversation_id='conv-re')
    await projector.wait_for(await event_log.flush())
    [run] = await ProjectionReader.of(projector).list_runs(conversation_id='conv-re')
    assert run.run_id == f're-{first.run_id}' == f're-{again.run_id}'
    assert run.conflicting_writers == [] and run.gaps == [] and run.status == 'completed'
    # Without an engine the second execution writes each seq again with new timestamps: the first
    # records stand and the repeats go to the DLQ as duplicate_seq (decision 0010), counted on the run.
    assert run.rejected == {'duplicate_seq': run.event_count}


@pytest.mark.broker
async def test_two_runs_reusing_one_explicit_run_id_are_two_writers(
    event_log: EventLog, projector: Projector
) -> None:
    for _ in range(2):  # e.g. two processes configured with the same run_id
        await Agent(answers(), capabilities=[StepPersistence(log=event_log, run_id='reused')]).run('hi')
    await projector.wait_for(await event_log.flush())
    run = await ProjectionReader.of(projector).get_run('reused')
    assert run is not None and len(run.conflicting_writers) == 1
