"""The projection's files: a directory of shards, opening them safely, and the batch transaction.

A projection is a directory holding one shard per partition number (`shard-0000`, ...), each a
RocksDB store with every view of the runs of that partition and the partition's offsets of both
topics (docs/decisions/0016-partitioned-projection.md). Keys come from `_keys` and state records
from `_state`; this module owns the files. Everything a batch changes in a shard, offsets
included, goes to RocksDB in one `WriteBatch`, so a crash leaves all of a batch or none of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

from aiokafka.structs import TopicPartition
from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from stepstream.errors import ProjectionInUse, ProjectionMismatch, UsageError
from stepstream.projector._keys import IDENTITY, OFFSET
from stepstream.projector._state import Identity, _Json

S = TypeVar('S', bound=_Json)

PID_FILE = 'stepstream-projector.pid'
"""Written by the process holding a projection open for writing, to name it in errors."""


SHARD_NAME = re.compile(r'shard-(\d{4,})')
"""A shard's directory name: `shard-` and its partition number, four digits at least."""


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


def check_directory(path: str | Path, *, create: bool) -> Path:
    """Refuse a shard path that is not a RocksDB store (or, with `create`, a new or empty one)."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UsageError(f'{target} is a file, not a projection directory: give --db-path a directory')
    has_files = target.is_dir() and any(target.iterdir())
    if has_files and not (target / 'CURRENT').exists():
        raise UsageError(f'{target} is not empty and is not a projection shard; refusing to write into it')
    if not has_files and not create:
        raise UsageError(f'no projection at {target}: run `stepstream projector --db-path {target}` first')
    return target


def open_db(path: str | Path, *, create: bool = True) -> Rdict:
    """Open a projection for writing (creating it when `create`), holding RocksDB's lock.

    A second writer gets `ProjectionInUse` naming the process that holds it.
    """
    target = check_directory(path, create=create)
    # Runs, prompts and tool inputs: readable by their owner only (the projection and its shards).
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    target.mkdir(mode=0o700, exist_ok=True)
    options = Options(raw_mode=True)
    options.create_if_missing(create)
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
    return db


def create_shard(root: Path, partition: int, identity: Identity) -> Rdict:
    """Make the shard of `partition` with its identity, then open it for writing.

    It is built in a hidden directory and renamed into place, so a crash never leaves a
    half-made shard where a projector or reader would trip over it.
    """
    final = shard_path(root, partition)
    staging = root / f'.new-{final.name}-{os.getpid()}'
    if staging.exists():
        import shutil

        shutil.rmtree(staging)
    db = open_db(staging)
    try:
        write_identity(db, identity)
    finally:
        db.close()
    (staging / PID_FILE).unlink(missing_ok=True)
    os.rename(staging, final)
    return open_db(final, create=False)


def open_secondary(path: str | Path, scratch: str | Path) -> Rdict:
    """Open one shard read-only as a secondary instance (catches up with its writer)."""
    target = check_directory(path, create=False)
    identity = read_identity_file(target)
    if identity is None or identity.format != Identity.FORMAT:
        raise ProjectionMismatch(
            f'{target} is a RocksDB directory but not a stepstream projection shard of this version: '
            f'rebuild it with `stepstream rebuild --into NEW_DIR`'
        )
    options = Options(raw_mode=True)
    options.set_max_open_files(-1)
    return Rdict(str(target), options, access_type=AccessType.secondary(str(scratch)))


def read_identity_file(path: Path) -> Identity | None:
    """The identity of one RocksDB store at `path`, read without taking its lock (None if absent)."""
    with tempfile.TemporaryDirectory(prefix='stepstream-identity-') as scratch:
        options = Options(raw_mode=True)
        db = Rdict(str(path), options, access_type=AccessType.secondary(scratch))
        try:
            db.try_catch_up_with_primary()
            return read_identity(db)
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


def read_identity(db: Rdict) -> Identity | None:
    """The identity stored in an open projection, or None (a projection not yet started)."""
    raw = db.get(IDENTITY)
    if not isinstance(raw, bytes):
        return None
    try:
        return Identity.decode(raw)
    except (TypeError, ValueError):
        return None


def write_identity(db: Rdict, identity: Identity) -> None:
    """Store the identity (synced: it is what later opens check against)."""
    options = WriteOptions()
    options.sync = True
    batch = WriteBatch(raw_mode=True)
    batch.put(IDENTITY, identity.encode())
    db.write(batch, options)


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


def scan(db: Rdict, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) whose key starts with `prefix`, in key order."""
    for k, v in db.items(from_key=prefix):
        if not isinstance(k, bytes) or not k.startswith(prefix):
            break
        yield k, v


def stored_offsets(db: Rdict) -> dict[TopicPartition, int]:
    """For each partition, the next offset the projection will apply."""
    stored = {}
    for k, v in scan(db, OFFSET.tag):
        topic, partition = OFFSET.parse(k)
        assert isinstance(topic, str) and isinstance(partition, int)
        stored[TopicPartition(topic, partition)] = int(v)
    return stored


class BatchTxn:
    """Staged writes of one consumed batch, readable before they are committed.

    Later records of a batch must see what earlier ones wrote (a run registered three records
    ago), so reads check the staged writes first, then RocksDB. State records are decoded once
    per batch and serialized once, at commit.
    """

    def __init__(self, db: Rdict) -> None:
        self.db = db
        self._writes: dict[bytes, bytes | _Json | None] = {}
        self._states: dict[bytes, _Json | None] = {}
        # Staged keys by keyspace tag, so `scan` does not walk every staged write.
        self._by_tag: dict[bytes, set[bytes]] = {}

    def get(self, k: bytes) -> bytes | None:
        """The staged value if any, else the stored one."""
        if k in self._writes:
            staged = self._writes[k]
            return staged.encode() if isinstance(staged, _Json) else staged
        value = self.db.get(k)
        return value if isinstance(value, bytes) else None

    def get_state(self, k: bytes, kind: type[S]) -> S | None:
        """A state record, decoded once per batch; change it and `put_state` it back."""
        if k in self._states:
            return self._states[k]  # type: ignore[return-value]
        raw = self.get(k)
        state = kind.decode(raw) if raw is not None else None
        self._states[k] = state
        return state

    def put(self, k: bytes, value: bytes) -> None:
        """Stage a write."""
        self._states.pop(k, None)
        self._stage(k, value)

    def put_state(self, k: bytes, state: _Json) -> None:
        """Stage a state record; it is serialized once, at commit."""
        self._states[k] = state
        self._stage(k, state)

    def delete(self, k: bytes) -> None:
        """Stage a delete."""
        self._states[k] = None
        self._stage(k, None)

    def _stage(self, k: bytes, value: bytes | _Json | None) -> None:
        if k not in self._writes:
            self._by_tag.setdefault(k[:1], set()).add(k)
        self._writes[k] = value

    def scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Like `scan(db, prefix)`, with this batch's staged writes applied."""
        found = dict(scan(self.db, prefix))
        for k in self._by_tag.get(prefix[:1], ()):
            if k.startswith(prefix):
                value = self.get(k)
                if value is None:
                    found.pop(k, None)
                else:
                    found[k] = value
        return sorted(found.items())

    def commit(self, *, sync: bool = False) -> int:
        """Write everything staged in one atomic `WriteBatch`; returns the number of keys."""
        batch = WriteBatch(raw_mode=True)
        for k, value in self._writes.items():
            if value is None:
                batch.delete(k)
            else:
                batch.put(k, value.encode() if isinstance(value, _Json) else value)
        count = len(self._writes)
        if count:
            options = WriteOptions()
            options.sync = sync
            self.db.write(batch, options)
        self._writes.clear()
        self._states.clear()
        self._by_tag.clear()
        return count
