"""A shard: one partition's views and offsets in one store, and the transactions that change it.

A projection is a directory holding one shard per partition number (`shard-0000`, ...), each a
RocksDB store with every view of the runs of that partition and the partition's offsets of both
topics (docs/decisions/0016-partitioned-projection.md, 0029-shard-type.md). Keys come from
`_keys` and state records from `_state`; this module owns the files and every stored value's
layout, so nothing else opens a RocksDB handle or slices stored bytes.

Everything a batch changes in a shard, offsets included, is staged in a `ShardTransaction` and
written in one `WriteBatch`, so a crash leaves all of a batch or none of it. The applier sees
only the `Transaction` protocol; `MemoryShard` holds the same transactions in a dict, so the
apply rules can be tested without RocksDB (and are, besides on RocksDB: tests/test_apply_properties.py).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from aiokafka.structs import TopicPartition
from rocksdict import AccessType, Checkpoint, Options, Rdict, WriteBatch, WriteOptions

from stepstream.errors import ProjectionInUse, ProjectionMismatch, UsageError
from stepstream.projector._keys import (
    DLQ_COUNTS,
    IDENTITY,
    OFFSET,
    PROCESS_LOCAL,
    PROGRESS,
    decode_int,
    encode_int,
)
from stepstream.projector._state import Identity, _Json, dumps

S = TypeVar('S', bound=_Json)

PID_FILE = 'stepstream-projector.pid'
"""Written by the process holding a shard open for writing, to name it in errors."""

SHARD_NAME = re.compile(r'shard-(\d{4,})')
"""A shard's directory name: `shard-` and its partition number, four digits at least."""


# -- value layouts that are not a state record --------------------------------------------------


def pack_transition(offset: int, value: bytes) -> bytes:
    """A `TRANSITION` value: the record's offset in its partition (8 bytes), then its bytes.

    The offset is kept because a transition a later step event displaces is dead-lettered
    with its own coordinates.
    """
    return encode_int(offset) + value


def unpack_transition(stored: bytes) -> tuple[int, bytes]:
    """The offset and the record bytes of a stored `TRANSITION` value (`pack_transition`)."""
    return decode_int(stored[:8]), stored[8:]


# -- reading a shard: raw keys, typed values -------------------------------------------------


class ShardReads:
    """Typed reads over a shard's `get` and `scan`, shared by shards and their transactions."""

    __slots__ = ()

    def get(self, k: bytes) -> bytes | None:
        """The value stored at `k`, or None."""
        raise NotImplementedError

    def scan(self, prefix: bytes) -> Iterable[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with `prefix`, in key order."""
        raise NotImplementedError

    def scan_until(self, prefix: bytes, stop: bytes) -> list[tuple[bytes, bytes]]:
        """The (key, value) pairs under `prefix` whose key is below `stop`, in key order.

        Reads no further than `stop`: for an index ordered by time, read up to a cut-off.
        """
        found = []
        for k, v in self.scan(prefix):
            if k >= stop:
                break
            found.append((k, v))
        return found

    def get_state(self, k: bytes, kind: type[S]) -> S | None:
        """The state record at `k` (`RunState`, `EffectState`, ...), or None."""
        raw = self.get(k)
        return kind.decode(raw) if raw is not None else None

    def transition(self, k: bytes) -> tuple[int, bytes] | None:
        """The offset and the bytes of the tool-effect transition stored at `k`, or None."""
        stored = self.get(k)
        return unpack_transition(stored) if stored is not None else None

    def transitions(self, prefix: bytes) -> Iterator[tuple[bytes, int, bytes]]:
        """(key, offset, record bytes) of every transition under `prefix`, in key order."""
        for k, stored in self.scan(prefix):
            offset, value = unpack_transition(stored)
            yield k, offset, value

    def offsets(self) -> dict[TopicPartition, int]:
        """For each partition, the next offset the shard will apply."""
        stored = {}
        for k, v in self.scan(OFFSET.tag):
            topic, partition = OFFSET.parse(k)
            assert isinstance(topic, str) and isinstance(partition, int)
            stored[TopicPartition(topic, partition)] = int(v)
        return stored

    def identity(self) -> Identity | None:
        """The identity stored in the shard, or None (a store not yet started, or not a shard)."""
        raw = self.get(IDENTITY)
        if raw is None:
            return None
        try:
            return Identity.decode(raw)
        except (TypeError, ValueError):
            return None

    def dlq_counts(self) -> dict[str, int]:
        """Records dead-lettered so far, by reason."""
        counts: dict[str, int] = json.loads(self.get(DLQ_COUNTS) or b'{}')
        return counts

    def progress(self) -> dict[str, Any]:
        """The apply rate of the shard's last batch and when it was applied (`{}` before one)."""
        figures: dict[str, Any] = json.loads(self.get(PROGRESS) or b'{}')
        return figures

    def conflict_records(self, k: bytes) -> int:
        """How many records of one other writer a run keeps apart (`CONFLICT` key)."""
        raw = self.get(k)
        return int(json.loads(raw)['records']) if raw is not None else 0

    def logical_items(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) of the logical content, in key order (what `verify` compares).

        Only bookkeeping that depends on the consuming process is left out: the offsets,
        progress figures and the identity.
        """
        for k, v in self.scan(b''):
            if not k.startswith(PROCESS_LOCAL):
                yield k, v


# -- transactions ---------------------------------------------------------------------------


class Transaction(Protocol):
    """What the applier reads and stages while it applies one batch to one shard.

    Reads see the writes staged before them in the same batch. Nothing is stored until
    `commit`, which writes everything, offsets included, at once.
    """

    def get(self, k: bytes) -> bytes | None:
        """The staged value if any, else the stored one."""
        ...

    def get_state(self, k: bytes, kind: type[S]) -> S | None:
        """A state record, decoded once per batch; change it and `put_state` it back."""
        ...

    def scan(self, prefix: bytes) -> Iterable[tuple[bytes, bytes]]:
        """Every (key, value) under `prefix` in key order, with the staged writes applied."""
        ...

    def scan_until(self, prefix: bytes, stop: bytes) -> list[tuple[bytes, bytes]]:
        """Like `scan`, but only the keys below `stop` (and it reads no further)."""
        ...

    def put(self, k: bytes, value: bytes) -> None:
        """Stage a write."""
        ...

    def put_state(self, k: bytes, state: _Json) -> None:
        """Stage a state record; it is serialized once, at commit."""
        ...

    def delete(self, k: bytes) -> None:
        """Stage a delete."""
        ...

    def transition(self, k: bytes) -> tuple[int, bytes] | None:
        """The offset and bytes of the transition at `k` (staged or stored), or None."""
        ...

    def transitions(self, prefix: bytes) -> Iterable[tuple[bytes, int, bytes]]:
        """(key, offset, record bytes) of every transition under `prefix`, in key order."""
        ...

    def put_transition(self, k: bytes, offset: int, value: bytes) -> None:
        """Stage a tool-effect transition with its offset."""
        ...

    def set_offset(self, topic: str, partition: int, offset: int) -> None:
        """Stage the next offset to apply of one topic partition."""
        ...

    def count_dead_letters(self, reasons: Iterable[str]) -> None:
        """Add dead letters to the shard's counts by reason."""
        ...

    def uncount_dead_letters(self, counts: Mapping[str, int]) -> None:
        """Take dead letters back out of the shard's counts (an expired run's, by reason)."""
        ...

    def set_progress(self, figures: Mapping[str, Any]) -> None:
        """Stage the apply rate figures `stepstream status` reads."""
        ...

    def count_conflict(self, k: bytes) -> None:
        """Count one more record of another writer kept apart (`CONFLICT` key)."""
        ...

    def commit(self, *, sync: bool = False) -> int:
        """Write everything staged at once; returns the number of keys."""
        ...


class Transactional(Protocol):
    """A shard a batch can be applied to: `Shard` (RocksDB) or `MemoryShard`."""

    def begin(self) -> Transaction:
        """A new transaction on the shard."""
        ...


class _Store(Protocol):
    """What a `ShardTransaction` needs of the shard under it."""

    lookup: Callable[[bytes], bytes | None]
    """The store's own point read, with nothing in between (it runs several times per record)."""

    def scan(self, prefix: bytes) -> Iterable[tuple[bytes, bytes]]: ...

    def write(self, writes: Mapping[bytes, bytes | _Json | None], *, sync: bool) -> None: ...


class ShardTransaction(ShardReads):
    """Staged writes of one batch on one shard, readable before they are committed.

    Later records of a batch must see what earlier ones wrote (a run registered three records
    ago), so reads check the staged writes first, then the shard. State records are decoded once
    per batch and serialized once, at commit.
    """

    __slots__ = ('_by_tag', '_read', '_states', '_store', '_writes')

    def __init__(self, store: _Store) -> None:
        self._store = store
        self._read = store.lookup
        self._writes: dict[bytes, bytes | _Json | None] = {}
        self._states: dict[bytes, _Json | None] = {}
        # Staged keys by keyspace tag, so `scan` does not walk every staged write.
        self._by_tag: dict[bytes, set[bytes]] = {}

    def get(self, k: bytes) -> bytes | None:
        """The staged value if any, else the stored one."""
        if k in self._writes:
            staged = self._writes[k]
            return staged.encode() if isinstance(staged, _Json) else staged
        return self._read(k)

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

    def put_transition(self, k: bytes, offset: int, value: bytes) -> None:
        """Stage a tool-effect transition with its offset."""
        self.put(k, pack_transition(offset, value))

    def set_offset(self, topic: str, partition: int, offset: int) -> None:
        """Stage the next offset to apply of one topic partition."""
        self.put(OFFSET.key(topic, partition), str(offset).encode())

    def set_progress(self, figures: Mapping[str, Any]) -> None:
        """Stage the apply rate figures `stepstream status` reads."""
        self.put(PROGRESS, dumps(figures))

    def count_dead_letters(self, reasons: Iterable[str]) -> None:
        """Add dead letters to the shard's counts by reason."""
        counts = self.dlq_counts()
        for reason in reasons:
            counts[reason] = counts.get(reason, 0) + 1
        self._put_dlq_counts(counts)

    def uncount_dead_letters(self, counts: Mapping[str, int]) -> None:
        """Take dead letters back out of the shard's counts; a reason that reaches 0 is left out."""
        stored = self.dlq_counts()
        for reason, n in counts.items():
            left = stored.get(reason, 0) - n
            if left > 0:
                stored[reason] = left
            else:
                stored.pop(reason, None)
        self._put_dlq_counts(stored)

    def _put_dlq_counts(self, counts: dict[str, int]) -> None:
        """No counts is no key: the same bytes whether dead letters came and went or never came."""
        if counts:
            self.put(DLQ_COUNTS, dumps(counts))
        else:
            self.delete(DLQ_COUNTS)

    def count_conflict(self, k: bytes) -> None:
        """Count one more record of another writer kept apart (`CONFLICT` key)."""
        self.put(k, dumps({'records': self.conflict_records(k) + 1}))

    def _stage(self, k: bytes, value: bytes | _Json | None) -> None:
        if k not in self._writes:
            self._by_tag.setdefault(k[:1], set()).add(k)
        self._writes[k] = value

    def scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Every (key, value) under `prefix` in key order, with this batch's staged writes applied."""
        return self._staged_over(dict(self._store.scan(prefix)), prefix, None)

    def scan_until(self, prefix: bytes, stop: bytes) -> list[tuple[bytes, bytes]]:
        """Like `scan`, but only the keys below `stop`; the store is read no further."""
        stored = itertools.takewhile(lambda item: item[0] < stop, self._store.scan(prefix))
        return self._staged_over(dict(stored), prefix, stop)

    def _staged_over(
        self, found: dict[bytes, bytes], prefix: bytes, stop: bytes | None
    ) -> list[tuple[bytes, bytes]]:
        """`found` (what the store holds) with this batch's writes under `prefix` (below `stop`) applied."""
        for k in self._by_tag.get(prefix[:1], ()):
            if k.startswith(prefix) and (stop is None or k < stop):
                value = self.get(k)
                if value is None:
                    found.pop(k, None)
                else:
                    found[k] = value
        return sorted(found.items())

    def commit(self, *, sync: bool = False) -> int:
        """Write everything staged at once (one `WriteBatch` on RocksDB); returns the number of keys."""
        writes = self._writes
        count = len(writes)
        if count:
            self._store.write(writes, sync=sync)
        self._writes = {}
        self._states.clear()
        self._by_tag.clear()
        return count


# -- the RocksDB shard --------------------------------------------------------------------------


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
        identity = read_identity_file(target)
        if identity is None or identity.format != Identity.FORMAT:
            raise ProjectionMismatch(
                f'{target} is a RocksDB directory but not a stepstream projection shard of this version: '
                f'rebuild it with `stepstream rebuild --into NEW_DIR`'
            )
        options = Options(raw_mode=True)
        options.set_max_open_files(-1)
        db = Rdict(str(target), options, access_type=AccessType.secondary(str(scratch)))
        shard = cls(db, target, partition=identity.partition, read_only=True)
        shard.catch_up()
        return shard

    # -- reads and writes -----------------------------------------------------------------------

    def get(self, k: bytes) -> bytes | None:
        """The value stored at `k`, or None."""
        return self.lookup(k)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with `prefix`, in key order."""
        for k, v in self._db.items(from_key=prefix):
            if not isinstance(k, bytes) or not k.startswith(prefix):
                break
            yield k, v

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


# -- the in-memory shard ------------------------------------------------------------------------


class MemoryShard(ShardReads):
    """A shard in a dict, with the same transactions: for unit and property tests of the rules.

    ```python
    shard = MemoryShard()
    txn, outcome = applier.stage(shard, records)
    txn.commit()
    ```
    """

    def __init__(self, partition: int = 0) -> None:
        """An empty shard of `partition`."""
        self.partition = partition
        self._values: dict[bytes, bytes] = {}
        self._keys: list[bytes] = []
        self.lookup: Callable[[bytes], bytes | None] = self._values.get

    def get(self, k: bytes) -> bytes | None:
        """The value stored at `k`, or None."""
        return self._values.get(k)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with `prefix`, in key order."""
        keys, values = self._keys, self._values
        at = bisect.bisect_left(keys, prefix)
        while at < len(keys) and keys[at].startswith(prefix):
            yield keys[at], values[keys[at]]
            at += 1

    def begin(self) -> ShardTransaction:
        """A transaction, as on RocksDB."""
        return ShardTransaction(self)

    def write(self, writes: Mapping[bytes, bytes | _Json | None], *, sync: bool) -> None:
        """Apply `writes` (None deletes; state records serialized here) at once."""
        for k, value in writes.items():
            if value is None:
                if self._values.pop(k, None) is not None:
                    del self._keys[bisect.bisect_left(self._keys, k)]
            else:
                if k not in self._values:
                    bisect.insort(self._keys, k)
                self._values[k] = value.encode() if isinstance(value, _Json) else value

    def write_identity(self, identity: Identity) -> None:
        """Store the identity."""
        self.write({IDENTITY: identity.encode()}, sync=True)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value), in key order."""
        return self.scan(b'')

    def catch_up(self) -> None:
        """Nothing to follow: there is one writer, in this process."""

    def flush(self) -> None:
        """Nothing to flush."""

    def close(self) -> None:
        """Nothing to close."""
