"""Reading a shard: typed reads over raw keys, shared by shards, their transactions and readers.

`ShardReads` is what the read model reads a shard through, and what a `ShardTransaction` reads
before it stages; it owns every stored value's layout that is not a state record (`_state`), so
nothing else slices stored bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from aiokafka.structs import TopicPartition

from stepstream.storage._keys import (
    DLQ_COUNTS,
    IDENTITY,
    OFFSET,
    PROCESS_LOCAL,
    PROGRESS,
    decode_int,
    encode_int,
)
from stepstream.storage._state import Identity, _Json

S = TypeVar('S', bound=_Json)


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

    def count(self, k: bytes) -> int:
        """The count stored at a `COUNT` key (0 when absent)."""
        raw = self.get(k)
        return int(raw) if raw is not None else 0

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
