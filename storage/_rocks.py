"""The RocksDB shard: one partition's store on disk, and the projection directory that holds them.

A projection is a directory holding one shard per partition number (`shard-0000`, ...), each a
RocksDB store with every view of the runs of that partition and the partition's offsets of both
topics (docs/decisions/0016-partitioned-projection.md, 0029-shard-type.md). This module owns the
files: nothing else opens a RocksDB handle. A shard's reads and transactions are `_transaction`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from rocksdict import AccessType, Checkpoint, Options, Rdict, ReadOptions, WriteBatch, WriteOptions

from stepstream.errors import ProjectionInUse, ProjectionMismatch, UsageError
from stepstream.storage._keys import IDENTITY, prefix_end
from stepstream.storage._reads import ShardReads
from stepstream.storage._state import Identity, _Json
from stepstream.storage._transaction import ShardTransaction

PID_FILE = 'stepstream-projector.pid'
"""Written by the process holding a shard open for writing, to name it in errors."""

SHARD_NAME = re.compile(r'shard-(\d{4,})')
"""A shard's directory name: `shard-` and its partition number, four digits at least."""


# -- the projection directory and its RocksDB shards ---------------------------------------------


def shard_path(root: Path, partition: int) -> Path:
    """Where the shard of `partition` lives under a projection directory."""
    return root / f'shard-{partition:04d}'


def shard_paths(root: Path) -> dict[int, Path]:
    """The shards present under a projection directory, by partition number."""
    found = {}
    if root.is_dir():
        for child in root.iterdir():
            match = SHARD_NAME.fullmatch(child.name)
            if match and (child / 'CURRENT').exists():
                found[int(match.group(1))] = child
    return dict(sorted(found.items()))


def check_projection(path: str | Path, *, create: bool) -> Path:
    """Refuse a path that is not a projection directory before anything is written to it.

    With `create`, a missing or empty directory is fine (it becomes a projection); otherwise a
    projection must be there already. Names starting with `.` (a restore in progress) are ignored.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UsageError(f'{target} is a file, not a projection directory: give --db-path a directory')
    if (target / 'CURRENT').exists():
        raise ProjectionMismatch(
            f'{target} is a projection of format 2 (one RocksDB for every partition); this stepstream '
            'keeps one shard per partition. Rebuild it with `stepstream rebuild --into NEW_DIR`'
        )
    entries = [c for c in target.iterdir() if not c.name.startswith('.')] if target.is_dir() else []
    if any(not SHARD_NAME.fullmatch(c.name) for c in entries):
        raise UsageError(
            f'{target} is not empty and is not a projection; refusing to write into it. '
            'Give --db-path a new or empty directory'
        )
    if not entries and not create:
        raise UsageError(f'no projection at {target}: run `stepstream projector --db-path {target}` first')
    return target


def _check_directory(path: Path, *, create: bool) -> Path:
    """Refuse a shard path that is not a RocksDB store (or, with `create`, a new or empty one)."""
    if path.exists() and not path.is_dir():
        raise UsageError(f'{path} is a file, not a projection directory: give --db-path a directory')
    has_files = path.is_dir() and any(path.iterdir())
    if has_files and not (path / 'CURRENT').exists():
        raise UsageError(f'{path} is not empty and is not a projection shard; refusing to write into it')
    if not has_files and not create:
        raise UsageError(f'no projection at {path}: run `stepstream projector --db-path {path}` first')
    return path


_DELETES_WINDOW = 1024
_DELETES_TRIGGER = 512
"""A shard's file is compacted soon when half of some 1,024 consecutive entries are deletes."""


class Shard(ShardReads):
    """One partition's RocksDB: every view of its runs and its offsets, changed by transactions.

    ```python
    shard = Shard.open(shard_path(root, 0))
    txn = shard.begin()
    ...  # the applier stages a batch
    txn.commit()  # views and offsets in one WriteBatch
    ```

    Open for writing (one process at a time: RocksDB's lock, `ProjectionInUse` names the
    holder) or read-only as a secondary instance that `catch_up` brings up to its writer.
    """

    def __init__(self, db: Rdict, path: Path, *, partition: int = 0, read_only: bool = False) -> None:
        """Wrap an open handle; use `open`, `create` or `open_read_only` instead."""
        self._db = db
        self.path = path
        self.partition = partition
        self.read_only = read_only
        # In raw mode RocksDB gives bytes or None: its `get` is the point read, as it is.
        self.lookup: Callable[[bytes], bytes | None] = db.get

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, *, create: bool = False, partition: int | None = None) -> Shard:
        """Open a shard for writing (creating an empty store when `create`), holding RocksDB's lock.

        A second writer gets `ProjectionInUse` naming the process that holds it. The partition
        is the identity's, when there is one.
        """
        target = _check_directory(Path(path), create=create)
        # Runs, prompts and tool inputs: readable by their owner only (the projection and its shards).
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        target.mkdir(mode=0o700, exist_ok=True)
        options = Options(raw_mode=True)
        options.create_if_missing(create)
        # An index of what is not over yet (`STATUS` running, `UNRESOLVED`) is put and deleted for
        # every run: its range fills with tombstones, which a walk of it skips one by one until a
        # compaction drops them. A file with a dense run of deletes is compacted soon instead.
        options.add_compact_on_deletion_collector_factory(_DELETES_WINDOW, _DELETES_TRIGGER, 0.0)
        try:
            db = Rdict(str(target), options)
        except Exception as exc:  # rocksdict raises a bare Exception carrying RocksDB's status text
            if 'lock' in str(exc).lower():
                holder = _read_pid(target)
                who = f'pid {holder}' if holder else 'another process'
                raise ProjectionInUse(
                    f'{target} is in use by another projector ({who}); stop it, or give this one its own '
                    '--db-path. Readers can open it at the same time with `ProjectionReader.open`'
                ) from None
            raise
        with contextlib.suppress(OSError):
            (target / PID_FILE).write_text(f'{os.getpid()}\n')
        shard = cls(db, target)
        identity = shard.identity()
        if partition is not None:
            shard.partition = partition
        elif identity is not None:
            shard.partition = identity.partition
        return shard

    @classmethod
    def create(cls, root: Path, partition: int, identity: Identity) -> Shard:
        """Make the shard of `partition` with its identity under `root`, then open it for writing.

        It is built in a hidden directory and renamed into place, so a crash never leaves a
        half-made shard where a projector or reader would trip over it.
        """
        final = shard_path(root, partition)
        staging = root / f'.new-{final.name}-{os.getpid()}'
        if staging.exists():
            shutil.rmtree(staging)
        shard = cls.open(staging, create=True, partition=partition)
        try:
            shard.write_identity(identity)
        finally:
            shard.close()
        (staging / PID_FILE).unlink(missing_ok=True)
        os.rename(staging, final)
        return cls.open(final, partition=partition)

    @classmethod
    def open_read_only(cls, path: str | Path, scratch: str | Path) -> Shard:
        """Open a shard read-only as a secondary instance (`catch_up` follows its writer)."""
        target = _check_directory(Path(path), create=False)
        options = Options(raw_mode=True)
        options.set_max_open_files(-1)
        db = Rdict(str(target), options, access_type=AccessType.secondary(str(scratch)))
        shard = cls(db, target, read_only=True)
        shard.catch_up()
        identity = shard.identity()
        if identity is None or identity.format != Identity.FORMAT:
            shard.close()
            raise ProjectionMismatch(
                f'{target} is a RocksDB directory but not a stepstream projection shard of this version: '
                f'rebuild it with `stepstream rebuild --into NEW_DIR`'
            )
        shard.partition = identity.partition
        return shard

    # -- reads and writes -----------------------------------------------------------------------

    def get(self, k: bytes) -> bytes | None:
        """The value stored at `k`, or None."""
        return self.lookup(k)

    def scan(
        self, prefix: bytes, *, start: bytes | None = None, reverse: bool = False
    ) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with `prefix`, in key order (`reverse`: descending).

        `start` (a key under `prefix`) seeks there first: the walk begins at `start` or the first
        key past it in the walk's direction, so a page costs a seek and its own keys, not the keys
        before it.
        """
        top = prefix_end(prefix)
        if not reverse:
            # Bounded above, so a walk that ends its range stops there, not after every deleted
            # key past it. (Only the upper bound: rocksdict 0.3.29's lower-bound setter sets the
            # upper one, docs/decisions/0046-counts.md.)
            bounded = ReadOptions()
            if top is not None:
                bounded.set_iterate_upper_bound(top)
            for k, v in self._db.items(from_key=prefix if start is None else start, read_opt=bounded):
                if not isinstance(k, bytes) or not k.startswith(prefix):
                    break
                yield k, v
            return
        # Backwards, the range's smallest key (found forward) ends the walk: one more step back
        # would pass every deleted key below the range before it learned that the range ended.
        first = next(iter(self.scan(prefix)), None)
        if first is None or (start is not None and start < first[0]):
            return
        top = start if start is not None else top
        items = (
            self._db.items(backwards=True) if top is None else self._db.items(backwards=True, from_key=top)
        )
        for k, v in items:
            if not isinstance(k, bytes) or not k.startswith(prefix):
                if isinstance(k, bytes) and k > prefix:
                    continue  # the key the seek landed on, above the prefix's keys
                break
            yield k, v
            if k == first[0]:
                return

    def begin(self) -> ShardTransaction:
        """A transaction: stage a batch, then `commit` it with its offsets in one WriteBatch."""
        return ShardTransaction(self)

    def write(self, writes: Mapping[bytes, bytes | _Json | None], *, sync: bool) -> None:
        """Write `writes` (None deletes; state records serialized here) in one atomic `WriteBatch`."""
        batch = WriteBatch(raw_mode=True)
        put = batch.put
        for k, value in writes.items():
            if value is None:
                batch.delete(k)
            else:
                put(k, value.encode() if isinstance(value, _Json) else value)
        options = WriteOptions()
        options.sync = sync
        self._db.write(batch, options)

    def write_identity(self, identity: Identity) -> None:
        """Store the identity (synced: it is what later opens check against)."""
        self.write({IDENTITY: identity.encode()}, sync=True)

    def checkpoint(self, where: Path) -> None:
        """A consistent copy of the shard at `where` (hard links to its SST files), between batches."""
        Checkpoint(self._db).create_checkpoint(str(where))

    def catch_up(self) -> None:
        """A read-only shard: see what its writer wrote since (no-op for a writer's own)."""
        if self.read_only:
            self._db.try_catch_up_with_primary()

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) of the shard, in key order, bookkeeping included."""
        return self.scan(b'')

    def flush(self) -> None:
        """Flush the memtables to disk (before a hand-off)."""
        if not self.read_only:
            self._db.flush()

    def close(self) -> None:
        """Close the handle (and let go of the PID file a writer left)."""
        self._db.close()


def shard_writer(path: Path) -> int | None:
    """The pid of the process holding the shard's RocksDB lock (its projector), or None.

    Read from `/proc/locks` (the kernel's table of file locks) without touching the LOCK file:
    opening and closing it would drop the lock of a projector in this same process. Where that
    table is missing (not Linux), the pid file is trusted while its process lives.
    """
    pid = _read_pid(path)
    try:
        inode = (path / 'LOCK').stat().st_ino
        table = Path('/proc/locks').read_text()
    except OSError:
        if pid is None:
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        return pid
    for line in table.splitlines():
        fields = line.split()
        for i, item in enumerate(fields[1:], start=1):
            parts = item.split(':')
            if len(parts) == 3 and parts[2].isdigit() and int(parts[2]) == inode and fields[i - 1].isdigit():
                return int(fields[i - 1])
    return None


def _read_pid(path: Path) -> int | None:
    try:
        return int((path / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def read_identity_file(path: Path) -> Identity | None:
    """The identity of one shard at `path`, read without taking its lock (None if absent)."""
    with tempfile.TemporaryDirectory(prefix='stepstream-identity-') as scratch:
        db = Rdict(str(path), Options(raw_mode=True), access_type=AccessType.secondary(scratch))
        try:
            db.try_catch_up_with_primary()
            return Shard(db, path, read_only=True).identity()
        finally:
            db.close()


def read_projection_identity(root: str | Path) -> Identity | None:
    """The identity of a projection directory: its shards' options, and one state for them all.

    `rebuilding` while any shard is (or while a rebuild's shards are missing), `rebuilt` when
    every shard is, else `live`; None when there is no shard yet.
    """
    target = check_projection(root, create=True)
    identities = [i for i in map(read_identity_file, shard_paths(target).values()) if i is not None]
    if not identities:
        return None
    first = identities[0]
    state = combined_state({i.state for i in identities}, missing=len(identities) < first.partitions)
    return dataclasses.replace(first, state=state or 'live', partition=-1)


def combined_state(states: set[str], *, missing: bool) -> str | None:
    """One state for a set of shards (None without shards).

    `rebuilding` while any shard is (or while a rebuild's shards are missing), `rebuilt` when
    every shard is, `live` otherwise.
    """
    if not states:
        return None
    if 'rebuilding' in states or (missing and 'rebuilt' in states):
        return 'rebuilding'
    return 'rebuilt' if states == {'rebuilt'} else 'live'
