"""The status view: where the projection stands (`stepstream status`, the API's `/status`).

Applied offsets, the apply rate, dead letters, conflicts, parked records, each shard's state
and writer: all read from the shards, the lag aside (it needs the broker's end offsets).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from stepstream.readmodel._runs import RunCounts, Runs
from stepstream.readmodel._shards import Shards, ts
from stepstream.storage import (
    CONFLICT,
    CONFLICTING_COUNT,
    PARKED,
    PARKED_COUNT,
    combined_state,
    shard_paths,
    shard_writer,
)

RATE_WINDOW = timedelta(seconds=10)
"""The window of the records-per-second figure the projector keeps for `status`."""


@dataclass(kw_only=True)
class ProjectionStatus:
    """What `stepstream status` shows besides the lag (which needs the broker)."""

    offsets: dict[tuple[str, int], int]
    """(topic, partition) -> the next offset the projection will apply."""
    applied_per_second: float
    updated_at: datetime | None
    dead_lettered: int
    dead_lettered_by_reason: dict[str, int]
    conflicting_runs: int
    parked_records: int
    """Records waiting for their run's `run_started`, which has not arrived (in no other view)."""
    state: str | None
    """`live`, `rebuilding` (an unfinished rebuild: resume it) or `rebuilt`; None before the first start."""
    topic_prefix: str | None
    max_snapshots_per_run: int | None
    shards: list[int] = field(default_factory=list)
    """The partition numbers whose shards this reader sees."""
    missing_shards: list[int] = field(default_factory=list)
    """Partitions with no shard here (moving, on another host's member, or not made yet)."""
    writers: dict[int, int | None] = field(default_factory=dict)
    """Partition -> the pid of the projector applying its shard now; None: no projector does."""
    last_batch_at: dict[int, datetime | None] = field(default_factory=dict)
    """Partition -> when its projector last committed a batch to the shard."""
    runs: RunCounts | None = None
    """Runs per status and agent, and the calls in doubt (None: a shard made before the counts)."""


class Status:
    """Every shard readable here (whatever the scope): their offsets, progress, counts and identity."""

    def __init__(self, shards: Shards, runs: Runs) -> None:
        self._shards = shards
        self._runs = runs

    async def status(self) -> ProjectionStatus:
        """`ProjectionReader.status`."""

        def query() -> ProjectionStatus:
            offsets: dict[tuple[str, int], int] = {}
            dlq: dict[str, int] = {}
            rate, updated, conflicts, parked = 0.0, None, 0, 0
            identities = []
            now = datetime.now(UTC)
            last_batch: dict[int, datetime | None] = {}
            for partition, shard in self._shards.held.items():
                offsets.update({(tp.topic, tp.partition): offset for tp, offset in shard.offsets().items()})
                progress = shard.progress()
                last_batch[partition] = ts(int(progress['at'])) if progress.get('at') is not None else None
                if progress.get('at') is not None:
                    updated = max(updated or 0, int(progress['at']))
                    # The rate is over the ten seconds before the shard's last batch: once that
                    # batch is older than the window, the shard applied nothing in the last ten.
                    at = ts(int(progress['at']))
                    if at is not None and now - at <= RATE_WINDOW:
                        rate += float(progress.get('rate', 0.0))
                for reason, count in shard.dlq_counts().items():
                    dlq[reason] = dlq.get(reason, 0) + count
                identity = shard.identity()
                if identity is None or identity.run_index >= 3:  # counted as applied (`_listing`)
                    conflicts += shard.count(CONFLICTING_COUNT)
                    parked += shard.count(PARKED_COUNT)
                else:
                    conflicts += len({CONFLICT.parse(k)[0] for k, _ in shard.scan(CONFLICT.prefix())})
                    parked += sum(1 for _ in shard.scan(PARKED.prefix()))
                identities.append(identity)
            identity = next((i for i in identities if i is not None), None)
            missing = self._shards.missing()
            state = combined_state({i.state for i in identities if i is not None}, missing=bool(missing))
            return ProjectionStatus(
                offsets=dict(sorted(offsets.items())),
                applied_per_second=round(rate, 1),
                updated_at=ts(updated),
                dead_lettered=sum(dlq.values()),
                dead_lettered_by_reason=dict(sorted(dlq.items())),
                conflicting_runs=conflicts,
                parked_records=parked,
                state=state,
                topic_prefix=identity.topic_prefix if identity is not None else None,
                max_snapshots_per_run=identity.max_snapshots_per_run if identity is not None else None,
                shards=sorted(self._shards.held),
                missing_shards=missing,
                writers=self._writers(),
                last_batch_at=dict(sorted(last_batch.items())),
                runs=None if missing else self._runs.counts(),
            )

        return await self._shards.query(query)

    def _writers(self) -> dict[int, int | None]:
        """Partition -> pid of the projector applying the shard (this process, for its own reader)."""
        root = self._shards.root
        if root is None:
            return {p: os.getpid() for p in sorted(self._shards.held)}
        paths = shard_paths(root)
        return {p: shard_writer(paths[p]) if p in paths else None for p in sorted(self._shards.held)}
