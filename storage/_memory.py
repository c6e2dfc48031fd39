"""`MemoryShard`: a shard in a dict, for the unit and property tests of the apply rules."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Mapping

from stepstream.storage._keys import IDENTITY, prefix_end
from stepstream.storage._reads import ShardReads
from stepstream.storage._state import Identity, _Json
from stepstream.storage._transaction import ShardTransaction


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

    def scan(
        self, prefix: bytes, *, start: bytes | None = None, reverse: bool = False
    ) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) under `prefix`, as `Shard.scan` walks them on RocksDB."""
        keys, values = self._keys, self._values
        if not reverse:
            at = bisect.bisect_left(keys, prefix if start is None else start)
            while at < len(keys) and keys[at].startswith(prefix):
                yield keys[at], values[keys[at]]
                at += 1
            return
        top = start if start is not None else prefix_end(prefix)
        at = (len(keys) if top is None else bisect.bisect_right(keys, top)) - 1
        while at >= 0 and keys[at].startswith(prefix):
            yield keys[at], values[keys[at]]
            at -= 1

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
