"""Changing a shard: the transactions of a batch.

Everything a batch changes in a shard, offsets included, is staged in a `ShardTransaction` and
written in one `WriteBatch`, so a crash leaves all of a batch or none of it. The applier sees
only the `Transaction` protocol; the RocksDB `Shard` (`_rocks`) and the `MemoryShard`
(`_memory`) both stage theirs in a `ShardTransaction`, so the apply rules can be tested
without RocksDB (and are, besides on RocksDB: tests/test_apply_properties.py). Its reads are
`ShardReads` (`_reads`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from stepstream.storage._keys import DLQ_COUNTS, OFFSET, PROGRESS
from stepstream.storage._reads import S, ShardReads, pack_transition
from stepstream.storage._state import _Json, dumps

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

    def add_count(self, k: bytes, delta: int) -> None:
        """Add `delta` to the count at a `COUNT` key; a count of 0 is no key."""
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

    def add_count(self, k: bytes, delta: int) -> None:
        """Add `delta` to the count at a `COUNT` key; a count of 0 is no key (as if never counted)."""
        total = self.count(k) + delta
        if total:
            self.put(k, str(total).encode())
        else:
            self.delete(k)

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
