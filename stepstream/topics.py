"""Topic layout and idempotent topic creation, shared by producer, projector and CLI."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, for_code
from aiokafka.partitioner import murmur2
from aiokafka.structs import TopicPartition

from stepstream.errors import StepStreamError
from stepstream.kafka_client import (
    AUTHORIZATION_ERRORS,
    access_denied,
    client_options,
    connection_error,
    unavailable,
)
from stepstream.settings import KafkaSettings, Settings, TopicSettings

__all__ = [
    'LOG_TOPIC_CONFIGS',
    'Position',
    'TopicLayout',
    'ensure_topics',
    'log_end_offsets',
    'murmur2_partition',
    'started_consumer',
    'supports_idempotence',
    'unavailable',
]

# The log is the system of record: nothing is ever deleted by retention.
LOG_TOPIC_CONFIGS = {'retention.ms': '-1', 'retention.bytes': '-1', 'cleanup.policy': 'delete'}

Position = dict[TopicPartition, int]
"""For each partition, the offset just past the last record written (or applied)."""


@dataclass(frozen=True, slots=True)
class TopicLayout:
    """How many partitions the two co-partitioned log topics have, on which cluster."""

    partitions: int
    cluster: str = ''
    """The cluster id the broker reports, or `servers:<bootstrap servers>` when it reports none.

    Tansu reports the same id (`tansu_cluster`) for every broker, so for Tansu this tells Tansu
    from Apache Kafka but not one Tansu from another.
    """


async def ensure_topics(settings: Settings, *, create: bool = True, dlq: bool = True) -> TopicLayout:
    """Create the log topics (and the DLQ with `dlq`) if they are missing, then check they are co-partitioned.

    Idempotent: existing topics are left as they are. Both log topics must have the same
    partition count, because a run's records live in the same partition number of each. The
    producer passes `dlq=False`: it never writes the DLQ, and a least-privilege producer
    principal may not even see it.
    """
    failing = 'could not connect to create or check topics' if create else 'could not connect to check topics'
    admin = await _admin(settings.kafka, failing)
    try:
        log_topics = [settings.topics.step_events_topic, settings.topics.tool_effects_topic]
        existing = set(await admin.list_topics())
        if create:
            wanted = [*log_topics, settings.topics.dlq_topic] if dlq else log_topics
            missing = [t for t in wanted if t not in existing]
            if missing:
                await _create(admin, settings.kafka, settings.topics, missing)
        counts = await _partition_counts(admin, log_topics)
        # Apache Kafka creates topics asynchronously: a topic just created can be missing from the
        # next metadata answer for a moment, so look again until it shows (or the timeout).
        deadline = asyncio.get_running_loop().time() + settings.kafka.ack_timeout_s
        while create and not all(counts.get(t) for t in log_topics):
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.1)
            counts = await _partition_counts(admin, log_topics)
        described = await admin.describe_cluster()
    finally:
        await admin.close()
    missing_topics = [t for t in log_topics if not counts.get(t)]
    if missing_topics:
        raise StepStreamError(
            f'topics {missing_topics} do not exist on {settings.kafka.bootstrap_servers}, or this principal '
            'may not describe them; create them with `stepstream topics ensure` (an admin principal) '
            'or allow creation'
        )
    if len(set(counts.values())) != 1:
        raise StepStreamError(
            f'log topics are not co-partitioned: {counts}. Both must have the same partition count, '
            'because a run lives in the same partition number of each'
        )
    cluster_id = described.get('cluster_id')
    cluster = (
        cluster_id
        if isinstance(cluster_id, str) and cluster_id
        else f'servers:{settings.kafka.bootstrap_servers}'
    )
    return TopicLayout(partitions=counts[settings.topics.step_events_topic], cluster=cluster)


async def _admin(kafka: KafkaSettings, failing: str) -> AIOKafkaAdminClient:
    """A started admin client (close it), or the connection error that says `failing` and why."""
    admin = AIOKafkaAdminClient(
        **client_options(kafka),
        request_timeout_ms=int(kafka.ack_timeout_s * 1000),
    )
    try:
        await asyncio.wait_for(admin.start(), kafka.ack_timeout_s)
    except (KafkaError, OSError, TimeoutError) as exc:
        await admin.close()
        raise await connection_error(kafka, failing, exc) from exc
    return admin


async def _create(
    admin: AIOKafkaAdminClient, kafka: KafkaSettings, layout: TopicSettings, topics: list[str]
) -> None:
    new = [
        NewTopic(
            name=topic,
            num_partitions=layout.partitions,
            replication_factor=layout.replication_factor,
            topic_configs=dict(LOG_TOPIC_CONFIGS),
        )
        for topic in topics
    ]
    try:
        response = await admin.create_topics(new)
    except TopicAlreadyExistsError:
        return
    except AUTHORIZATION_ERRORS as exc:
        raise _may_not_create(kafka, topics, exc) from exc
    for topic, code, message in topic_errors(response):
        # 36 = TOPIC_ALREADY_EXISTS: another process created it first, which is fine.
        if code in (29, 31):  # TOPIC_/CLUSTER_AUTHORIZATION_FAILED: no CREATE for this principal
            raise _may_not_create(kafka, topics, for_code(code)())
        if code not in (0, 36):
            raise StepStreamError(f'could not create topic {topic!r}: error {code} {message or ""}'.strip())


def _may_not_create(kafka: KafkaSettings, topics: list[str], exc: BaseException) -> StepStreamError:
    return access_denied(
        kafka,
        f'create the missing topics {topics}',
        exc,
        fix='run `stepstream topics ensure` once with an admin principal (one allowed to create '
        'topics), then start this role again; or grant this principal CREATE',
    )


def topic_errors(response: object) -> list[tuple[str, int, str | None]]:
    """`(topic, error code, message)` of each topic in a CreateTopics response (the admin client's)."""
    rows = getattr(response, 'topic_errors', [])
    return [(row[0], row[1], row[2] if len(row) > 2 else None) for row in rows]


async def partition_counts(kafka: KafkaSettings, topics: list[str]) -> dict[str, int]:
    """Each topic's partition count, asked of the cluster now; a missing topic is left out."""
    admin = await _admin(kafka, 'could not connect to describe topics')
    try:
        return await _partition_counts(admin, topics)
    finally:
        await admin.close()


async def _partition_counts(admin: AIOKafkaAdminClient, topics: list[str]) -> dict[str, int]:
    described = await admin.describe_topics(topics)
    counts: dict[str, int] = {}
    for entry in described:
        if entry.get('error_code', 0) == 0:
            counts[entry['topic']] = len(entry.get('partitions', []))
    return counts


@functools.lru_cache(maxsize=1 << 16)
def murmur2_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner picks for `key` (murmur2, positive, modulo).

    Cached: aiokafka's murmur2 is pure Python, and both the producer and the projector ask for
    the same run's partition on every record of the run.
    """
    return (murmur2(key) & 0x7FFFFFFF) % partitions


async def started_consumer(kafka: KafkaSettings, **options: Any) -> AIOKafkaConsumer:
    """A started consumer without a group (stop it), or the connection error that says why not.

    `options` are aiokafka's, over `client_options(kafka)`, no auto-commit and a request
    timeout of `ack_timeout_s`.
    """
    consumer = AIOKafkaConsumer(
        **client_options(kafka),
        enable_auto_commit=False,
        request_timeout_ms=max(1000, int(kafka.ack_timeout_s * 1000)),
        **options,
    )
    try:
        await asyncio.wait_for(consumer.start(), kafka.ack_timeout_s)
    except (KafkaError, OSError, TimeoutError) as exc:
        await consumer.stop()
        raise await connection_error(kafka, 'did not accept a consumer connection', exc) from exc
    return consumer


async def log_end_offsets(
    kafka: KafkaSettings, applied: Mapping[tuple[str, int], int]
) -> dict[tuple[str, int], int]:
    """The end of each partition in `applied`: the largest of what ListOffsets and a fetch report.

    Some brokers (Tansu) answer ListOffsets with a stale or short end, while a fetch carries the
    true high watermark; the applied offset is a floor too (the projector read that far).
    """
    consumer = await started_consumer(
        kafka, auto_offset_reset='latest', fetch_max_wait_ms=50, max_partition_fetch_bytes=64 * 1024
    )
    try:
        partitions = {TopicPartition(topic, p): offset for (topic, p), offset in applied.items()}
        listed = await consumer.end_offsets(list(partitions))
        consumer.assign(list(partitions))
        for tp, offset in partitions.items():
            consumer.seek(tp, min(offset, listed[tp]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(kafka.ack_timeout_s, 3.0)
        while loop.time() < deadline and any(consumer.highwater(tp) is None for tp in partitions):
            await consumer.getmany(timeout_ms=100)
        return {
            (tp.topic, tp.partition): max(listed[tp], consumer.highwater(tp) or 0, offset)
            for tp, offset in partitions.items()
        }
    finally:
        await consumer.stop()


async def supports_idempotence(kafka: KafkaSettings) -> bool:
    """Whether the cluster grants producer ids (InitProducerId), so idempotent producing works.

    Asked with the standard request rather than inferred from the broker's name or version:
    Apache Kafka grants one; Tansu answers with an error (it has no idempotent producer).
    """
    from aiokafka.client import AIOKafkaClient
    from aiokafka.protocol.transaction import InitProducerIdRequest

    client = AIOKafkaClient(
        **client_options(kafka),
        request_timeout_ms=int(kafka.ack_timeout_s * 1000),
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + kafka.ack_timeout_s
    try:
        await asyncio.wait_for(client.bootstrap(), kafka.ack_timeout_s)
        node = next(iter(client.cluster.brokers())).nodeId
        while True:
            response = await asyncio.wait_for(
                client.send(node, InitProducerIdRequest(None, 60_000)),
                kafka.ack_timeout_s,
            )
            if response.error_code == 0:
                return True
            # A broker that has just started answers "not yet" (a retriable error) for a moment.
            if not for_code(response.error_code).retriable or loop.time() > deadline:
                return False
            await asyncio.sleep(0.2)
    except (KafkaError, OSError, TimeoutError, StopIteration):
        return False
    finally:
        await client.close()
