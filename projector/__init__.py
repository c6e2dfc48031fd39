"""The read side: the `Projector` that materializes the log, and the queries over it."""

from stepstream.projector._checkpoints import Checkpoints
from stepstream.projector._export import ExportReport, export_filesystem, export_parquet
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

__all__ = [
    'Checkpoints',
    'Difference',
    'ExportReport',
    'Membership',
    'ProjectionReader',
    'ProjectionStatus',
    'Projector',
    'RecoveryReport',
    'ShardUnavailable',
    'continue_run',
    'export_filesystem',
    'export_parquet',
    'fork_run',
    'inspect_recovery',
    'progress_bar',
    'rebuild',
    'verify_paths',
]
