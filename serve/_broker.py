"""What only the broker knows: the log's end offsets (a status's lag) and the DLQ's records.

`Source.status` and `Source.dead_letters` read through these, each with a short-lived client of
the settings' cluster and a deadline, so a broker that does not answer makes a page say so
instead of hanging it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from stepstream.errors import StepStreamError
from stepstream.kafka_client import client_options
from stepstream.projector import DeadLetterHeaders
from stepstream.readmodel import ProjectionReader
from stepstream.serve._models import DeadLetter, DeadLetters, PartitionLag, Status
from stepstream.settings import KafkaSettings, Settings
from stepstream.topics import log_end_offsets, partition_counts


async def status_with_lag(settings: Settings, reader: ProjectionReader) -> Status:
    """The projection's status with each partition's lag (end offsets from the broker)."""
    status = await reader.status()
    applied = status.offsets
    ends: dict[TopicPartition, int] = {}
    error = None
    try:
        ends = await asyncio.wait_for(_log_ends(settings, applied), settings.kafka.ack_timeout_s * 2)
    except (KafkaError, OSError, TimeoutError, StepStreamError) as exc:
        error = f'the broker at {settings.kafka.bootstrap_servers} did not give end offsets: {exc!r}'
    keys = sorted({*applied, *((tp.topic, tp.partition) for tp in ends)})
    partitions = []
    for topic, partition in keys:
        done, end = applied.get((topic, partition), 0), ends.get(TopicPartition(topic, partition))
        partitions.append(
            PartitionLag(
                topic=topic,
                partition=partition,
                applied=done,
                end=end,
                lag=None if end is None else max(end - done, 0),
                projector_pid=status.writers.get(partition),
                last_batch_at=status.last_batch_at.get(partition),
            )
        )
    return Status.of(status, partitions, error)


async def dead_letters(settings: Settings, limit: int = 50) -> DeadLetters:
    """The newest `limit` records of the DLQ topic, newest first, read by a short-lived consumer."""
    try:
        return await asyncio.wait_for(_read_dlq(settings, limit), settings.kafka.ack_timeout_s * 2)
    except (KafkaError, OSError, TimeoutError) as exc:
        return DeadLetters(
            entries=[], total=0, error=f'{settings.topics.dlq_topic} could not be read: {exc!r}'
        )


def _consumer(kafka: KafkaSettings) -> AIOKafkaConsumer:
    timeout_ms = int(kafka.ack_timeout_s * 1000)
    return AIOKafkaConsumer(
        **client_options(kafka),
        enable_auto_commit=False,
        request_timeout_ms=max(timeout_ms, 5000),
        client_id='stepstream-serve',
    )


async def _partitions(kafka: KafkaSettings, *topics: str) -> list[TopicPartition]:
    """The topics' partitions (none for a topic that does not exist), from the cluster now."""
    counts = await partition_counts(kafka, list(topics))
    return [TopicPartition(topic, p) for topic in topics for p in range(counts.get(topic, 0))]


async def _log_ends(settings: Settings, applied: Mapping[tuple[str, int], int]) -> dict[TopicPartition, int]:
    """The end offset of every partition of both log topics (as `stepstream status` takes it)."""
    tps = await _partitions(
        settings.kafka, settings.topics.step_events_topic, settings.topics.tool_effects_topic
    )
    ends = await log_end_offsets(
        settings.kafka, {(tp.topic, tp.partition): applied.get((tp.topic, tp.partition), 0) for tp in tps}
    )
    return {TopicPartition(topic, partition): end for (topic, partition), end in ends.items()}


async def _read_dlq(settings: Settings, limit: int) -> DeadLetters:
    consumer = _consumer(settings.kafka)
    try:  # stopped even when it cannot start (a broker that refuses): no unclosed consumer
        await consumer.start()
        tps = await _partitions(settings.kafka, settings.topics.dlq_topic)
        if not tps:
            return DeadLetters(entries=[], total=0, error=None)
        starts = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        consumer.assign(tps)
        wanted = {}
        for tp in tps:
            first = max(starts[tp], ends[tp] - limit)
            if first < ends[tp]:
                consumer.seek(tp, first)
                wanted[tp] = ends[tp]
        entries: list[DeadLetter] = []
        while wanted:
            batches = await consumer.getmany(*wanted, timeout_ms=1000)
            for tp, records in batches.items():
                entries.extend(_dead_letter(r) for r in records if r.offset < wanted.get(tp, 0))
            for tp in list(wanted):
                if await consumer.position(tp) >= wanted[tp]:
                    del wanted[tp]
                    consumer.pause(tp)
        entries.sort(key=lambda e: (e.timestamp or datetime.min.replace(tzinfo=UTC), e.offset), reverse=True)
        return DeadLetters(
            entries=entries[:limit], total=sum(ends[tp] - starts[tp] for tp in tps), error=None
        )
    finally:
        await consumer.stop()


def _dead_letter(record: Any) -> DeadLetter:
    why = DeadLetterHeaders.decode(record.headers)
    try:
        key = record.key.decode() if record.key is not None else None
    except UnicodeDecodeError:
        key = None
    return DeadLetter(
        partition=record.partition,
        offset=record.offset,
        timestamp=datetime.fromtimestamp(record.timestamp / 1000, UTC) if record.timestamp >= 0 else None,
        reason=why.reason,
        detail=why.detail,
        source_topic=why.source_topic,
        source_partition=why.source_partition,
        source_offset=why.source_offset,
        key=key,
        value_bytes=len(record.value or b''),
        envelope=why.envelope,
    )
