"""The projector's option objects: a group member's, a rebuild's, and the parts a test may replace."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stepstream.errors import UsageError
from stepstream.projector._commits import GroupOffsets
from stepstream.projector._dead_letters import DeadLetterSender
from stepstream.projector._metrics import ApplyMetrics
from stepstream.settings import Settings, check_count

if TYPE_CHECKING:
    from stepstream.projector._membership import Membership
    from stepstream.storage import Checkpoints


SESSION_TIMEOUT_MS = 10_000
"""How long a consumer group waits for a silent member, unless `GroupMember` says otherwise."""


@dataclass(frozen=True, kw_only=True)
class GroupMember:
    """A consumer group's member (`member`), instead of a projector that owns every partition.

    It joins `group`: it opens the shards of the partitions the group assigns it, closes them
    when they are revoked, and several members (on one host sharing `db_path`, or on several
    hosts) split the work.
    """

    group: str
    """The consumer group this projector is a member of."""
    session_timeout_ms: int = SESSION_TIMEOUT_MS
    """How long the group waits for a silent member before its partitions move."""
    on_assignment: Callable[[list[int]], None] | None = None
    """Called with the partitions the member holds after every change."""
    membership: Membership | None = None
    """What the member tells the group (`endpoint`, the URL its service answers on) and learns
    there (who owns each partition: `_membership`); None: a `Membership()` without an endpoint."""
    checkpoints: Checkpoints | None = None
    """Uploads the member's shards to S3, and restores shards it is assigned but does not hold."""


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

    def made(
        self, settings: Settings, topics: tuple[str, str], *, live: bool
    ) -> tuple[DeadLetterSender, GroupOffsets, ApplyMetrics]:
        """These parts, each one not given made from `settings`.

        A rebuild (not `live`) does not show up in lag tooling: it commits nothing to the consumer group.
        """
        return (
            self.dead_letters or DeadLetterSender(settings.kafka, settings.topics.dlq_topic, topics=topics),
            self.group_offsets or GroupOffsets(enabled=live),
            self.metrics or ApplyMetrics(),
        )


def only_partitions(
    member: GroupMember | None, rebuilding: Rebuilding | None, max_snapshots_per_run: int | None
) -> frozenset[int] | None:
    """The partitions a projector is limited to (None: every one), once its options agree.

    Refuses a `max_snapshots_per_run` that is not an int of at least 1 (or None), and a group
    member that is also given partitions.
    """
    check_count(max_snapshots_per_run, 'max_snapshots_per_run', optional=True)
    partitions = rebuilding.partitions if rebuilding is not None else None
    if member is not None and partitions is not None:
        raise UsageError('a group member owns the partitions its group assigns; give member or partitions')
    return frozenset(partitions) if partitions is not None else None
