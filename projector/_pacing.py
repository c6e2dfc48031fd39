"""`TopicPacer`: keeps a shard's tool-effect records from running ahead of its step events.

A consumer fetching both log topics from offset zero (a rebuild, a new member, a restored
shard catching up) takes about as many bytes of each per fetch, so the tool-effects partition,
a quarter of the records, runs far ahead of its step events. Every transition read before its
run's `run_started` is parked, and applied (and often decoded again) when the registration comes:
in a rebuild of the 50-step runs of `bench/`, more than a quarter of all records were parked.

The apply rules give the same projection whatever the interleaving of the two topics
(docs/decisions/0010-conflict-rules.md), so the order in which they are applied is ours to
choose. The pacer holds back, per partition, the tool-effect records whose Kafka timestamp is
later than the newest step event fetched from the same partition number, while the consumer
has step events of that partition left to return (its position there is below the high
watermark), and orders each round step events first. Held records are the next ones of their
partition, so a shard's stored offsets never pass one; the projector pauses fetching that
partition while it holds any (memory stays bounded) and applies them as the step events catch
up. Nothing waits for ever: the step-events position reaching the high watermark (always so
when the projector is caught up, so live records are never held), or `patience_s` passing
without a step event of the partition, releases them.

How a round is paced is a matter of speed only; dropping what is held (on a seek, an assignment
change, a stop) loses nothing, since those records are read again from the shard's offsets.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

from aiokafka.structs import TopicPartition


class _Fetched(Protocol):
    @property
    def offset(self) -> int: ...

    @property
    def timestamp(self) -> int: ...


R = TypeVar('R', bound=_Fetched)


class TopicPacer:
    """Paces the tool-effects partitions behind the step-events partitions of the same number."""

    def __init__(self, events_topic: str, effects_topic: str, *, patience_s: float = 10.0) -> None:
        """`patience_s`: how long held records wait for a step event of their partition at most."""
        self.events_topic = events_topic
        self.effects_topic = effects_topic
        self.patience_s = patience_s
        self._held: dict[TopicPartition, list[Any]] = {}
        self._waiting: dict[int, float] = {}
        """Partition -> since when (monotonic) its held records wait with no step event fetched."""
        self._newest: dict[int, int] = {}
        """Partition -> the newest timestamp of the step events fetched from it so far."""

    @property
    def holding(self) -> set[TopicPartition]:
        """The tool-effects partitions with records held back (their fetching should be paused)."""
        return set(self._held)

    def pace(
        self,
        batches: Mapping[TopicPartition, list[R]],
        highwater: Callable[[TopicPartition], int | None],
        position: Callable[[TopicPartition], int | None],
    ) -> dict[TopicPartition, list[R]]:
        """The records of this round to apply now: step events first, the held-back effects kept.

        `highwater` and `position` are the consumer's: the end of a step-events partition as its
        last fetch saw it, and the offset of the next record it will return there (None when
        unknown). A partition is caught up when its position reaches its high watermark.
        """
        events: dict[int, tuple[TopicPartition, list[R]]] = {}
        effects: dict[int, tuple[TopicPartition, list[R]]] = {}
        for tp, records in batches.items():
            if not records:
                continue
            if tp.topic == self.events_topic:
                events[tp.partition] = (tp, records)
                newest = max(r.timestamp for r in records)
                if newest > self._newest.get(tp.partition, newest - 1):
                    self._newest[tp.partition] = newest
            else:
                effects[tp.partition] = (tp, records)
        for tp in self._held:
            effects.setdefault(tp.partition, (tp, []))
        out: dict[TopicPartition, list[R]] = dict(events.values())
        for p, (tp, fresh) in effects.items():
            held: list[R] = self._held.pop(tp, [])
            records = held + fresh if held else fresh
            ready = self._ready(p, records, p in events, highwater, position)
            if ready < len(records):
                self._held[tp] = records[ready:]
            else:
                self._waiting.pop(p, None)
            if ready:
                out[tp] = records[:ready]
        return out

    def _ready(
        self,
        partition: int,
        records: list[R],
        moved: bool,
        highwater: Callable[[TopicPartition], int | None],
        position: Callable[[TopicPartition], int | None],
    ) -> int:
        """How many of a tool-effects partition's records (in offset order) to apply now."""
        events_tp = TopicPartition(self.events_topic, partition)
        end, at = highwater(events_tp), position(events_tp)
        if end is not None and at is not None and at >= end:
            self._waiting.pop(partition, None)
            return len(records)  # the step events are caught up: nothing to wait for
        now = time.monotonic()
        if moved:
            self._waiting[partition] = now
        elif now - self._waiting.setdefault(partition, now) >= self.patience_s:
            self._waiting.pop(partition, None)
            return len(records)  # step events are not coming: do not wait for them
        newest = self._newest.get(partition)
        if newest is None:
            return 0
        if records[-1].timestamp <= newest:
            return len(records)
        for i, record in enumerate(records):
            if record.timestamp > newest:
                return i
        return len(records)

    def drop(self, partitions: Iterable[int] | None = None) -> None:
        """Forget what is held (of `partitions`, or all): it is read again from the shards' offsets."""
        if partitions is None:
            self._held.clear()
            self._waiting.clear()
            self._newest.clear()
            return
        for p in partitions:
            self._held.pop(TopicPartition(self.effects_topic, p), None)
            self._waiting.pop(p, None)
            self._newest.pop(p, None)
