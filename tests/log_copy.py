"""A log copied record by record into another topic prefix, each record in its partition and order."""

from __future__ import annotations

from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.structs import TopicPartition

from stepstream import Settings
from stepstream.topics import Position, ensure_topics

Keep = Callable[[TopicPartition, ConsumerRecord[bytes, bytes]], bool]
Stamp = Callable[[TopicPartition, ConsumerRecord[bytes, bytes]], int]


async def copy_log(
    settings: Settings, copy: Settings, end: Position, *, keep: Keep | None = None, stamp: Stamp | None = None
) -> Position:
    """The log of `settings` up to `end` again in `copy`'s topics; the position written.

    `keep` leaves a record out when it says False; `stamp` gives a record's new timestamp (ms).
    """
    await ensure_topics(copy)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap_servers, auto_offset_reset='earliest'
    )
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await consumer.start()
    await producer.start()
    written: Position = {}
    try:
        consumer.assign(list(end))
        for tp in end:
            await consumer.seek_to_beginning(tp)
        remaining = set(end)
        while remaining:
            for tp, batch in (await consumer.getmany(timeout_ms=1000)).items():
                effects = tp.topic == settings.topics.tool_effects_topic
                topic = copy.topics.tool_effects_topic if effects else copy.topics.step_events_topic
                for m in batch:
                    if m.offset >= end[tp] or (keep is not None and not keep(tp, m)):
                        continue
                    meta = await producer.send_and_wait(
                        topic,
                        m.value,
                        key=m.key,
                        partition=tp.partition,
                        headers=list(m.headers),
                        timestamp_ms=m.timestamp if stamp is None else stamp(tp, m),
                    )
                    written[TopicPartition(topic, meta.partition)] = meta.offset + 1
            remaining = {tp for tp in remaining if await consumer.position(tp) < end[tp]}
    finally:
        await consumer.stop()
        await producer.stop()
    return written
