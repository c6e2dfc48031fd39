"""The read side: the `Projector` that materializes the log, and the queries over it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.projector._checkpoints import Checkpoints
    from stepstream.projector._membership import Membership
    from stepstream.projector._projector import Projector
    from stepstream.projector._reader import (
        ProjectionReader,
        ProjectionStatus,
        RecoveryReport,
        ShardUnavailable,
        continue_run,
        fork_run,
        inspect_recovery,
    )
    from stepstream.projector._rebuild import progress_bar, rebuild
    from stepstream.projector._verify import Difference, verify_paths

_WHERE = {
    'Checkpoints': 'stepstream.projector._checkpoints',
    'Difference': 'stepstream.projector._verify',
    'Membership': 'stepstream.projector._membership',
    'ProjectionReader': 'stepstream.projector._reader',
    'ProjectionStatus': 'stepstream.projector._reader',
    'Projector': 'stepstream.projector._projector',
    'RecoveryReport': 'stepstream.projector._reader',
    'ShardUnavailable': 'stepstream.projector._reader',
    'continue_run': 'stepstream.projector._reader',
    'fork_run': 'stepstream.projector._reader',
    'inspect_recovery': 'stepstream.projector._reader',
    'progress_bar': 'stepstream.projector._rebuild',
    'rebuild': 'stepstream.projector._rebuild',
    'verify_paths': 'stepstream.projector._verify',
}
"""Where each public name lives: imported on first use, so a command that needs one piece
(a reader for `stepstream runs`) does not pay for the rest (Pydantic AI, ...)."""

__all__ = [
    'Checkpoints',
    'Difference',
    'Membership',
    'ProjectionReader',
    'ProjectionStatus',
    'Projector',
    'RecoveryReport',
    'ShardUnavailable',
    'continue_run',
    'fork_run',
    'inspect_recovery',
    'progress_bar',
    'rebuild',
    'verify_paths',
]

__getattr__ = lazy_exports(__name__, _WHERE)
