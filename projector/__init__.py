"""The read side: the `Projector` that materializes the log, and the queries over it."""

from stepstream.projector._projector import Projector
from stepstream.projector._reader import (
    ProjectionReader,
    RecoveryReport,
    continue_run,
    fork_run,
    inspect_recovery,
)

__all__ = ['ProjectionReader', 'Projector', 'RecoveryReport', 'continue_run', 'fork_run', 'inspect_recovery']
