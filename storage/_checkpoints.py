"""Shard checkpoints in S3: how a group member hands a shard over without a replay from zero.

A member checkpoints each shard it owns every `interval_s` (when the shard moved on since the
last one): RocksDB makes a consistent copy between two batches, and its files go to the stack's
bucket under `_checkpoints/{topic_prefix}/{group}/{partition:04d}/`:

- `files/{sha256}`: each file, content-addressed. RocksDB never changes an SST file once
  written, so a checkpoint uploads only the files the earlier ones lack (the few MB a shard
  gained since), not the whole shard.
- `{records:020d}-{sha256}.json`: the manifest, naming each file and its hash; `records` is the
  shard's offsets of both topics added up, so names sort oldest to newest, and the hash in the
  name checks the manifest's bytes.

The newest `keep` manifests are kept, and the files no kept manifest names are deleted. A member
assigned a shard it does not hold restores the newest checkpoint whose manifest and files all
download and match their hashes and that opens as that partition's shard, then catches up from
the offsets inside it; failing that it tries the next older, and with none usable it builds the
shard from offset zero. The projection is a function of the log, so any checkpoint, however
old, is a correct start.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import obstore
from obstore.exceptions import BaseError as ObstoreError

from stepstream.media import S3MediaStore
from stepstream.storage._rocks import PID_FILE, Shard, shard_path
from stepstream.storage._state import Identity, dumps

if TYPE_CHECKING:
    from stepstream.settings import Settings

log = logging.getLogger('stepstream.projector.checkpoints')

_SAFE_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]{0,127}')
"""A RocksDB file name: no path separators, no `..`."""
_SHA256 = re.compile(r'[0-9a-f]{64}')


class HeldShards(Protocol):
    """The shards a process holds (a `ShardSet`), and the lock that keeps batches off them."""

    @property
    def lock(self) -> asyncio.Lock:
        """Held while a batch applies: a checkpoint copies a shard between two batches."""
        ...

    @property
    def partitions(self) -> list[int]:
        """The partitions whose shards are held."""
        ...

    def get(self, partition: int) -> Shard | None:
        """The held shard of `partition`, or None (revoked meanwhile)."""
        ...


@dataclass(frozen=True, slots=True)
class CheckpointObject:
    """One uploaded checkpoint: its key, the records it holds and the hash of its bytes."""

    key: str
    records: int
    sha256: str
    """Of the manifest."""
    uploaded_bytes: int = 0
    """The bytes of files this checkpoint had to upload (the ones earlier checkpoints lacked)."""


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
        self.outcomes = {'uploaded': 0, 'failed': 0}
        """Checkpoints uploaded and uploads failed, by this process (`/metrics`)."""
        self.current_at: dict[int, float] = {}
        """Partition -> monotonic time a round last found its checkpoint current (uploaded or unchanged)."""
        self._present: dict[int, set[str]] = {}
        """Partition -> hashes of the files in the bucket (listed once, then kept up to date)."""
        self._hashes: dict[tuple[int, str, int, int, int], str] = {}
        """(partition, SST file name, inode, size, mtime) -> sha256: SST files never change."""

    @classmethod
    def from_settings(cls, settings: Settings, *, group: str, interval_s: float = 60.0) -> Checkpoints:
        """Checkpoints in the bucket the `STEPSTREAM_S3_*` settings name."""
        return cls(
            S3MediaStore.from_settings(settings.media),
            topic_prefix=settings.topics.topic_prefix,
            group=group,
            interval_s=interval_s,
        )

    def _dir(self, partition: int) -> str:
        return f'{self.prefix}/{partition:04d}/'

    # -- upload --------------------------------------------------------------------------------

    async def maybe_upload(self, shards: HeldShards) -> None:
        """Upload every held shard that moved on, if `interval_s` passed since the last round."""
        if time.monotonic() - self._last_upload < self.interval_s:
            return
        self._last_upload = time.monotonic()
        await self.upload_all(shards)

    async def upload_all(self, shards: HeldShards) -> list[CheckpointObject]:
        """Checkpoint and upload each held shard whose offsets moved on (`projector.shards`)."""
        done = []
        for partition in shards.partitions:
            try:
                uploaded = await self.upload(shards, partition)
            except (ObstoreError, OSError) as exc:  # a missed checkpoint only costs a longer catch-up
                self.outcomes['failed'] += 1
                log.warning(
                    'checkpoint of shard %d not uploaded to %s: %r', partition, self.store.location, exc
                )
                continue
            if uploaded is not None:
                done.append(uploaded)
        return done

    async def upload(self, shards: HeldShards, partition: int) -> CheckpointObject | None:
        """Checkpoint one shard between two batches and upload what is new; None when unchanged."""
        with tempfile.TemporaryDirectory(prefix='stepstream-checkpoint-') as scratch:
            where = Path(scratch) / 'shard'
            async with shards.lock:
                shard = shards.get(partition)
                if shard is None:
                    return None  # revoked meanwhile
                records = sum(shard.offsets().values())
                if records == 0 or self._uploaded.get(partition) == records:
                    self.current_at[partition] = time.monotonic()
                    return None
                await asyncio.to_thread(shard.checkpoint, where)
            hashes = await asyncio.to_thread(self._hash_files, partition, where)
            present = await self._present_files(partition)
            sent = 0
            for name, digest in sorted(hashes.items()):
                if digest not in present:
                    data = await asyncio.to_thread((where / name).read_bytes)
                    await obstore.put_async(
                        self.store.object_store, f'{self._dir(partition)}files/{digest}', data
                    )
                    present.add(digest)
                    sent += len(data)
        manifest = dumps({'records': records, 'files': hashes})
        digest = hashlib.sha256(manifest).hexdigest()
        key = f'{self._dir(partition)}{records:020d}-{digest}.json'
        await obstore.put_async(self.store.object_store, key, manifest)
        self._uploaded[partition] = records
        self.outcomes['uploaded'] += 1
        self.current_at[partition] = time.monotonic()
        await self._prune(partition)
        log.info('checkpoint of shard %d at %d records: %d new bytes', partition, records, sent)
        return CheckpointObject(key, records, digest, sent)

    def _hash_files(self, partition: int, directory: Path) -> dict[str, str]:
        """Name -> sha256 of each checkpoint file; an SST file is hashed once per process.

        A checkpoint hard-links the shard's SST files, so one file keeps its inode from one
        checkpoint to the next.
        """
        hashes = {}
        for path in sorted(directory.iterdir()):
            stat = path.stat()
            identity = (partition, path.name, stat.st_ino, stat.st_size, stat.st_mtime_ns)
            known = self._hashes.get(identity) if path.suffix == '.sst' else None
            if known is None:
                with path.open('rb') as file:
                    known = hashlib.file_digest(file, 'sha256').hexdigest()
                if path.suffix == '.sst':
                    self._hashes[identity] = known
            hashes[path.name] = known
        return hashes

    async def _present_files(self, partition: int) -> set[str]:
        if partition not in self._present:
            self._present[partition] = {
                meta['path'].rsplit('/', 1)[-1]
                async for meta in self._objects(f'{self._dir(partition)}files/')
            }
        return self._present[partition]

    async def _objects(self, prefix: str) -> AsyncIterator[Any]:
        async for chunk in obstore.list(self.store.object_store, prefix=prefix):
            for meta in chunk:
                yield meta

    async def _prune(self, partition: int) -> None:
        """Delete manifests older than the newest `keep`, then files no kept manifest names."""
        manifests = await self.list(partition)
        for old in manifests[: -self.keep]:
            await obstore.delete_async(self.store.object_store, old.key)
        if len(manifests) <= self.keep:
            return
        kept: set[str] = set()
        for manifest in manifests[-self.keep :]:
            try:
                kept.update((await self._manifest(manifest))['files'].values())
            except (ObstoreError, ValueError):
                return  # cannot tell what is in use: delete nothing
        present = self._present.get(partition, set())
        async for meta in self._objects(f'{self._dir(partition)}files/'):
            if meta['path'].rsplit('/', 1)[-1] not in kept:
                await obstore.delete_async(self.store.object_store, meta['path'])
                present.discard(meta['path'].rsplit('/', 1)[-1])

    async def list(self, partition: int) -> list[CheckpointObject]:
        """The checkpoints (manifests) of one partition in the bucket, oldest first."""
        found = []
        async for meta in self._objects(self._dir(partition)):
            rest = meta['path'][len(self._dir(partition)) :]
            stem, _, ext = rest.partition('.')
            records, dash, digest = stem.partition('-')
            if ext == 'json' and dash and records.isdigit() and len(digest) == 64:
                found.append(CheckpointObject(meta['path'], int(records), digest))
        return sorted(found, key=lambda c: (c.records, c.key))

    async def _get(self, key: str) -> bytes:
        result = await obstore.get_async(self.store.object_store, key)
        return bytes(await result.bytes_async())

    async def _manifest(self, checkpoint: CheckpointObject) -> dict[str, Any]:
        raw = await self._get(checkpoint.key)
        if hashlib.sha256(raw).hexdigest() != checkpoint.sha256:
            raise ValueError('the manifest does not match the hash in its name')
        manifest = json.loads(raw)
        files = manifest.get('files') if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or manifest.get('records') != checkpoint.records:
            raise ValueError('the manifest is malformed')
        for name, digest in files.items():
            if not _SAFE_NAME.fullmatch(name) or not isinstance(digest, str) or not _SHA256.fullmatch(digest):
                raise ValueError(f'the manifest names an unexpected file {name!r}')
        return manifest

    # -- restore -------------------------------------------------------------------------------

    async def restore(self, root: Path, partition: int, partitions: int) -> int | None:
        """Put the newest usable checkpoint of `partition` in place as its shard under `root`.

        Returns the records it holds, or None when no checkpoint could be used (the shard is
        then built from offset zero). A checkpoint whose manifest or files fail to download or
        match their hashes, or that does not open as this partition's shard, is skipped with a
        warning, and the next older one is tried.
        """
        try:
            candidates = await self.list(partition)
        except (ObstoreError, OSError) as exc:
            log.warning(
                'no checkpoints of shard %d readable from %s: %r', partition, self.store.location, exc
            )
            return None
        for candidate in reversed(candidates):
            staging = root / f'.restore-shard-{partition:04d}-{os.getpid()}'
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            try:
                manifest = await self._manifest(candidate)
                for name, digest in manifest['files'].items():
                    data = await self._get(f'{self._dir(partition)}files/{digest}')
                    if hashlib.sha256(data).hexdigest() != digest:
                        raise ValueError(f'{name} does not match its hash')
                    await asyncio.to_thread((staging / name).write_bytes, data)
                await asyncio.to_thread(_check_and_place, staging, candidate, root, partition, partitions)
            except (ObstoreError, OSError, ValueError) as exc:
                log.warning('checkpoint %s not usable, trying an older one: %s', candidate.key, exc)
                continue
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            log.info('shard %d restored from checkpoint at %d records', partition, candidate.records)
            return candidate.records
        return None


def _check_and_place(
    staging: Path, candidate: CheckpointObject, root: Path, partition: int, partitions: int
) -> None:
    """Open a downloaded checkpoint as the expected shard, then rename it into place."""
    try:
        shard = Shard.open(staging)
    except Exception as exc:  # rocksdict raises a bare Exception carrying RocksDB's status text
        raise ValueError(f'RocksDB cannot open it: {exc}') from None
    try:
        identity = shard.identity()
        records = sum(shard.offsets().values())
    finally:
        shard.close()
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
