"""The projector's option objects: what a rebuild changes, and the parts a test may replace."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from stepstream.projector._commits import GroupOffsets
from stepstream.projector._dead_letters import DeadLetterSender
from stepstream.projector._metrics import ApplyMetrics


@dataclass(frozen=True, kw_only=True)
class Rebuilding:
    """A rebuild's projector (`rebuild`), instead of a live one.

    It replays the log into a projection marked incomplete until `mark_rebuilt()`, commits
    nothing to the consumer group (lag tooling must not see it), does not repeat the DLQ, and
    applies only `partitions` (a parallel rebuild's worker; None: every partition).
    """

    partitions: Collection[int] | None = None


@dataclass(frozen=True, kw_only=True)
class ProjectorParts:
    """What a projector coordinates, when not made from its settings (tests and benchmarks)."""

    dead_letters: DeadLetterSender | None = None
    """Sends to the DLQ."""
    group_offsets: GroupOffsets | None = None
    """Commits applied offsets to the consumer group, for lag tooling."""
    metrics: ApplyMetrics | None = None
    """Counts what was applied."""
