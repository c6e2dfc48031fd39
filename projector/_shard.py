"""A shard: one partition's views and offsets in one store, and the transactions that change it.

A projection is a directory holding one shard per partition number (`shard-0000`, ...), each a
RocksDB store with every view of the runs of that partition and the partition's offsets of both
topics (docs/decisions/0016-partitioned-projection.md, 0029-shard-type.md). Keys come from
`_keys` and state records from `_state`. The shard is in three parts, whose names this module
gathers for the rest of the projector and for tests:

- `_transaction`: the typed reads over a shard (`ShardReads`), the `Transaction` protocol the
  applier sees, and the `ShardTransaction` that stages a batch and commits it, offsets included,
  in one write (so a crash leaves all of a batch or none of it); the stored values' layouts.
- `_rocks`: the RocksDB `Shard` and the projection directory (opening, creating, the writer's
  lock and pid, identities); nothing else opens a RocksDB handle.
- `_memory_shard`: `MemoryShard`, the same transactions in a dict, so the apply rules can be
  tested without RocksDB (and are, besides on RocksDB: tests/test_apply_properties.py).
"""

from __future__ import annotations

from stepstream.projector._memory_shard import MemoryShard
from stepstream.projector._rocks import (
    PID_FILE,
    SHARD_NAME,
    Shard,
    check_projection,
    combined_state,
    read_identity_file,
    read_projection_identity,
    shard_path,
    shard_paths,
    shard_writer,
)
from stepstream.projector._transaction import (
    ShardReads,
    ShardTransaction,
    Transaction,
    Transactional,
    pack_transition,
    unpack_transition,
)

__all__ = [
    'PID_FILE',
    'SHARD_NAME',
    'MemoryShard',
    'Shard',
    'ShardReads',
    'ShardTransaction',
    'Transaction',
    'Transactional',
    'check_projection',
    'combined_state',
    'pack_transition',
    'read_identity_file',
    'read_projection_identity',
    'shard_path',
    'shard_paths',
    'shard_writer',
    'unpack_transition',
]
