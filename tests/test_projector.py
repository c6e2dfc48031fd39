"""Projector delivery rules on the real broker: poison records, duplicates, order, topics."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from stepstream import Settings, StepStreamError
from stepstream.producer import EventLog
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import StepEvent, ToolEffectTransition, encode
from stepstream.topics import ensure_topics, murmur2_partition

pytestmark = pytest.mark.broker

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def event(run_id: str, seq: int, kind: str = 'model_request_started', writer: str = 'w') -> StepEvent:
    return StepEvent(run_id=run_id, seq=seq, writer_id=writer, timestamp=NOW, kind=kind)  # type: ignore[arg-type]


def effect(run_id: str, seq: int, status: str, writer: str = 'w') -> ToolEffectTransition:
    return ToolEffectTransition(
        run_id=run_id,
        seq=seq,
        writer_id=writer,
        timestamp=NOW,
        tool_call_id='c1',
        tool_name='t',
        status=status,  # type: ignore[arg-type]
    )


async def produce_raw(
    settings: Settings, topic: str, values: list[tuple[bytes | None, bytes]], partition: int
) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await producer.start()
    try:
        for k, v in values:
            await producer.send_and_wait(topic, v, key=k, partition=partition)
    finally:
        await producer.stop()


async def test_poison_records_go_to_the_dlq_and_the_partition_moves_on(
    settings: Settings, projector: Projector
) -> None:
    good_before, good_after = encode(event('r1', 0, 'run_started')), encode(event('r1', 1))
    wrong_key = encode(event('r2', 0, 'run_started'))
    await ensure_topics(settings)
    home = murmur2_partition(b'r1', settings.topics.partitions)
    await produce_raw(
        settings,
        settings.topics.step_events_topic,
        [(b'r1', good_before), (b'r1', b'not avro at all'), (b'r1', wrong_key), (b'r1', good_after)],
        home,
    )
    await projector.wait_for({TopicPartition(settings.topics.step_events_topic, home): 4}, timeout=15)
    run = await ProjectionReader.of(projector).get_run('r1')
    assert run is not None and run.event_count == 2 and run.gaps == []
    assert await ProjectionReader.of(projector).get_run('r2') is None
    assert projector.dead_lettered == 2

    consumer = AIOKafkaConsumer(
        settings.topics.dlq_topic,
        bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset='earliest',
    )
    await consumer.start()
    try:
        dead = []
        while len(dead) < 2:
            for batch in (await consumer.getmany(timeout_ms=2000)).values():
                dead.extend(batch)
    finally:
        await consumer.stop()
    headers = [dict(m.headers) for m in dead]
    assert [h['stepstream-source-offset'] for h in headers] == [b'1', b'2']
    assert all(h['stepstream-source-topic'] == settings.topics.step_events_topic.encode() for h in headers)
    assert [h['stepstream-dlq-reason'] for h in headers] == [b'not_a_record', b'wrong_key']
    assert b'single-object' in headers[0]['stepstream-dlq-detail']
    assert b'is not its run_id' in headers[1]['stepstream-dlq-detail']
    status = await ProjectionReader.of(projector).status()
    assert status.dead_lettered_by_reason == {'not_a_record': 1, 'wrong_key': 1}
    assert dead[0].value == b'not avro at all'


async def test_duplicates_and_cross_topic_order(settings: Settings, projector: Projector) -> None:
    async with EventLog(settings) as log:
        # seq 2 (tool effect) is written before seq 1 exists anywhere; seq 3 twice.
        for record in [event('r', 0, 'run_started'), effect('r', 2, 'started'), event('r', 3), event('r', 3)]:
            await log.append(record)
        await projector.wait_for(await log.flush())
        run = await ProjectionReader.of(projector).get_run('r')
        assert run is not None and run.gaps == [(1, 1)] and run.event_count == 3
        assert projector.duplicates_ignored == 1
        unresolved = await ProjectionReader.of(projector).list_unresolved_tool_effects('r')
        assert [(e.tool_call_id, e.status) for e in unresolved] == [('c1', 'started')]

        for record in [
            effect('r', 1, 'annotated'),
            effect('r', 4, 'completed'),
            event('r', 5, 'run_completed'),
        ]:
            await log.append(record)
        await projector.wait_for(await log.flush())
    run = await ProjectionReader.of(projector).get_run('r')
    assert run is not None and run.gaps == [] and run.status == 'completed' and run.event_count == 6
    assert await ProjectionReader.of(projector).list_unresolved_tool_effects() == []


async def test_topics_are_idempotent_and_must_be_co_partitioned(settings: Settings) -> None:
    first = await ensure_topics(settings)
    again = await ensure_topics(settings)
    assert first == again and first.partitions == settings.topics.partitions

    skewed = settings.replace(topic_prefix=settings.topics.topic_prefix + '-skewed')
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(skewed.topics.tool_effects_topic, 1, 1)])
    finally:
        await admin.close()
    with pytest.raises(StepStreamError, match='co-partitioned'):
        await ensure_topics(skewed)


async def test_two_writers_claiming_one_run_id_are_kept_apart(
    settings: Settings, projector: Projector
) -> None:
    async with EventLog(settings) as log:
        # The owner's tool effect reaches the other topic before its registration is applied.
        await log.append(effect('shared', 1, 'started', writer='first'))
        await log.flush()
        await projector.wait_for(await log.flush())
        assert await ProjectionReader.of(projector).get_run('shared') is None  # parked, not lost
        for record in [
            event('shared', 0, 'run_started', writer='first'),
            event('shared', 0, 'run_started', writer='second'),
            effect('shared', 1, 'completed', writer='second'),
            event('shared', 2, 'run_completed', writer='first'),
        ]:
            await log.append(record)
        await projector.wait_for(await log.flush())
    reader = ProjectionReader.of(projector)
    run = await reader.get_run('shared')
    assert run is not None
    assert run.registration_id == 'first' and run.conflicting_writers == ['second']
    assert (run.event_count, run.gaps, run.status) == (3, [], 'completed')
    effect_record = await reader.get_tool_effect('shared', 'c1')
    assert (
        effect_record is not None and effect_record.status == 'started'
    )  # the intruder's 'completed' is apart
    assert [r.run_id for r in await reader.list_conflicts()] == ['shared']


async def test_wait_for_times_out_naming_the_partitions_behind(
    settings: Settings, projector: Projector
) -> None:
    behind = {TopicPartition(settings.topics.step_events_topic, 1): 10**9}
    with pytest.raises(TimeoutError, match=rf'{settings.topics.step_events_topic}\[1\]'):
        await projector.wait_for(behind, timeout=0.3)


async def test_group_offsets_are_committed_beside_the_apply_loop_and_on_stop(
    settings: Settings, projector: Projector
) -> None:
    """Lag tooling's offsets: the first batch's commit runs as a task of its own, the last on stop."""
    async with EventLog(settings) as log:
        await log.append(event('lagged', 0, 'run_started'))
        first = await log.flush()
        await projector.wait_for(first)
        sending = projector.group_offsets._sending
        assert sending is not None, 'the first batch started a commit beside the loop'
        await sending
        await log.append(event('lagged', 1))
        second = await log.flush()
        await projector.wait_for(second)  # within the second since the first commit: not committed yet
    ((tp, offset),) = second.items()
    await projector.stop()
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap_servers, group_id=projector.group_id
    )
    await consumer.start()
    try:
        assert await consumer.committed(tp) == offset == first[tp] + 1
    finally:
        await consumer.stop()
