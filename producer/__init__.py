"""The write side: the `StepPersistence` capability, its snapshot writer, and the logs it appends to.

Read top-down: `_capability.py` (the hooks, thin: each hands its step to its run's `RunWriter`;
what its options mean in `_options.py`, its binding to one run in `_binding.py`) -> `_run.py` (a
run's state: its identity, records, durability points) -> `_snapshots.py` (deltas, patches, media
offload; `_redaction.py` and `_secrets.py` redact first) -> `_protocol.py` (the `StepLog` seam and
the rules every log shares) -> `_log.py` (`EventLog`, Kafka; its producer in `_sender.py`) or
`_memory.py` (`InMemoryLog`, tests).
"""

from stepstream.ids import check_run_id
from stepstream.producer._capability import (
    ATTEMPT_KEY,
    SnapshotSaved,
    StepPersistence,
    annotate_tool_effect,
    current_run_id,
)
from stepstream.producer._current import FORKED_AT_STEP, FORKED_FROM, replaying
from stepstream.producer._definitions import definitions_of, fingerprint
from stepstream.producer._log import EventLog
from stepstream.producer._memory import InMemoryLog, StoredRecord
from stepstream.producer._protocol import StepLog
from stepstream.producer._redaction import REDACTED, REDACTION_KEY, Redaction, Redactor
from stepstream.producer._resolution import resolution_for, resolve_tool_effect, resolver_id
from stepstream.producer._snapshots import SnapshotWriter
from stepstream.producer._validity import is_provider_valid

__all__ = [
    'ATTEMPT_KEY',
    'FORKED_AT_STEP',
    'FORKED_FROM',
    'REDACTED',
    'REDACTION_KEY',
    'EventLog',
    'InMemoryLog',
    'Redaction',
    'Redactor',
    'SnapshotSaved',
    'SnapshotWriter',
    'StepLog',
    'StepPersistence',
    'StoredRecord',
    'annotate_tool_effect',
    'check_run_id',
    'current_run_id',
    'definitions_of',
    'fingerprint',
    'is_provider_valid',
    'replaying',
    'resolution_for',
    'resolve_tool_effect',
    'resolver_id',
]
