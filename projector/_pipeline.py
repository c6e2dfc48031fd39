"""`BatchPipeline`: one fetched batch's way from the consumer to committed shards.

Per partition: the records in both wire formats made single-object (`WireFormats`), staged by the
`Applier` on the partition's shard (on the loop for a small batch, in a thread otherwise), dead
letters acknowledged by the DLQ before the batch commits, then the commit; after it, the metrics,
the applied position (what `wait_for` waits on) and the offsets the consumer group is told.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, ConsumerRecord
from aiokafka.structs import TopicPartition
from opentelemetry.trace import Span

from stepstream.projector._apply import EFFECTS, EVENTS, Applier, BatchOutcome, SourceRecord
from stepstream.projector._commits import GroupOffsets
from stepstream.projector._dead_letters import DeadLetterSender
from stepstream.projector._metrics import ApplyMetrics
from stepstream.projector._progress import AppliedPosition
from stepstream.projector._wire import WireFormats
from stepstream.settings import Settings
from stepstream.storage import ShardSet, Transaction
from stepstream.telemetry import span
from stepstream.topics import Position, TopicLayout

INLINE_APPLY_RECORDS = 50
"""A batch of at most this many records is staged and committed on the event loop, not in a thread.

Staging is Python holding the GIL (live, 40-100 µs a record with the commit, since each batch
decodes and encodes the states of the runs it touches), so below the interpreter's switch
interval (5 ms, about this many records) a worker thread does not give the loop that time back;
it only adds the hop there and back, each a wake-up of a loop that is serving the writers too.
Live, that hop was most of the time from a fetch to `wait_for` (benchmarks/history/issue-27.md,
third pass). Larger batches (a rebuild, catching up) still go to a thread, so the loop keeps turning.
"""


class BatchPipeline:
    """Applies each fetched batch to the shards that hold its partitions, exactly once.

    Made with the projector; `start` gives it the topics' layout (the `Applier` needs the partition
    count), `options_changed` the options a newly opened shard's identity holds.
    """

    def __init__(
        self,
        shards: ShardSet,
        topics: tuple[str, str],
        parts: tuple[DeadLetterSender, GroupOffsets, ApplyMetrics],
        position: AppliedPosition,
        *,
        send_dead_letters: bool,
        stopping: Callable[[], bool],
    ) -> None:
        """Apply to `shards`; `stopping` says when a wait on the DLQ or the registry should give up."""
        self.shards = shards
        self.topics = topics
        self.dead_letters, self.group_offsets, self.metrics = parts
        self.position = position
        self.send_dead_letters = send_dead_letters
        self.stopping = stopping
        self.applier: Applier | None = None
        self._wire: WireFormats | None = None
        self._topic_index = {topics[0]: EVENTS, topics[1]: EFFECTS}

    def start(self, settings: Settings, layout: TopicLayout) -> None:
        """Make the applier for the topics' `layout` and the reader of both wire formats."""
        self.applier = Applier(
            self.topics,
            partitions=layout.partitions,
            max_snapshots_per_run=self.shards.max_snapshots_per_run,
            retain_ended_us=self.shards.retain_ended_us,
        )
        self._wire = WireFormats(settings)

    def options_changed(self) -> None:
        """A shard was opened or restored: the applier keeps the options its identity holds."""
        if self.applier is not None:
            self.applier.max_snapshots = self.shards.max_snapshots_per_run
            if self.applier.retain_ended_us != self.shards.retain_ended_us:
                self.applier.retain_ended_us = self.shards.retain_ended_us

    async def close(self) -> None:
        """Close the schema registry's client, if one was opened."""
        wire, self._wire = self._wire, None
        if wire is not None:
            await wire.close()

    async def apply(
        self, consumer: AIOKafkaConsumer, batches: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
    ) -> None:
        """Apply a batch `consumer` fetched to the shards held (a partition revoked meanwhile: left)."""
        by_shard: dict[int, list[SourceRecord]] = {}
        for tp, messages in batches.items():
            if tp.partition not in self.shards:
                continue  # revoked meanwhile: its next owner reads these from the shard's offsets
            topic = self._topic_index[tp.topic]
            by_shard.setdefault(tp.partition, []).extend(
                SourceRecord(topic, tp.partition, m.offset, m.key, m.value) for m in messages
            )
        if not by_shard:
            return
        assert self._wire is not None
        for partition, records in by_shard.items():  # Confluent-framed records, if any, as single-object
            read = await self._wire.read(records, self.stopping)
            if read is None:
                return  # stopping while the schema registry does not answer: applied on restart
            by_shard[partition] = read
        oldest = [m[0].timestamp for tp, m in batches.items() if m and tp.partition in by_shard]
        with span('stepstream.projector.batch') as current:
            await self._stage_batch(consumer, by_shard, current, oldest)

    async def _stage_batch(
        self,
        consumer: AIOKafkaConsumer,
        by_shard: dict[int, list[SourceRecord]],
        current: Span | None,
        oldest: list[int],
    ) -> None:
        started = time.perf_counter()
        applier = self.applier
        assert applier is not None
        send = self.send_dead_letters
        shards, metrics = self.shards, self.metrics
        applier.max_snapshots = shards.max_snapshots_per_run  # learnt from the first shard opened

        def stage_and_commit() -> tuple[list[Transaction], list[BatchOutcome], bool]:
            txns, outcomes = [], []
            for partition, records in by_shard.items():
                txn, outcome = applier.stage(shards[partition], records)
                txn.set_progress(metrics.rate(partition, len(records)))
                txns.append(txn)
                outcomes.append(outcome)
            held = send and any(o.dead for o in outcomes)
            if not held:  # the common case: one hop to the worker thread, not two
                for txn in txns:
                    txn.commit()
            return txns, outcomes, held

        inline = sum(len(records) for records in by_shard.values()) <= INLINE_APPLY_RECORDS
        txns, outcomes, held = stage_and_commit() if inline else await asyncio.to_thread(stage_and_commit)
        # Dead letters are acknowledged by the DLQ before the batch (and its offsets) commits:
        # a crash in between repeats them in the DLQ on restart, and never loses one.
        if held:
            dead = [d for o in outcomes for d in o.dead]
            if not await self.dead_letters.send(dead, stopping=self.stopping):
                return  # stopping while the DLQ was unreachable: the batch is applied on restart
            if inline:
                for txn in txns:
                    txn.commit()
            else:
                await asyncio.to_thread(lambda: [txn.commit() for txn in txns])
        next_offsets: Position = {}
        for outcome in outcomes:
            for (topic, partition), offset in outcome.next_offsets.items():
                next_offsets[TopicPartition(self.topics[topic], partition)] = offset
        timing = (time.perf_counter() - started, oldest)
        self.metrics.observe(outcomes, next_offsets, consumer.highwater, current, timing)
        await self.position.advance(next_offsets)
        await self.group_offsets.applied(consumer, next_offsets)
