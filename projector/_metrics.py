"""`ApplyMetrics`: what a projector counts, for its callers, `stepstream status` and OpenTelemetry."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from aiokafka.structs import TopicPartition
from opentelemetry.trace import Span

from stepstream.projector._apply import BatchOutcome
from stepstream.telemetry import lag, records_applied, records_dead_lettered
from stepstream.timestamps import micros
from stepstream.topics import Position

RATE_WINDOW_S = 10.0
"""The apply rate a shard stores for `stepstream status` is over this many seconds."""


class ApplyMetrics:
    """Totals of applied, duplicate and dead-lettered records, per-shard rates, OpenTelemetry.

    The OpenTelemetry instruments are no-ops without an SDK configured.
    """

    def __init__(self) -> None:
        """Everything at zero."""
        self.records_applied = 0
        self.duplicates_ignored = 0
        self.dead_lettered = 0
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
        """A shard moved away: its rate starts over if it comes back."""
        self._recent.pop(partition, None)
        self._in_window.pop(partition, None)

    def observe(
        self,
        outcomes: Sequence[BatchOutcome],
        next_offsets: Position,
        highwater: Callable[[TopicPartition], int | None],
        current: Span | None,
    ) -> None:
        """Count a committed batch; set the lag of its partitions and its span's attributes."""
        applied = sum(o.applied for o in outcomes)
        dead = [d for o in outcomes for d in o.dead]
        self.records_applied += applied
        self.duplicates_ignored += sum(o.duplicates for o in outcomes)
        self.dead_lettered += len(dead)
        records_applied.add(applied)
        for letter in dead:
            records_dead_lettered.add(1, {'stepstream.reason': letter.reason})
        for tp, offset in next_offsets.items():
            high = highwater(tp)
            if high is not None:
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
