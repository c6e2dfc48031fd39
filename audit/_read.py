"""Reading the log for an audit: each partition of both topics from its start, nothing else.

`read_partitions` yields one `PartitionRead` per partition number: the runs' records (`Seen`, the
answers beside their trails included),
anything that is not a record of ours, and, per topic, where the partition starts and ends, how
many records it holds, and its rolling digest (what a checkpoint states). One partition number
at a time, so memory holds one partition's records, not the log's.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from stepstream.audit._records import ANSWER_KINDS, TOPIC_NAMES, Answer, Seen
from stepstream.errors import SchemaError
from stepstream.schema_registry import SchemaRegistry
from stepstream.schemas import (
    CONFLUENT_MAGIC,
    RESUMED_BY_KEY,
    STEP_EVENTS,
    SchemaVersion,
    chain_hash,
    confluent_schema_id,
    from_confluent,
    is_linked,
    read_record,
)
from stepstream.settings import Settings
from stepstream.signing import SIGNATURE, SIGNED_KIND, SIGNING_KEY
from stepstream.topics import log_end_offsets, murmur2_partition, partition_counts, started_consumer

MARK_EVERY = 10_000
"""A partition's rolling digest is kept every this many records: where a verification of a
trimmed log resumes, and how close a checkpoint's verification names a divergence."""
ZERO = '00' * 32


@dataclass(slots=True)
class Digest:
    """A topic partition's rolling digest: SHA-256 of the previous digest and each record's key and value."""

    start: int | None = None
    """The offset of the first record read (None: the partition is empty)."""
    end: int = 0
    """The offset after the last record read."""
    count: int = 0
    value: bytes = bytes(32)
    marks: list[tuple[int, int, str]] = field(default_factory=list)
    """(records so far, offset after the last of them, digest), every `MARK_EVERY` records."""
    stop: int | None = None
    """A count to keep the digest at (a checkpoint's), in `at_stop`."""
    at_stop: tuple[int, str] | None = None
    """(offset after the record, digest) once `stop` records were read."""
    last: bytes = b''
    """The value of the last record read (`last_record` hashes it for a checkpoint)."""
    find: tuple[int, str] | None = None
    """A record to find by its value (`last_record` of a checkpoint's last record of the partition)."""
    found: int | None = None
    """The offset of the first record read whose value is `find` (a later resend of it is not)."""

    def add(self, offset: int, key: bytes | None, value: bytes | None) -> None:
        """Fold the record at `offset` in."""
        if self.start is None:
            self.start = offset
        key, value = key or b'', value or b''
        self.last = value
        find = self.find
        if (
            self.found is None
            and find is not None
            and len(value) == find[0]
            and self.last_record()[1] == find[1]
        ):
            self.found = offset
        self.value = hashlib.sha256(b'%s%d:%s%d:%s' % (self.value, len(key), key, len(value), value)).digest()
        self.count += 1
        self.end = offset + 1
        if self.count % MARK_EVERY == 0:
            self.marks.append((self.count, self.end, self.value.hex()))
        if self.count == self.stop:
            self.at_stop = (self.end, self.value.hex())

    def last_record(self) -> tuple[int, str]:
        """The length and SHA-256 (hex) of the last record's value: where a checkpoint ended, by content."""
        return len(self.last), hashlib.sha256(self.last).hexdigest()

    def resume(self, count: int, end: int, digest: str) -> None:
        """Continue from a mark (a trimmed log): as if the `count` records before `end` had been read."""
        self.start, self.count, self.end, self.value = end, count, end, bytes.fromhex(digest)


@dataclass(slots=True)
class Unreadable:
    """A record no writer of ours wrote: not a record of ours, or on the wrong topic."""

    topic: str
    partition: int
    offset: int
    detail: str


@dataclass(slots=True)
class PartitionRead:
    """What one partition number of both topics holds."""

    partition: int
    runs: dict[str, list[Seen]] = field(default_factory=dict)
    unreadable: list[Unreadable] = field(default_factory=list)
    digests: dict[str, Digest] = field(default_factory=dict)
    """By topic role (`step_events`, `tool_effects`)."""
    conversations: dict[str, str] = field(default_factory=dict)
    """Each run's conversation id, where its records name one."""


class Registry:
    """Resolves Confluent-framed records' schema ids through the registry, once per id."""

    def __init__(self, settings: Settings) -> None:
        self.registry = (
            SchemaRegistry(settings.registry, timeout_s=settings.kafka.ack_timeout_s)
            if settings.registry.schema_registry_url
            else None
        )
        self.versions: dict[int, SchemaVersion | str] = {}

    async def single_object(self, value: bytes) -> bytes | str:
        """The record in single-object form, or why it cannot be read."""
        schema_id = confluent_schema_id(value)
        if schema_id is None:
            return 'a Confluent-framed value without a schema id'
        if schema_id not in self.versions:
            if self.registry is None:
                self.versions[schema_id] = (
                    f'a Confluent wire-format record (schema id {schema_id}) and no schema registry '
                    'configured: set STEPSTREAM_SCHEMA_REGISTRY_URL'
                )
            else:
                try:
                    self.versions[schema_id] = await self.registry.version_of(schema_id)
                except SchemaError as exc:
                    self.versions[schema_id] = str(exc)
        found = self.versions[schema_id]
        return from_confluent(value, found) if isinstance(found, SchemaVersion) else found

    async def close(self) -> None:
        """Close the registry client."""
        if self.registry is not None:
            await self.registry.close()


@dataclass(frozen=True, slots=True)
class Expected:
    """What a checkpoint saw of one topic partition: where it started and its digest's marks."""

    start: int
    count: int
    marks: tuple[tuple[int, int, str], ...]
    last: tuple[int, str] | None = None
    """Its last record's `Digest.last_record` (checkpoints of format 2)."""


async def read_partitions(
    settings: Settings,
    *,
    expected: Mapping[tuple[str, int], Expected] | None = None,
    only: str | None = None,
) -> AsyncIterator[PartitionRead]:
    """Each partition number of the log's two topics, read from its start to its end now.

    With `expected` (by topic role and partition, from a checkpoint), each digest is kept at the
    checkpoint's count, and where the log now starts after the checkpoint's start (trimmed), the
    digest resumes from the checkpoint's first mark it still holds. With `only`, just the
    partition number of that run.
    """
    topics = (settings.topics.step_events_topic, settings.topics.tool_effects_topic)
    counts = await partition_counts(settings.kafka, list(topics))
    if not counts:
        return
    partitions = max(counts.values())
    consumer = await started_consumer(
        settings.kafka,
        auto_offset_reset='earliest',
        fetch_max_wait_ms=50,  # a partition's last fetch must not wait out the default 500 ms
        fetch_max_bytes=32 * 1024 * 1024,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )
    registry = Registry(settings)
    try:
        numbers = range(partitions) if only is None else [murmur2_partition(only.encode(), partitions)]
        by_number = {n: [TopicPartition(t, n) for t in topics if counts.get(t, 0) > n] for n in numbers}
        # Assigned once and paused, then resumed one partition number at a time: aiokafka 0.14's
        # fetcher swallows its own cancellation when `stop()` lands while it settles a changed
        # assignment, and `stop()` then never returns (seen in CI: a verify hung for an hour).
        consumer.assign([tp for tps in by_number.values() for tp in tps])
        consumer.pause(*consumer.assignment())
        for tps in by_number.values():
            yield await _read_partition(consumer, settings, registry, tps, partitions, expected or {})
    finally:
        await registry.close()
        await consumer.stop()


async def _read_partition(
    consumer: AIOKafkaConsumer,
    settings: Settings,
    registry: Registry,
    tps: list[TopicPartition],
    partitions: int,
    expected: Mapping[tuple[str, int], Expected],
) -> PartitionRead:
    step_events = settings.topics.step_events_topic
    role = {tp: TOPIC_NAMES[0 if tp.topic == step_events else 1] for tp in tps}
    starts = await consumer.beginning_offsets(tps)
    listed = await consumer.end_offsets(tps)  # Tansu's can be short: `log_end_offsets` reads past it
    ends = await log_end_offsets(settings.kafka, {(tp.topic, tp.partition): listed[tp] for tp in tps})
    read = PartitionRead(partition=tps[0].partition)
    remaining: dict[TopicPartition, int] = {}
    resumed: dict[TopicPartition, tuple[int, int, str]] = {}
    for tp in tps:
        end = ends[(tp.topic, tp.partition)]
        saw = expected.get((role[tp], tp.partition))
        read.digests[role[tp]] = Digest(
            stop=saw.count if saw is not None else None, find=saw.last if saw is not None else None
        )
        if saw is not None and starts[tp] > saw.start:  # trimmed since: resume at a mark it holds
            mark = next((m for m in saw.marks if m[1] >= starts[tp]), None)
            if mark is not None:
                resumed[tp] = mark
        if end > starts[tp]:
            remaining[tp] = end
    for tp in remaining:
        consumer.seek(tp, starts[tp])
    consumer.resume(*remaining)
    while remaining:
        batches = await consumer.getmany(*remaining, timeout_ms=int(settings.kafka.ack_timeout_s * 1000))
        if not batches:
            raise TimeoutError(f'the log did not hand over its records up to its end: {remaining}')
        for tp, messages in batches.items():
            if tp not in remaining:
                continue
            end = remaining[tp]
            topic = 0 if tp.topic == step_events else 1
            digest = read.digests[role[tp]]
            mark = resumed.get(tp)
            for message in messages:
                if message.offset >= end:
                    break
                if mark is not None and message.offset >= mark[1]:
                    digest.resume(*mark)
                    del resumed[tp]
                    mark = None
                if mark is None:  # before a resumed mark, records are read but not digested
                    digest.add(message.offset, message.key, message.value)
                await _take(
                    read,
                    registry,
                    topic,
                    tp.partition,
                    message.offset,
                    message.key,
                    message.value,
                    partitions,
                )
            if messages and messages[-1].offset + 1 >= end:
                remaining.pop(tp)
                consumer.pause(tp)
    return read


async def _take(
    read: PartitionRead,
    registry: Registry,
    topic: int,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    partitions: int,
) -> None:
    """Sort one record into its run's, or into the unreadable ones."""
    where = (TOPIC_NAMES[topic], partition, offset)
    if not value:
        read.unreadable.append(Unreadable(*where, 'an empty value (a tombstone)'))
        return
    if value[0] == CONFLUENT_MAGIC:
        converted = await registry.single_object(value)
        if isinstance(converted, str):
            read.unreadable.append(Unreadable(*where, converted))
            return
        value = converted
    try:
        found, fields = read_record(value)
    except SchemaError as exc:
        read.unreadable.append(Unreadable(*where, f'not a record of ours: {exc}'))
        return
    if found != topic:
        read.unreadable.append(Unreadable(*where, f'a record of the {TOPIC_NAMES[found]} topic on this one'))
        return
    run_id = fields['run_id']
    kind = fields['kind'] if topic == STEP_EVENTS else fields['status']
    answer = None
    if (topic, kind) in ANSWER_KINDS:  # another process's, beside the trail: names no conversation
        by = fields['resolved_by'] if topic else fields['metadata'].get(RESUMED_BY_KEY)
        answer = Answer(fields['resolution'] if topic else None, by, fields['writer_id'])
    elif fields['conversation_id'] is not None:
        read.conversations[run_id] = fields['conversation_id']
    signature = None
    if kind == SIGNED_KIND:
        metadata = fields['metadata']
        signature = (metadata.get(SIGNING_KEY, ''), metadata.get(SIGNATURE, ''))
    placed = key == run_id.encode() and murmur2_partition(run_id.encode(), partitions) == partition
    read.runs.setdefault(run_id, []).append(
        Seen(
            topic=topic,
            partition=partition,
            offset=offset,
            seq=fields['seq'],
            digest=chain_hash(value),
            prev_hash=fields['prev_hash'],
            kind=kind,
            placed=placed,
            signature=signature,
            linked=is_linked(value),
            call=None if topic == STEP_EVENTS else fields['tool_call_id'],
            answer=answer,
        )
    )
