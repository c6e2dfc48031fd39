"""`ShardSet`: the shards one projector holds, and how they come and go.

A projector (or a group member) holds the shards of the partitions it owns. Assigning a
partition opens its shard, restores it from a checkpoint when this host has none, or creates
it; revoking one flushes and closes it. Every shard is checked against the topics and options
it must have been built from before a record is applied to it (decision 0016). Batches and
checkpoints take `lock`, so a shard is never closed or copied in the middle of a batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from stepstream.errors import ProjectionInUse, ProjectionMismatch
from stepstream.settings import Settings, check_count
from stepstream.storage._checkpoints import Checkpoints
from stepstream.storage._retention import MEDIA_INDEX_VERSION
from stepstream.storage._rocks import Shard, read_projection_identity, shard_path, shard_paths
from stepstream.storage._state import RUN_INDEX_VERSION, Identity
from stepstream.topics import TopicLayout

if TYPE_CHECKING:
    from stepstream.erasure import KeyRing
    from stepstream.media import MediaStore

log = logging.getLogger('stepstream.projector')

SHARD_HANDOFF_TIMEOUT_S = 30.0
"""How long a member waits for a shard's previous owner (same directory) to close it."""


@dataclass(frozen=True, slots=True)
class LiveShards:
    """The shards a projector holds open and writes, as a reader in its process reads them.

    `ProjectionReader.of(projector)` reads through it: the shards as they come and go, the topics'
    partition count, and what opens the content they hold (`media_store`, `keys` with erasure on).
    """

    view: Mapping[int, Shard]
    """The open shards, always current (`ShardSet.view`)."""
    partitions: int
    """The topics' partition count (the highest open partition's number + 1 before the topics are known)."""
    media_store: MediaStore | None
    keys: KeyRing | None
    stale_after_s: float
    """A `running` run with no record for this long reads `stale` (`settings.liveness.stale_after_s`)."""
    scope: Callable[[], Collection[int] | None] | None
    """A group member that serves: the partitions it owns at each query; None: every one open."""


class ShardSet:
    """The open shards of one projection directory, by partition number.

    ```python
    shards = ShardSet(root, settings)
    shard = await shards.assign(0, layout)  # open, restore or create; identity checked
    ...
    shards.revoke(0)  # flushed and closed
    ```
    """

    def __init__(
        self,
        root: Path,
        settings: Settings,
        *,
        group: str | None = None,
        rebuilding: bool = False,
        max_snapshots_per_run: int | None = None,
        checkpoints: Checkpoints | None = None,
    ) -> None:
        """Shards under `root` (checked by the caller); nothing is opened yet.

        In a `group`, a shard still held by its previous owner in this directory is waited for
        (up to `SHARD_HANDOFF_TIMEOUT_S`); `checkpoints` restores shards this host lacks. A new
        shard is `rebuilding` when `rebuilding`, else `live`.
        """
        check_count(max_snapshots_per_run, 'max_snapshots_per_run', optional=True)
        self.root = root
        self.settings = settings
        self.group = group
        self.rebuilding = rebuilding
        self.max_snapshots_per_run = max_snapshots_per_run
        self.retain_ended_us = settings.projection.retain_ended_us
        """The retention policy (`settings.projection.retain_ended_days`): asked for, or the shards'."""
        self.checkpoints = checkpoints
        self.lock = asyncio.Lock()
        """Held by a batch while it applies, by an assignment change, and by a checkpoint's copy."""
        self.identity: Identity | None = None
        """The identity of the shards (the last one opened or checked)."""
        self.restored_from_checkpoint: dict[int, int] = {}
        """Partition -> records the shard's restored checkpoint held, for shards restored so far."""
        self._shards: dict[int, Shard] = {}
        self.view: Mapping[int, Shard] = MappingProxyType(self._shards)
        """The open shards, always current (what a same-process reader reads)."""

    @property
    def partitions(self) -> list[int]:
        """The partition numbers whose shards are open."""
        return sorted(self._shards)

    def get(self, partition: int) -> Shard | None:
        """The open shard of `partition`, or None."""
        return self._shards.get(partition)

    def __getitem__(self, partition: int) -> Shard:
        return self._shards[partition]

    def __contains__(self, partition: object) -> bool:
        return partition in self._shards

    def open_existing(self, only: Collection[int] | None = None) -> list[Shard]:
        """Open the shards present now (of `only`, if given), so a second writer is refused early."""
        opened = []
        for partition, path in shard_paths(self.root).items():
            if (only is None or partition in only) and partition not in self._shards:
                opened.append(self._adopt(Shard.open(path, partition=partition)))
        return opened

    async def assign(self, partition: int, layout: TopicLayout) -> Shard:
        """Open the shard of `partition`, restoring it from a checkpoint or making it new."""
        path = shard_path(self.root, partition)
        if not (path / 'CURRENT').exists() and self.checkpoints is not None:
            restored = await self.checkpoints.restore(self.root, partition, layout.partitions)
            if restored is not None:
                self.restored_from_checkpoint[partition] = restored
        if (path / 'CURRENT').exists():
            shard = self._adopt(await self._open_when_free(path, partition))
            self.claim(shard, layout)
            return shard
        identity = Identity(
            format=Identity.FORMAT,
            topic_prefix=self.settings.topics.topic_prefix,
            cluster=layout.cluster,
            max_snapshots_per_run=self._options_from_shards(),
            retain_ended_us=self.retain_ended_us,
            state='rebuilding' if self.rebuilding else 'live',
            partitions=layout.partitions,
            partition=partition,
            media_index=MEDIA_INDEX_VERSION,
            run_index=RUN_INDEX_VERSION,
        )
        shard = self._adopt(await asyncio.to_thread(Shard.create, self.root, partition, identity))
        if self.identity is None:
            self.identity = identity
        return shard

    async def _open_when_free(self, path: Path, partition: int) -> Shard:
        """Open a shard for writing; in a group, wait a while for its previous owner to let go."""
        deadline = time.monotonic() + (SHARD_HANDOFF_TIMEOUT_S if self.group is not None else 0)
        while True:
            try:
                return await asyncio.to_thread(Shard.open, path, partition=partition)
            except ProjectionInUse:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)

    def _options_from_shards(self) -> int | None:
        """`max_snapshots_per_run` for a new shard: the one asked for, or the existing shards'."""
        if self.max_snapshots_per_run is None:
            existing = read_projection_identity(self.root)
            if existing is not None:
                self.max_snapshots_per_run = existing.max_snapshots_per_run
        if self.retain_ended_us is None:
            existing = read_projection_identity(self.root)
            if existing is not None:
                self.retain_ended_us = existing.retain_ended_us
        return self.max_snapshots_per_run

    def _adopt(self, shard: Shard) -> Shard:
        self._shards[shard.partition] = shard
        if self.identity is None:
            self.identity = shard.identity()
        return shard

    def revoke(self, partition: int) -> None:
        """Flush and close the shard of `partition` (it moves to another member)."""
        shard = self._shards.pop(partition, None)
        if shard is not None:
            shard.flush()
            shard.close()

    def claim(self, shard: Shard, layout: TopicLayout) -> None:
        """Check a shard was built from these topics and options, or refuse it."""
        stored = shard.identity()
        where = shard.path
        if stored is None or stored.format != Identity.FORMAT:
            found = 'no identity record' if stored is None else f'format {stored.format}'
            raise ProjectionMismatch(
                f'{where} holds a projection made by another stepstream version ({found}); this one reads '
                f'format {Identity.FORMAT}. Rebuild it with `stepstream rebuild --into NEW_DIR`'
            )
        if stored.topic_prefix != self.settings.topics.topic_prefix:
            raise ProjectionMismatch(
                f'{self.root} was built from the topics {stored.topic_prefix}.*, '
                f'not {self.settings.topics.topic_prefix}.*: set STEPSTREAM_TOPIC_PREFIX (--topic-prefix) '
                'to match, or use another --db-path'
            )
        if stored.cluster != layout.cluster:
            raise ProjectionMismatch(
                f'{self.root} was built from Kafka cluster {stored.cluster!r}, '
                f'but {self.settings.kafka.bootstrap_servers} is cluster {layout.cluster!r}: point '
                'STEPSTREAM_BOOTSTRAP_SERVERS at the cluster it was built from, or use another --db-path'
            )
        if stored.partitions != layout.partitions or stored.partition != shard.partition:
            raise ProjectionMismatch(
                f'{where} is shard {stored.partition} of {stored.partitions} partitions, but the topics '
                f'now have {layout.partitions}: runs moved between partitions, so rebuild the projection '
                'with `stepstream rebuild --into NEW_DIR`'
            )
        wanted = self.max_snapshots_per_run
        if wanted is not None and wanted != stored.max_snapshots_per_run:
            raise ProjectionMismatch(
                f'{self.root} was built with '
                f'max_snapshots_per_run={stored.max_snapshots_per_run}, not {wanted}: '
                'leave the option out (it is kept), or rebuild into a new directory with the new value'
            )
        self.max_snapshots_per_run = stored.max_snapshots_per_run
        retain = self.retain_ended_us
        if retain is not None and retain != stored.retain_ended_us:
            kept = (
                'every run'
                if stored.retain_ended_us is None
                else f'{stored.retain_ended_us / 86_400_000_000:g} days'
            )
            raise ProjectionMismatch(
                f'{self.root} was built with the retention policy {kept}, not '
                f'{retain / 86_400_000_000:g} days (STEPSTREAM_RETAIN_ENDED_DAYS): a policy holds from '
                'offset zero, so rebuild into a new directory with the new one (`stepstream rebuild '
                '--into NEW_DIR`, docs/retention.md), or leave the setting out (the built one is kept)'
            )
        self.retain_ended_us = stored.retain_ended_us
        if stored.state == 'rebuilding' and not self.rebuilding:
            stored.state = 'live'  # a live projector carries an interrupted rebuild on to the end
            shard.write_identity(stored)
        self.identity = stored

    def mark_rebuilt(self) -> None:
        """Record that a rebuild reached the end it was after: its shards are complete."""
        for shard in self._shards.values():
            identity = shard.identity()
            if identity is not None:
                identity.state = 'rebuilt'
                shard.write_identity(identity)
                self.identity = identity

    def flush(self) -> None:
        """Flush every open shard."""
        for shard in self._shards.values():
            shard.flush()

    def close(self) -> None:
        """Flush and close every open shard."""
        for partition in list(self._shards):
            self.revoke(partition)
