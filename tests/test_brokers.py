"""What differs between the embedded brokers, and the embedded Apache Kafka's own failure paths."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import for_code
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.protocol.transaction import InitProducerIdRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import TopicPartition

from stepstream import Settings
from stepstream.embedded import EmbeddedStack, EmbeddedStackError
from stepstream.producer import EventLog
from stepstream.schemas import StepEvent, decode
from stepstream.topics import ensure_topics, supports_idempotence

from brokers import BROKER, kafka_only

pytestmark = pytest.mark.broker

NOW = datetime(2026, 11, 30, tzinfo=UTC)


async def test_the_event_log_is_idempotent_where_the_broker_allows_it(settings: Settings) -> None:
    async with EventLog(settings) as log:
        # Apache Kafka grants producer ids; Tansu refuses InitProducerId, so the log goes without.
        assert log.enable_idempotence is (BROKER == 'kafka')
    assert await supports_idempotence(settings.kafka) is (BROKER == 'kafka')


def batch(value: bytes, producer_id: int = -1, epoch: int = -1, sequence: int = -1) -> bytes:
    builder = DefaultRecordBatchBuilder(2, 0, 0, producer_id, epoch, sequence, 1024 * 1024)
    builder.append(0, None, b'k', value, [])
    return bytes(builder.build())


@kafka_only('has no idempotent producer (InitProducerId is refused), so it cannot drop a resent batch')
async def test_a_resent_batch_is_written_once_only_by_an_idempotent_producer(settings: Settings) -> None:
    """A retry resends the very same batch: the broker drops it only when it carries a producer id."""
    await ensure_topics(settings)
    topic = settings.topics.step_events_topic
    client = AIOKafkaClient(bootstrap_servers=settings.kafka.bootstrap_servers)
    await client.bootstrap()
    try:
        await client._metadata_update(client.cluster, [topic])
        leader = client.cluster.leader_for_partition(TopicPartition(topic, 0))
        assert leader is not None
        for _ in range(100):  # a broker that has just started answers "not yet" for a moment
            granted = await client.send(leader, InitProducerIdRequest(None, 60_000))  # type: ignore[arg-type]
            if not for_code(granted.error_code).retriable:
                break
            await asyncio.sleep(0.1)
        assert granted.error_code == 0
        idempotent = batch(b'idempotent', granted.producer_id, granted.producer_epoch, 0)
        plain = batch(b'plain')
        for payload in (idempotent, idempotent, plain, plain):  # each sent, then "retried"
            for _ in range(100):
                response = await client.send(
                    leader, ProduceRequest(None, -1, 10_000, [(topic, [(0, payload)])])
                )
                [(_, [partition_response])] = response.topics
                if not for_code(partition_response[1]).retriable:
                    break
                # The partition of a topic just created may not have its leader yet (nothing was
                # appended): ask again, as a producer does.
                await asyncio.sleep(0.1)
                await client._metadata_update(client.cluster, [topic])
                leader = client.cluster.leader_for_partition(TopicPartition(topic, 0)) or leader
            assert partition_response[1] == 0, partition_response  # no error: the resend is acknowledged
    finally:
        await client.close()

    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap_servers, auto_offset_reset='earliest'
    )
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        values: list[bytes] = []
        while len(values) < 3:
            for messages in (await consumer.getmany(timeout_ms=2000)).values():
                values += [m.value for m in messages if m.value is not None]
        assert sorted(values) == [b'idempotent', b'plain', b'plain']
    finally:
        await consumer.stop()


def test_kafka_without_a_jvm_or_maven_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv('PATH', str(tmp_path))
    with pytest.raises(EmbeddedStackError, match=r'`java` is not on PATH.*JDK 17\+ and Maven') as err:
        EmbeddedStack(broker='kafka').start()
    assert err.value.service == 'broker' and 'STEPSTREAM_EMBEDDED_BROKER=tansu' in str(err.value)

    java = tmp_path / 'java'
    java.write_text('#!/bin/sh\nexit 0\n')
    java.chmod(0o755)
    monkeypatch.setenv('STEPSTREAM_KAFKA_CACHE', str(tmp_path / 'empty-cache'))
    with pytest.raises(EmbeddedStackError, match=r'`mvn` is not on PATH, and the Kafka jars are not in'):
        EmbeddedStack(broker='kafka').start()


def test_an_unknown_broker_is_refused_before_starting() -> None:
    with pytest.raises(ValueError, match=r"broker must be one of \('tansu', 'kafka'\)"):
        EmbeddedStack(broker='redpanda')


@kafka_only('reports the same cluster id (tansu_cluster) for every broker')
async def test_each_kafka_cluster_has_its_own_id(stack: EmbeddedStack) -> None:
    async with EmbeddedStack(broker='kafka') as other:
        ours, theirs = await asyncio.gather(ensure_topics(stack.settings), ensure_topics(other.settings))
    assert ours.cluster != theirs.cluster and not ours.cluster.startswith('servers:')


@kafka_only(
    "serves librdkafka's group consumer, but a group join takes about 25 s there; outside tools "
    'are checked on Apache Kafka, where they matter'
)
async def test_a_confluent_kafka_consumer_group_reads_the_topics(settings: Settings) -> None:
    """Outside tools: librdkafka's group consumer (what kcat and confluent-kafka use) reads the log."""
    from confluent_kafka import Consumer
    from confluent_kafka import TopicPartition as ConfluentPartition

    written = []
    async with EventLog(settings) as log:
        for seq, kind in enumerate(['run_started', 'model_request_started', 'run_completed']):
            record = StepEvent(run_id='outside', seq=seq, writer_id='w', timestamp=NOW, kind=kind)  # type: ignore[arg-type]
            await log.append(record)
            written.append(record)
        position = await log.flush()

    def consume() -> tuple[list[StepEvent], list[int]]:
        consumer = Consumer(
            {
                'bootstrap.servers': settings.kafka.bootstrap_servers,
                'group.id': f'{settings.topics.topic_prefix}.analytics',
                'auto.offset.reset': 'earliest',
                'enable.auto.commit': False,
            }
        )
        try:
            consumer.subscribe([settings.topics.step_events_topic])
            seen: list[StepEvent] = []
            for _ in range(120):
                message = consumer.poll(1.0)
                if message is None or message.error():
                    continue
                record = decode(message.value())
                assert isinstance(record, StepEvent) and message.key() == b'outside'
                seen.append(record)
                if len(seen) == len(written):
                    break
            consumer.commit(asynchronous=False)
            partitions = [ConfluentPartition(tp.topic, tp.partition) for tp in position]
            committed = [p.offset for p in consumer.committed(partitions, timeout=10)]
            return seen, committed
        finally:
            consumer.close()

    seen, committed = await asyncio.to_thread(consume)
    assert seen == written
    assert committed == list(position.values())
