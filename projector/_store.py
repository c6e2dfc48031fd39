r"""The projection's RocksDB layout, and the batch transaction that writes state with offsets.

One column family, keys by prefix (`\x00` separates key parts; ids never contain it):

| prefix | key                                   | value                                 |
| ------ | ------------------------------------- | ------------------------------------- |
| `o`    | topic, partition                      | next offset to consume (ASCII int)    |
| `r`    | run_id                                | run state (JSON)                      |
| `e`    | run_id, seq                           | the StepEvent exactly as logged (Avro)|
| `s`    | run_id, snapshot_seq                  | snapshot index entry (JSON)           |
| `x`    | run_id, tool_call_id                  | merged tool effect (JSON)             |
| `u`    | started_at, run_id, tool_call_id      | unresolved effect, global, oldest first|
| `U`    | run_id, tool_call_id                  | unresolved effect, per run            |
| `a`    | started_at, run_id                    | every run, chronological              |
| `c`    | conversation_id, started_at, run_id   | conversation -> runs                  |
| `p`    | parent_run_id, started_at, run_id     | parent -> children                    |
| `q`    | run_id, writer_id, seq                | record parked until its run registers |
| `w`    | run_id, writer_id, seq                | record of a conflicting writer, apart |
| `k`    | run_id, writer_id                     | conflicting writer (JSON: count)      |
| `m`    | name                                  | counters (JSON)                       |

Everything a batch changes, offsets included, goes to RocksDB in one `WriteBatch`, so a crash
leaves all of a batch or none of it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

SEP = b'\x00'


def key(prefix: bytes, *parts: str | int) -> bytes:
    """A key from its prefix and parts; ints are zero-padded so byte order is numeric order."""
    encoded = [p.encode() if isinstance(p, str) else b'%020d' % p for p in parts]
    return prefix + SEP + SEP.join(encoded)


def prefix_of(prefix: bytes, *parts: str | int) -> bytes:
    """The key prefix that all keys below `parts` share (ends with the separator)."""
    return key(prefix, *parts) + SEP


def dumps(value: Any) -> bytes:
    """Compact, key-sorted JSON: the same state always has the same bytes."""
    return json.dumps(value, separators=(',', ':'), sort_keys=True).encode()


def open_db(path: str | Path, *, secondary: str | Path | None = None) -> Rdict:
    """Open the projection; as a secondary instance (read-only, catches up) when `secondary` is set."""
    options = Options(raw_mode=True)
    if secondary is None:
        options.create_if_missing(True)
        Path(path).mkdir(parents=True, exist_ok=True)
        return Rdict(str(path), options)
    options.set_max_open_files(-1)
    return Rdict(str(path), options, access_type=AccessType.secondary(str(secondary)))


def scan(db: Rdict, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) whose key starts with `prefix`, in key order."""
    for k, v in db.items(from_key=prefix):
        if not isinstance(k, bytes) or not k.startswith(prefix):
            break
        yield k, v


_AS_JSON = b'<json>'
"""Marks a staged write whose value is serialized from the decoded JSON at commit."""


class BatchTxn:
    """Staged writes of one consumed batch, readable before they are committed.

    Later records of a batch must see what earlier ones wrote (a run registered three records
    ago), so reads check the staged writes first, then RocksDB.
    """

    def __init__(self, db: Rdict) -> None:
        self.db = db
        self._writes: dict[bytes, bytes | None] = {}
        self._json: dict[bytes, Any] = {}
        # Staged keys by their one-letter prefix, so `scan` does not walk every staged write.
        self._by_prefix: dict[bytes, set[bytes]] = {}

    def get(self, k: bytes) -> bytes | None:
        """The staged value if any, else the stored one."""
        if k in self._writes:
            staged = self._writes[k]
            return dumps(self._json[k]) if staged is _AS_JSON else staged
        value = self.db.get(k)
        return value if isinstance(value, bytes) else None

    def put(self, k: bytes, value: bytes) -> None:
        """Stage a write."""
        self._json.pop(k, None)
        self._stage(k, value)

    def delete(self, k: bytes) -> None:
        """Stage a delete."""
        self._json.pop(k, None)
        self._stage(k, None)

    def _stage(self, k: bytes, value: bytes | None) -> None:
        if k not in self._writes:
            self._by_prefix.setdefault(k[:1], set()).add(k)
        self._writes[k] = value

    def get_json(self, k: bytes) -> Any:
        """A JSON value, decoded once per batch; mutate it and `put_json` it back."""
        if k in self._json:
            return self._json[k]
        raw = self.get(k)
        value = json.loads(raw) if raw is not None else None
        self._json[k] = value
        return value

    def scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Like `scan(db, prefix)`, with this batch's staged writes applied."""
        found = dict(scan(self.db, prefix))
        for k in self._by_prefix.get(prefix[:1], ()):
            if k.startswith(prefix):
                value = self.get(k)
                if value is None:
                    found.pop(k, None)
                else:
                    found[k] = value
        return sorted(found.items())

    def put_json(self, k: bytes, value: Any) -> None:
        """Stage a JSON value; it is serialized once, at commit."""
        self._stage(k, _AS_JSON)
        self._json[k] = value

    def commit(self, *, sync: bool = False) -> int:
        """Write everything staged in one atomic `WriteBatch`; returns the number of keys."""
        batch = WriteBatch(raw_mode=True)
        for k, value in self._writes.items():
            if value is None:
                batch.delete(k)
            elif value is _AS_JSON:
                batch.put(k, dumps(self._json[k]))
            else:
                batch.put(k, value)
        count = len(self._writes)
        if count:
            options = WriteOptions()
            options.sync = sync
            self.db.write(batch, options)
        self._writes.clear()
        self._json.clear()
        self._by_prefix.clear()
        return count
