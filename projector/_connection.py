"""The projector's consumer: how it is made, connected, pointed at its partitions and stopped.

The `Projector` holds the consumer and decides when each of these happens; this module knows how
the consumer must be configured for a projection (manual commits, range assignment that keeps a
shard's partitions together), which errors a broker's refusal becomes, and how to disconnect
while the broker is away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import GroupAuthorizationFailedError, KafkaError
from aiokafka.structs import TopicPartition

from stepstream.errors import StepStreamError
from stepstream.kafka_client import access_denied, client_options, connection_error
from stepstream.projector._assignment import Assignment
from stepstream.projector._dead_letters import DeadLetterSender
from stepstream.projector._membership import Membership, membership_assignor
from stepstream.settings import KafkaSettings
from stepstream.topics import Position

log = logging.getLogger('stepstream.projector')


def make_consumer(
    kafka: KafkaSettings, *, group_id: str, membership: Membership, session_timeout_ms: int
) -> AIOKafkaConsumer:
    """The projector's consumer of both log topics, not yet started.

    It commits nothing by itself (the shards hold the offsets) and starts a partition without
    stored offsets at its beginning.
    """
    return AIOKafkaConsumer(
        **client_options(kafka),
        group_id=group_id,
        client_id='stepstream-projector',
        enable_auto_commit=False,
        auto_offset_reset='earliest',
        fetch_max_wait_ms=50,
        request_timeout_ms=max(5000, int(kafka.ack_timeout_s * 1000)),
        # Range assignment gives a member the same partition numbers of both topics, which
        # are co-partitioned by run_id: one member owns every record of a shard. Ours also
        # shares the members' endpoints. One assignor only: aiokafka (through 0.14) sends a
        # JoinGroup per configured assignor, and the second one starts another rebalance,
        # so members joining together can rebalance for minutes (decision 0016).
        partition_assignment_strategy=(membership_assignor(membership),),
        session_timeout_ms=session_timeout_ms,
        heartbeat_interval_ms=max(100, session_timeout_ms // 3),
    )


async def connect(
    kafka: KafkaSettings,
    consumer: AIOKafkaConsumer,
    dead_letters: DeadLetterSender,
    *,
    send_dead_letters: bool,
) -> None:
    """Start `consumer`, and the DLQ's producer when it sends dead letters.

    A broker that does not answer within the ack timeout, or refuses, stops both again and is
    raised as the error that says how to reach it.
    """
    try:
        await asyncio.wait_for(consumer.start(), kafka.ack_timeout_s)
        if send_dead_letters:
            await dead_letters.start()
    except (KafkaError, OSError, TimeoutError) as exc:
        await consumer.stop()
        await dead_letters.stop()
        raise await connection_error(kafka, 'did not accept the projector', exc) from exc


async def take_partitions(
    consumer: AIOKafkaConsumer, assignment: Assignment, topics: tuple[str, str], partitions: Collection[int]
) -> None:
    """Without a group: read `partitions` of both topics from the offsets their shards hold.

    The shards must be open already. A principal that may not use the consumer group or read
    the topics gets the broker's authorization error here, at once.
    """
    assigned = {TopicPartition(t, p) for t in topics for p in partitions}
    consumer.assign(sorted(assigned))
    # Asks the group coordinator once, so a missing group ACL fails here at once (a seek would
    # wait out the request timeout first).
    if assigned:
        await consumer.committed(min(assigned))
    await assignment.seek(assigned)


def may_not_read(
    kafka: KafkaSettings, group_id: str, topics: tuple[str, str], exc: BaseException
) -> StepStreamError:
    """The error for a principal without the projector's READ rights (on its group or topics)."""
    if isinstance(exc, GroupAuthorizationFailedError):
        what, grant = f'use the consumer group {group_id}', f'READ on group {group_id}'
    else:
        joined = ' and '.join(topics)
        what, grant = f'read {joined}', f'READ on {joined}'
    fix = f'grant it {grant} (the projector ACL), or use the projector principal'
    return access_denied(kafka, what, exc, fix=fix)


async def end_position(consumer: AIOKafkaConsumer) -> Position:
    """The end of every partition `consumer` is assigned now (the empty ones left out)."""
    ends = await consumer.end_offsets(list(consumer.assignment()))
    # Some brokers (Tansu) can report an end short of the last batch's records; the high
    # watermark seen on fetches is the larger, and right, figure then.
    position = {tp: max(offset, consumer.highwater(tp) or 0) for tp, offset in ends.items()}
    return {tp: offset for tp, offset in position.items() if offset > 0}


async def disconnect(
    kafka: KafkaSettings, consumer: AIOKafkaConsumer | None, dead_letters: DeadLetterSender
) -> None:
    """Stop the consumer (a member leaves its group) and the DLQ's producer.

    With the broker gone, leaving cannot finish: each gives up after the ack timeout, since the
    shards' offsets are stored with their state and closing them needs no broker.
    """
    stopping = [dead_letters.stop()]
    if consumer is not None:
        stopping.insert(0, stop_consumer(consumer))
    for client in stopping:
        try:
            await asyncio.wait_for(client, kafka.ack_timeout_s)
        except TimeoutError:
            log.warning('the broker did not answer while the projector disconnected; stopping anyway')


async def stop_consumer(consumer: AIOKafkaConsumer) -> None:
    """Stop `consumer`, also while its broker is away.

    aiokafka's fetcher cancels a fetch that waits out a retry backoff and then awaits it, so
    `stop()` raises that fetch's `CancelledError` although nobody cancelled us: swallow that one.
    """
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # a real cancellation of the caller
        # stop() ended early: close the connections it did not get to.
        await consumer._client.close()
