"""The read side: the `Projector` that materializes the log, and the queries over it."""

from stepstream.projector._projector import Projector
from stepstream.projector._reader import ProjectionReader, continue_run, fork_run

__all__ = ['ProjectionReader', 'Projector', 'continue_run', 'fork_run']
