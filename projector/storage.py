"""The shards' layout and codecs, shared by the projector that writes them and the read model that reads them.

The projector's storage layer stays in its private modules (`_shard.py`: the shard types and
the projection directory; `_keys.py`: the key layout; `_state.py`: the state records' codecs;
`_retention.py`: what a retention policy keeps); this module is their public face, the names a
reader of the shards needs (`stepstream.readmodel`) and nothing the projector alone uses.
"""

from __future__ import annotations

from stepstream.projector._keys import (
    AGENT,
    BROKEN,
    CHILDREN,
    CONFLICT,
    CONVERSATION,
    COUNT,
    EFFECT,
    EVENT,
    LATEST,
    PARKED,
    RUN,
    RUN_MEDIA,
    RUNS,
    SNAPSHOT,
    STATUS,
    UNRESOLVED,
    UNRESOLVED_RUN,
    Keyspace,
)
from stepstream.projector._listing import CONFLICTING_COUNT, PARKED_COUNT
from stepstream.projector._retention import (
    RetentionPreview,
    RetentionState,
    expired_started_at,
    referenced_media,
    retention_preview,
    retention_state,
)
from stepstream.projector._shard import (
    MemoryShard,
    Shard,
    check_projection,
    combined_state,
    shard_paths,
    shard_writer,
)
from stepstream.projector._state import RUN_INDEX_VERSION, EffectState, RunState, SnapshotEntry

__all__ = [
    'AGENT',
    'BROKEN',
    'CHILDREN',
    'CONFLICT',
    'CONFLICTING_COUNT',
    'CONVERSATION',
    'COUNT',
    'EFFECT',
    'EVENT',
    'LATEST',
    'PARKED',
    'PARKED_COUNT',
    'RUN',
    'RUNS',
    'RUN_INDEX_VERSION',
    'RUN_MEDIA',
    'SNAPSHOT',
    'STATUS',
    'UNRESOLVED',
    'UNRESOLVED_RUN',
    'EffectState',
    'Keyspace',
    'MemoryShard',
    'RetentionPreview',
    'RetentionState',
    'RunState',
    'Shard',
    'SnapshotEntry',
    'check_projection',
    'combined_state',
    'expired_started_at',
    'referenced_media',
    'retention_preview',
    'retention_state',
    'shard_paths',
    'shard_writer',
]
