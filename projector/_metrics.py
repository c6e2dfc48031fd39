"""`ApplyMetrics`: what a projector counts, for its callers, `status`, Prometheus and OpenTelemetry."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from aiokafka.structs import TopicPartition
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry

from stepstream import metrics as catalogue
from stepstream.projector._apply import DLQ_REASONS, BatchOutcome
from stepstream.telemetry import lag, records_applied, records_dead_lettered
from stepstream.timestamps import micros
from stepstream.topics import Position

RATE_WINDOW_S = 10.0
"""The apply rate a shard stores for `stepstream status` is over this many seconds."""


LAG_SAMPLES = 256
"""End offsets a partition's `LagClock` remembers; past that, the samples after the oldest thin out."""


class LagClock:
    """When each end offset of a partition was first seen, to tell how long a record has waited.

    `seen` is called with the partition's end offset after each batch and at each scrape; the
    oldest record not applied yet arrived no later than the first sample whose end passed it, so
    `seconds_behind` is a lower bound, exact to the sampling interval, and 0 when caught up.
    """

    def __init__(self) -> None:
        """No samples."""
        self._samples: deque[tuple[int, float]] = deque()

    def seen(self, end: int, now: float) -> None:
        """The partition ends at `end` at monotonic time `now`."""
        if self._samples and end <= self._samples[-1][0]:
            return
        self._samples.append((end, now))
        if len(self._samples) > LAG_SAMPLES:
            del self._samples[1]  # the oldest is the one that matters: keep it

    def seconds_behind(self, applied: int, now: float) -> float:
        """Since the record at offset `applied` (the first not applied) was first known to exist."""
        samples = self._samples
        while samples and samples[0][0] <= applied:
            samples.popleft()
        return max(now - samples[0][1], 0.0) if samples else 0.0


class ApplyMetrics:
    """Totals of applied, duplicate and dead-lettered records, per-shard rates, lag clocks, instruments.

    `registry` holds the Prometheus instruments (`stepstream.metrics.CATALOGUE`); the
    OpenTelemetry ones are no-ops without an SDK configured.
    """

    def __init__(self) -> None:
        """Everything at zero."""
        self.records_applied = 0
        self.duplicates_ignored = 0
        self.dead_lettered = 0
        self.registry = CollectorRegistry()
        """This projector's instruments; `ProjectorObserver` adds what a scrape reads."""
        self._applied = catalogue.counter(self.registry, 'stepstream_projector_records_applied')
        self._duplicates = catalogue.counter(self.registry, 'stepstream_projector_duplicates_ignored')
        self._dead = catalogue.counter(self.registry, 'stepstream_projector_dead_letters')
        for reason in DLQ_REASONS:  # each at 0 from the start, so the first letter shows as an increase
            self._dead.labels(reason)
        self._apply_seconds = catalogue.histogram(self.registry, 'stepstream_projector_batch_apply_seconds')
        self._freshness = catalogue.histogram(self.registry, 'stepstream_projector_freshness_seconds')
        self.clocks: dict[TopicPartition, LagClock] = {}
        self._recent: dict[int, deque[tuple[float, int]]] = {}
        self._in_window: dict[int, int] = {}
        """Partition -> the records of its `_recent` batches: kept, not summed per batch."""

    def rate(self, partition: int, consumed: int) -> dict[str, float | int]:
        """The figures a shard stores with a batch of `consumed` records: its rate and the time."""
        now = time.monotonic()
        recent = self._recent.setdefault(partition, deque())
        recent.append((now, consumed))
        total = self._in_window.get(partition, 0) + consumed
        while recent[0][0] < now - RATE_WINDOW_S:  # never empties: the batch just added is in it
            total -= recent.popleft()[1]
        self._in_window[partition] = total
        elapsed = max(now - recent[0][0], 1.0)
        return {'rate': round(total / elapsed, 1), 'at': micros(datetime.now(UTC))}

    def forget(self, partition: int) -> None:
        """A shard moved away: its rate and lag clocks start over if it comes back."""
        self._recent.pop(partition, None)
        self._in_window.pop(partition, None)
        for tp in [tp for tp in self.clocks if tp.partition == partition]:
            del self.clocks[tp]

    def clock(self, tp: TopicPartition) -> LagClock:
        """The lag clock of `tp`."""
        found = self.clocks.get(tp)
        if found is None:
            found = self.clocks[tp] = LagClock()
        return found

    def observe(
        self,
        outcomes: Sequence[BatchOutcome],
        next_offsets: Position,
        highwater: Callable[[TopicPartition], int | None],
        current: Span | None,
        timing: tuple[float, list[int]] = (0.0, []),
    ) -> None:
        """Count a committed batch; its lag, its span's attributes, and its `timing`.

        `timing` is the seconds the batch took to apply and the timestamp (ms) of each
        partition's oldest record in it.
        """
        applied = sum(o.applied for o in outcomes)
        dead = [d for o in outcomes for d in o.dead]
        duplicates = sum(o.duplicates for o in outcomes)
        self.records_applied += applied
        self.duplicates_ignored += duplicates
        self.dead_lettered += len(dead)
        records_applied.add(applied)
        self._applied.inc(applied)
        self._duplicates.inc(duplicates)
        for letter in dead:
            records_dead_lettered.add(1, {'stepstream.reason': letter.reason})
            self._dead.labels(letter.reason).inc()
        seconds, oldest = timing
        self._apply_seconds.observe(seconds)
        now_ms = time.time() * 1000
        for stamp in oldest:
            if stamp > 0:  # -1: the record carries no timestamp
                self._freshness.observe(max(now_ms - stamp, 0.0) / 1000)
        now = time.monotonic()
        for tp, offset in next_offsets.items():
            high = highwater(tp)
            if high is not None:
                self.clock(tp).seen(high, now)
                lag.set(
                    max(high - offset, 0),
                    {'stepstream.topic': tp.topic, 'stepstream.partition': tp.partition},
                )
        if current is not None and current.is_recording():
            current.set_attributes(
                {
                    'stepstream.records': sum(o.applied + o.duplicates + len(o.dead) for o in outcomes),
                    'stepstream.applied': applied,
                    'stepstream.dead_lettered': len(dead),
                }
            )
