"""The write side: the `StepPersistence` capability and the `EventLog` it appends to."""

from stepstream.ids import check_run_id
from stepstream.producer._capability import ATTEMPT_KEY, SnapshotSaved, StepPersistence, annotate_tool_effect
from stepstream.producer._helpers import current_run_id, is_provider_valid
from stepstream.producer._log import EventLog

__all__ = [
    'ATTEMPT_KEY',
    'EventLog',
    'SnapshotSaved',
    'StepPersistence',
    'annotate_tool_effect',
    'check_run_id',
    'current_run_id',
    'is_provider_valid',
]
