"""`Assignment`: which partitions a projector consumes, and from where.

A projector without a group takes its partitions when it starts; a group member takes and gives
them back as the group rebalances (`listener()`). Either way, taking a partition opens (or
restores, or creates) its shard in the `ShardSet` and seeks the consumer to the shard's stored
offsets, and giving it back closes the shard. It also paces the tool-effects partitions behind
the step events (`TopicPacer`), pausing and resuming the consumer's fetches to match.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord
from aiokafka.structs import TopicPartition

from stepstream.errors import StepStreamError
from stepstream.projector._metrics import ApplyMetrics
from stepstream.projector._pacing import TopicPacer
from stepstream.projector._progress import AppliedPosition
from stepstream.storage import Shard, ShardSet
from stepstream.topics import TopicLayout

log = logging.getLogger('stepstream.projector')

Batches = dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]


class Assignment:
    """The partitions a projector holds: their shards, the consumer's position in them, pacing."""

    def __init__(
        self,
        shards: ShardSet,
        applied: AppliedPosition,
        metrics: ApplyMetrics,
        topics: tuple[str, str],
        *,
        group: str | None,
        on_assignment: Callable[[list[int]], None] | None,
        on_failure: Callable[[BaseException], Awaitable[None]],
        on_open: Callable[[Shard], None] | None = None,
    ) -> None:
        """Hold nothing yet; `attach` gives the consumer once the projector is connected.

        `on_assignment` hears the partitions held after each change; `on_failure` that a member
        could not take its partitions (the projector stops on it); `on_open` each shard opened,
        before anything is applied to it (the applier takes the options its identity holds).
        """
        self.shards = shards
        self.applied = applied
        self.metrics = metrics
        self.topics = topics
        self.group = group
        self.on_assignment = on_assignment
        self.on_failure = on_failure
        self.on_open = on_open
        self.pacer = TopicPacer(*topics)
        self.consumer: AIOKafkaConsumer | None = None
        self.layout: TopicLayout | None = None
        self.changes = 0
        """Counts assignment changes, so a batch fetched across one is recognised and dropped."""
        self.joined = False
        """A member: the group gave it an assignment (maybe empty) and it took it (`/readyz`)."""

    @property
    def partitions(self) -> list[int]:
        """The partition numbers whose shards are held now."""
        return self.shards.partitions

    def attach(self, consumer: AIOKafkaConsumer, layout: TopicLayout) -> None:
        """The consumer to position and the topics' layout, once the projector connected."""
        self.consumer, self.layout = consumer, layout

    def listener(self) -> ConsumerRebalanceListener:
        """What a group member's consumer calls on each rebalance."""
        return _Rebalance(self)

    async def open_shard(self, partition: int) -> Shard:
        """Open, restore or create the shard of `partition`; the consumer starts at its offsets."""
        assert self.layout is not None
        shard = await self.shards.assign(partition, self.layout)
        self.applied.start_at(shard.offsets())
        if self.on_open is not None:
            self.on_open(shard)
        return shard

    async def seek(self, assigned: Collection[TopicPartition]) -> None:
        """Position the consumer at the applied offsets (the beginning where there are none)."""
        assert self.consumer is not None
        for tp in assigned:
            offset = self.applied.get(tp)
            if offset is None:
                await self.consumer.seek_to_beginning(tp)
            else:
                self.consumer.seek(tp, offset)

    async def refetch(self) -> None:
        """Drop a batch fetched across an assignment change; fetch again from the shards' offsets.

        aiokafka installs a new assignment and starts fetching from the group's committed offsets
        before it calls `assigned`, which restores shards and seeks to their stored offsets. A
        batch `getmany` returned meanwhile may start past a restored shard's offsets: applying it
        would skip the records in between. Seeking every owned partition again costs one fetch.
        """
        assert self.consumer is not None
        self.pacer.drop()
        await self.seek(self.consumer.assignment())
        self._pause_held()

    async def pace(self, batches: Batches) -> Batches:
        """What to apply of a round: step events first, tool effects not ahead of them (`_pacing`)."""
        consumer = self.consumer
        assert consumer is not None
        events, effects = self.topics
        numbers = {tp.partition for tp in batches if tp.topic == effects}
        numbers.update(tp.partition for tp in self.pacer.holding)
        assigned = consumer.assignment()
        positions: dict[TopicPartition, int] = {}
        for p in numbers:
            tp = TopicPartition(events, p)
            if tp in assigned:
                positions[tp] = await consumer.position(tp)
        paced = self.pacer.pace(batches, consumer.highwater, positions.get)
        self._pause_held()
        return paced

    def _pause_held(self) -> None:
        """Fetch no more of a partition whose records the pacer holds back; resume the others."""
        consumer = self.consumer
        if consumer is None:
            return
        holding, paused = self.pacer.holding, consumer.paused()
        if holding != paused:
            if holding - paused:
                consumer.pause(*(holding - paused))
            resume = (paused - holding) & consumer.assignment()
            if resume:
                consumer.resume(*resume)

    async def assigned(self, assigned: set[TopicPartition]) -> None:
        """The group gave this member partitions: open (or restore) their shards and seek.

        A shard that cannot be opened stops the member (its partitions must not be consumed
        with nowhere to apply them): the error goes to `on_failure`.
        """
        try:
            await self._take(assigned)
        except Exception as exc:
            log.error('member of %s cannot take its partitions: %s', self.group, exc)
            await self.on_failure(exc)

    async def _take(self, assigned: set[TopicPartition]) -> None:
        numbers = {tp.partition for tp in assigned}
        lopsided = sorted(
            p for p in numbers if any(TopicPartition(t, p) not in assigned for t in self.topics)
        )
        if lopsided:
            raise StepStreamError(
                f'the group {self.group!r} assigned partition(s) {lopsided} of one log topic '
                'without the other; '
                'every member must be a stepstream projector (range assignment keeps a shard together)'
            )
        async with self.shards.lock:
            self.changes += 1
            self.pacer.drop()
            for partition in sorted(numbers - set(self.shards.partitions)):
                await self.open_shard(partition)
            await self.seek(assigned)
            self._pause_held()
        self.joined = True
        log.info('member of %s: owns partitions %s', self.group, self.partitions)
        if self.on_assignment is not None:
            self.on_assignment(self.partitions)

    async def revoked(self, revoked: set[TopicPartition]) -> None:
        """Partitions are moving away: finish the batch in hand, then flush and close their shards."""
        async with self.shards.lock:
            self.changes += 1
            numbers = sorted({tp.partition for tp in revoked})
            self.pacer.drop(numbers)
            for partition in numbers:
                self.release(partition)
        if self.on_assignment is not None and revoked:
            self.on_assignment(self.partitions)

    def release(self, partition: int) -> None:
        """Close the shard of `partition` and forget where it stood."""
        self.shards.revoke(partition)
        self.metrics.forget(partition)
        self.applied.forget(TopicPartition(topic, partition) for topic in self.topics)


class _Rebalance(ConsumerRebalanceListener):
    """Hands a member's assignment changes to its `Assignment`."""

    def __init__(self, assignment: Assignment) -> None:
        self.assignment = assignment

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Close the shards moving away (after the batch in hand)."""
        await self.assignment.revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Open, restore or create the shards of the new assignment."""
        await self.assignment.assigned(assigned)
