"""The read model: queries over the shards the projector writes (runs, lineage, effects, snapshots, status).

One small view per shape over the shards (`_runs.py`, `_lineage.py`, `_events.py`,
`_snapshots.py`, `_effects.py`, `_status.py`, `_retention.py`, `_recovery.py`), composed by
`ProjectionReader`, which opens them one way: `ProjectionReader.from_settings(settings)` in any
process, `ProjectionReader.of(projector)` in the projector's own. Its callers never change it once open.
`stepstream serve`, the CLI, the analytics export, the media sweep and the demo all read
through it; the shards' layout and codecs it reads come from `stepstream.storage`.

```python
from stepstream.readmodel import ProjectionReader

async with ProjectionReader.from_settings(settings) as reader:
    runs = await reader.list_runs(newest_first=True, limit=50)
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.readmodel._continue import (
        RESUMES_KEY,
        Resumption,
        continue_conversation,
        continue_run,
        fork_run,
        resume_run,
    )
    from stepstream.readmodel._conversation import (
        Conversation,
        ConversationCursor,
        ConversationHolding,
        decode_conversation_cursor,
        encode_conversation_cursor,
    )
    from stepstream.readmodel._conversation_group import (
        MEMBER_BATCH,
        ConversationMember,
        ConversationReads,
        GroupConversations,
    )
    from stepstream.readmodel._conversations import MAX_SEARCH_WORDS, ConversationsNotIndexed
    from stepstream.readmodel._effects import UnresolvedCursor, UnresolvedSummary
    from stepstream.readmodel._reader import ProjectionReader
    from stepstream.readmodel._recovery import RecoveryReport, inspect_recovery
    from stepstream.readmodel._runs import RunCounts
    from stepstream.readmodel._shards import ShardUnavailable
    from stepstream.readmodel._status import ProjectionStatus
    from stepstream.readmodel._sweep import SweepReport, sweep_media
    from stepstream.readmodel._waiting import (
        WaitingCall,
        WaitingCursor,
        decode_waiting_cursor,
        encode_waiting_cursor,
    )

_WHERE = {
    'MEMBER_BATCH': 'stepstream.readmodel._conversation_group',
    'MAX_SEARCH_WORDS': 'stepstream.readmodel._conversations',
    'ConversationMember': 'stepstream.readmodel._conversation_group',
    'ConversationReads': 'stepstream.readmodel._conversation_group',
    'GroupConversations': 'stepstream.readmodel._conversation_group',
    'ConversationHolding': 'stepstream.readmodel._conversation',
    'Conversation': 'stepstream.readmodel._conversation',
    'ConversationCursor': 'stepstream.readmodel._conversation',
    'ConversationsNotIndexed': 'stepstream.readmodel._conversations',
    'decode_conversation_cursor': 'stepstream.readmodel._conversation',
    'encode_conversation_cursor': 'stepstream.readmodel._conversation',
    'RESUMES_KEY': 'stepstream.readmodel._continue',
    'Resumption': 'stepstream.readmodel._continue',
    'resume_run': 'stepstream.readmodel._continue',
    'WaitingCall': 'stepstream.readmodel._waiting',
    'WaitingCursor': 'stepstream.readmodel._waiting',
    'decode_waiting_cursor': 'stepstream.readmodel._waiting',
    'encode_waiting_cursor': 'stepstream.readmodel._waiting',
    'ProjectionReader': 'stepstream.readmodel._reader',
    'ProjectionStatus': 'stepstream.readmodel._status',
    'RecoveryReport': 'stepstream.readmodel._recovery',
    'RunCounts': 'stepstream.readmodel._runs',
    'ShardUnavailable': 'stepstream.readmodel._shards',
    'SweepReport': 'stepstream.readmodel._sweep',
    'UnresolvedCursor': 'stepstream.readmodel._effects',
    'UnresolvedSummary': 'stepstream.readmodel._effects',
    'continue_conversation': 'stepstream.readmodel._continue',
    'continue_run': 'stepstream.readmodel._continue',
    'fork_run': 'stepstream.readmodel._continue',
    'inspect_recovery': 'stepstream.readmodel._recovery',
    'sweep_media': 'stepstream.readmodel._sweep',
}
"""Where each public name lives: imported on first use, so `import stepstream.readmodel` costs
nothing until a reader is wanted (RocksDB, the schemas, ...)."""

__all__ = [
    'MAX_SEARCH_WORDS',
    'MEMBER_BATCH',
    'RESUMES_KEY',
    'Conversation',
    'ConversationCursor',
    'ConversationHolding',
    'ConversationMember',
    'ConversationReads',
    'ConversationsNotIndexed',
    'GroupConversations',
    'ProjectionReader',
    'ProjectionStatus',
    'RecoveryReport',
    'Resumption',
    'RunCounts',
    'ShardUnavailable',
    'SweepReport',
    'UnresolvedCursor',
    'UnresolvedSummary',
    'WaitingCall',
    'WaitingCursor',
    'continue_conversation',
    'continue_run',
    'decode_conversation_cursor',
    'decode_waiting_cursor',
    'encode_conversation_cursor',
    'encode_waiting_cursor',
    'fork_run',
    'inspect_recovery',
    'resume_run',
    'sweep_media',
]

__getattr__ = lazy_exports(__name__, _WHERE)
