"""The `Projector` that materializes the log into shards, and the tools over them (rebuild, verify, sweep).

The shards' layout and codecs are `stepstream.projector.storage`; the queries over the shards
are the read model's (`stepstream.readmodel`), whose names this package still exports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.projector._checkpoints import Checkpoints
    from stepstream.projector._dead_letters import DeadLetterHeaders
    from stepstream.projector._membership import Membership
    from stepstream.projector._observe import ProjectorObserver
    from stepstream.projector._options import GroupMember, ProjectorParts, Rebuilding
    from stepstream.projector._projector import Projector
    from stepstream.projector._rebuild import progress_bar, rebuild
    from stepstream.projector._retention import RetentionPreview, RetentionState
    from stepstream.projector._shard import shard_paths
    from stepstream.projector._sweep import SweepReport, sweep_media
    from stepstream.projector._verify import Difference, verify_paths
    from stepstream.readmodel import (
        ProjectionReader,
        ProjectionStatus,
        RecoveryReport,
        ShardUnavailable,
        continue_run,
        fork_run,
        inspect_recovery,
    )

_WHERE = {
    'Checkpoints': 'stepstream.projector._checkpoints',
    'DeadLetterHeaders': 'stepstream.projector._dead_letters',
    'Difference': 'stepstream.projector._verify',
    'GroupMember': 'stepstream.projector._options',
    'Membership': 'stepstream.projector._membership',
    'ProjectionReader': 'stepstream.readmodel',
    'ProjectionStatus': 'stepstream.readmodel',
    'Projector': 'stepstream.projector._projector',
    'ProjectorObserver': 'stepstream.projector._observe',
    'ProjectorParts': 'stepstream.projector._options',
    'Rebuilding': 'stepstream.projector._options',
    'RecoveryReport': 'stepstream.readmodel',
    'RetentionPreview': 'stepstream.projector._retention',
    'RetentionState': 'stepstream.projector._retention',
    'SweepReport': 'stepstream.projector._sweep',
    'shard_paths': 'stepstream.projector._shard',
    'sweep_media': 'stepstream.projector._sweep',
    'ShardUnavailable': 'stepstream.readmodel',
    'continue_run': 'stepstream.readmodel',
    'fork_run': 'stepstream.readmodel',
    'inspect_recovery': 'stepstream.readmodel',
    'progress_bar': 'stepstream.projector._rebuild',
    'rebuild': 'stepstream.projector._rebuild',
    'verify_paths': 'stepstream.projector._verify',
}
"""Where each public name lives: imported on first use, so a command that needs one piece
(a reader for `stepstream runs`) does not pay for the rest (Pydantic AI, ...). The reader's
names are the read model's (`stepstream.readmodel`), kept here for the code that imports them
from the projector."""

__all__ = [
    'Checkpoints',
    'DeadLetterHeaders',
    'Difference',
    'GroupMember',
    'Membership',
    'ProjectionReader',
    'ProjectionStatus',
    'Projector',
    'ProjectorObserver',
    'ProjectorParts',
    'Rebuilding',
    'RecoveryReport',
    'RetentionPreview',
    'RetentionState',
    'ShardUnavailable',
    'SweepReport',
    'continue_run',
    'fork_run',
    'inspect_recovery',
    'progress_bar',
    'rebuild',
    'shard_paths',
    'sweep_media',
    'verify_paths',
]

__getattr__ = lazy_exports(__name__, _WHERE)
