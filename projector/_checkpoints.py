"""Shard checkpoints in S3: how a group member hands a shard over without a replay from zero.

A member uploads a RocksDB checkpoint of each shard it owns every `interval_s` (when the shard
moved on since the last one) to the stack's bucket, as one tar object at
`_checkpoints/{topic_prefix}/{group}/{partition:04d}/{records:020d}-{sha256}.tar`, where
`records` is the shard's offsets of both topics added up, so names sort oldest to newest and the
hash in the name checks the bytes. The newest `keep` are kept. A member assigned a shard it does
not hold restores the newest checkpoint that downloads, hashes, unpacks and opens as that shard,
then catches up from the offsets inside it; with none usable it builds the shard from offset
zero. A checkpoint is a consistent state of one shard (RocksDB makes it between two batches), and
the projection is a function of the log, so any checkpoint, however old, is a correct start.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import obstore
from obstore.exceptions import BaseError as ObstoreError
from rocksdict import Checkpoint

from stepstream.media import S3MediaStore
from stepstream.projector._state import Identity
from stepstream.projector._store import PID_FILE, open_db, read_identity, shard_path, stored_offsets

if TYPE_CHECKING:
    from stepstream.projector._projector import Projector
    from stepstream.settings import Settings

log = logging.getLogger('stepstream.projector.checkpoints')


@dataclass(frozen=True, slots=True)
class CheckpointObject:
    """One uploaded checkpoint: its key, the records it holds and the hash of its bytes."""

    key: str
    records: int
    sha256: str


class Checkpoints:
    """Uploads and restores shard checkpoints for the members of one consumer group."""

    def __init__(
        self, store: S3MediaStore, *, topic_prefix: str, group: str, interval_s: float = 60.0, keep: int = 2
    ) -> None:
        """Checkpoints of `group`'s shards in `store`'s bucket, every `interval_s`, newest `keep` kept."""
        if keep < 1:
            raise ValueError(f'keep must be at least 1, got {keep}')
        self.store = store
        self.prefix = f'_checkpoints/{topic_prefix}/{group}'
        self.interval_s = interval_s
        self.keep = keep
        self._last_upload = time.monotonic()
        self._uploaded: dict[int, int] = {}
        """Partition -> records of its last checkpoint uploaded by this process."""

    @classmethod
    def from_settings(cls, settings: Settings, *, group: str, interval_s: float = 60.0) -> Checkpoints:
        """Checkpoints in the bucket the `STEPSTREAM_S3_*` settings name."""
        return cls(
            S3MediaStore.from_settings(settings),
            topic_prefix=settings.topic_prefix,
            group=group,
            interval_s=interval_s,
        )

    def _dir(self, partition: int) -> str:
        return f'{self.prefix}/{partition:04d}/'

    # -- upload --------------------------------------------------------------------------------

    async def maybe_upload(self, projector: Projector) -> None:
        """Upload every owned shard that moved on, if `interval_s` passed since the last round."""
        if time.monotonic() - self._last_upload < self.interval_s:
            return
        self._last_upload = time.monotonic()
        await self.upload_all(projector)

    async def upload_all(self, projector: Projector) -> list[CheckpointObject]:
        """Checkpoint and upload each shard the projector holds whose offsets moved on."""
        done = []
        for partition in projector.partitions:
            try:
                uploaded = await self.upload(projector, partition)
            except (ObstoreError, OSError) as exc:  # a missed checkpoint only costs a longer catch-up
                log.warning(
                    'checkpoint of shard %d not uploaded to %s: %r', partition, self.store.location, exc
                )
                continue
            if uploaded is not None:
                done.append(uploaded)
        return done

    async def upload(self, projector: Projector, partition: int) -> CheckpointObject | None:
        """Checkpoint one shard between two batches and upload it; None when nothing changed."""
        with tempfile.TemporaryDirectory(prefix='stepstream-checkpoint-') as scratch:
            where = Path(scratch) / 'shard'
            async with projector._batch_lock:
                shard = projector._shards.get(partition)
                if shard is None:
                    return None  # revoked meanwhile
                records = sum(stored_offsets(shard.db).values())
                if records == 0 or self._uploaded.get(partition) == records:
                    return None
                await asyncio.to_thread(Checkpoint(shard.db).create_checkpoint, str(where))
            data, digest = await asyncio.to_thread(_pack, where)
        key = f'{self._dir(partition)}{records:020d}-{digest}.tar'
        await obstore.put_async(self.store.object_store, key, data)
        self._uploaded[partition] = records
        await self._prune(partition)
        log.info('checkpoint of shard %d at %d records uploaded (%d bytes)', partition, records, len(data))
        return CheckpointObject(key, records, digest)

    async def _prune(self, partition: int) -> None:
        for old in (await self.list(partition))[: -self.keep]:
            await obstore.delete_async(self.store.object_store, old.key)

    async def list(self, partition: int) -> list[CheckpointObject]:
        """The checkpoints of one partition in the bucket, oldest first."""
        found = []
        stream = obstore.list(self.store.object_store, prefix=self._dir(partition))
        async for chunk in stream:
            for meta in chunk:
                name = meta['path'].rsplit('/', 1)[-1]
                stem, _, ext = name.partition('.')
                records, dash, digest = stem.partition('-')
                if ext == 'tar' and dash and records.isdigit() and len(digest) == 64:
                    found.append(CheckpointObject(meta['path'], int(records), digest))
        return sorted(found, key=lambda c: (c.records, c.key))

    # -- restore -------------------------------------------------------------------------------

    async def restore(self, root: Path, partition: int, partitions: int) -> int | None:
        """Put the newest usable checkpoint of `partition` in place as its shard under `root`.

        Returns the records it holds, or None when no checkpoint could be used (the shard is
        then built from offset zero). A checkpoint that fails to download, hash, unpack or open
        as this partition's shard is skipped with a warning, and the next older one is tried.
        """
        try:
            candidates = await self.list(partition)
        except (ObstoreError, OSError) as exc:
            log.warning(
                'no checkpoints of shard %d readable from %s: %r', partition, self.store.location, exc
            )
            return None
        for candidate in reversed(candidates):
            try:
                result = await obstore.get_async(self.store.object_store, candidate.key)
                data = bytes(await result.bytes_async())
                await asyncio.to_thread(_unpack_into, data, candidate, root, partition, partitions)
            except (ObstoreError, OSError, ValueError, tarfile.TarError) as exc:
                log.warning('checkpoint %s not usable, trying an older one: %s', candidate.key, exc)
                continue
            log.info('shard %d restored from checkpoint at %d records', partition, candidate.records)
            return candidate.records
        return None


def _pack(directory: Path) -> tuple[bytes, str]:
    """The checkpoint directory as an uncompressed tar (SST files are compressed already)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode='w') as tar:
        for path in sorted(directory.iterdir()):
            tar.add(path, arcname=path.name, recursive=False)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def _unpack_into(
    data: bytes, candidate: CheckpointObject, root: Path, partition: int, partitions: int
) -> None:
    """Check and unpack a checkpoint, open it as the expected shard, then rename it into place."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != candidate.sha256:
        raise ValueError(f'its bytes hash to {digest[:12]}..., its name says {candidate.sha256[:12]}...')
    staging = root / f'.restore-shard-{partition:04d}-{os.getpid()}'
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode='r') as tar:
            for member in tar.getmembers():
                if not member.isfile() or '/' in member.name or member.name in ('', '.', '..'):
                    raise ValueError(f'unexpected entry {member.name!r}')
            tar.extractall(staging, filter='data')
        db = open_db(staging, create=False)
        try:
            identity = read_identity(db)
            records = sum(stored_offsets(db).values())
        finally:
            db.close()
        (staging / PID_FILE).unlink(missing_ok=True)
        if identity is None or identity.format != Identity.FORMAT:
            raise ValueError('it is not a shard of this stepstream version')
        if identity.partition != partition or identity.partitions != partitions:
            raise ValueError(
                f'it is shard {identity.partition} of {identity.partitions}, not {partition} of {partitions}'
            )
        if records != candidate.records:
            raise ValueError(f'it holds {records} records, its name says {candidate.records}')
        os.rename(staging, shard_path(root, partition))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
