"""What retention holds in a shard, as readers see it: its clock, its markers, its media index.

The projector's retention rules (`stepstream.projector`'s `_retention.py`) write these keys; the
read model and the media sweep read them here (docs/decisions/0032-retention.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from stepstream.storage._keys import CLOCK, ENDED, ENDS, EXPIRED, MEDIA, RUN, UNRESOLVED_RUN
from stepstream.storage._reads import ShardReads
from stepstream.storage._state import RunState
from stepstream.storage._transaction import Transaction

MEDIA_INDEX_VERSION = 2
"""The version of the `MEDIA` index a shard made now holds (its identity's `media_index`).

1: references found by scanning each record's bytes for URIs, which missed every offloaded
binary (base64 in the record) and every sealed one; a sweep over it would delete kept media.
2: each snapshot record's own list of the objects it needs (`snapshot_media`)."""


def stored_clock(reads: ShardReads | Transaction, partition: int) -> int:
    """The partition's clock as stored (-1 before any step event)."""
    raw = reads.get(CLOCK.key(partition))
    return int(raw) if raw is not None else -1


def expired_started_at(reads: ShardReads, run_id: str) -> int | None:
    """When a run retention dropped from this shard had started (micros), or None if it was not."""
    raw = reads.get(EXPIRED.key(run_id))
    if raw is None:
        return None
    marker: dict[str, Any] = json.loads(raw)
    return int(marker['started_at'])


@dataclass(frozen=True, slots=True)
class RetentionState:
    """One shard's retention figures, for `stepstream retention`."""

    partition: int
    clock: int
    """The newest step-event timestamp applied (micros; -1 before any)."""
    cutoff: int | None
    """Runs that ended before this are dropped (None without a policy or a clock)."""
    waiting: int
    """Ended runs kept because they ended after the cut-off."""
    unresolved_ending: list[str]
    """Ended runs with an unresolved tool effect: resolve it before they expire with the run."""
    expired: int
    """Runs dropped so far (their markers)."""
    media: int
    """Distinct media payloads the shard's kept runs reference."""
    next_expiry: int | None
    """The clock (log time, micros) at which the next kept run expires; None if no run has ended."""


def retention_state(reads: ShardReads, partition: int, retain_us: int | None) -> RetentionState:
    """What retention holds and would drop in one shard (a full scan of the retention keyspaces)."""
    clock = stored_clock(reads, partition)
    cutoff = clock - retain_us if retain_us is not None and clock >= 0 else None
    ended = {ENDS.parse(k)[0] for k, _ in reads.scan(ENDS.tag)}
    unresolved = sorted({UNRESOLVED_RUN.parse(k)[0] for k, _ in reads.scan(UNRESOLVED_RUN.tag)} & ended)
    expired = sum(1 for _ in reads.scan(EXPIRED.tag))
    media = len(referenced_media(reads))
    first = next(iter(reads.scan(ENDED.prefix(partition))), None)
    next_expiry = None
    if first is not None and retain_us is not None:
        ended_at = ENDED.parse(first[0])[1]
        assert isinstance(ended_at, int)
        next_expiry = ended_at + retain_us
    unresolved_ending = [str(r) for r in unresolved]
    return RetentionState(
        partition, clock, cutoff, len(ended), unresolved_ending, expired, media, next_expiry
    )


@dataclass(frozen=True, slots=True)
class RetentionPreview:
    """What a policy of a given period would drop from one shard now (`retention --preview-days`)."""

    partition: int
    clock: int
    """The shard's clock: as stored under a policy; without one, the newest record time of its runs."""
    cutoff: int
    would_drop: int
    """Ended runs whose end is before the cut-off."""
    would_keep: int
    """Runs kept: ended after the cut-off, or not ended (running, stale)."""


def retention_preview(reads: ShardReads, partition: int, retain_us: int) -> RetentionPreview:
    """Count what a policy of `retain_us` would drop from the shard at its clock (a full scan of its runs).

    A projection built without a policy keeps no clock; the newest step-event time of its runs
    stands in for it (heartbeats included, records of other writers not), so the figure is close,
    not exact, there.
    """
    runs = [RunState.decode(v) for _, v in reads.scan(RUN.tag)]
    clock = stored_clock(reads, partition)
    if clock < 0:
        clock = max((max(r.started_at, r.last_record_at) for r in runs), default=-1)
    cutoff = clock - retain_us
    drop = sum(1 for r in runs if r.ended_at is not None and r.ended_at < cutoff)
    return RetentionPreview(partition, clock, cutoff, drop, len(runs) - drop)


def referenced_media(reads: ShardReads) -> set[str]:
    """The sha256 digests the shard's kept runs reference (the mark of `sweep_media`)."""
    digests = set()
    for k, _ in reads.scan(MEDIA.tag):
        digest, _run = MEDIA.parse(k)
        assert isinstance(digest, str)
        digests.add(digest)
    return digests
