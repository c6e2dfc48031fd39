"""The write side: the `StepPersistence` capability, its snapshot writer, and the logs it appends to.

Read top-down: `_capability.py` (the hooks, thin: each hands its step to its run's `RunWriter`;
what its options mean in `_options.py`, its binding to one run in `_binding.py`) -> `_run.py` (a
run's state: its identity, records, durability points) -> `_snapshots.py` (deltas, patches, media
offload; `_redaction.py` and `_secrets.py` redact first) -> `_protocol.py` (the `StepLog` seam and
the rules every log shares) -> `_log.py` (`EventLog`, Kafka; its producer in `_sender.py`) or
`_memory.py` (`InMemoryLog`, tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
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
    from stepstream.producer._marks import conversation_mark, mark_conversation
    from stepstream.producer._memory import InMemoryLog, StoredRecord
    from stepstream.producer._protocol import StepLog
    from stepstream.producer._redaction import REDACTED, REDACTION_KEY, Redaction, Redactor
    from stepstream.producer._resolution import (
        decide_deferred_call,
        decision_for,
        resolution_for,
        resolve_tool_effect,
        resolver_id,
    )
    from stepstream.producer._run import RunWriter
    from stepstream.producer._snapshots import SnapshotWriter
    from stepstream.producer._validity import is_provider_valid

_WHERE = {
    'ATTEMPT_KEY': 'stepstream.producer._capability',
    'FORKED_AT_STEP': 'stepstream.producer._current',
    'FORKED_FROM': 'stepstream.producer._current',
    'REDACTED': 'stepstream.producer._redaction',
    'REDACTION_KEY': 'stepstream.producer._redaction',
    'EventLog': 'stepstream.producer._log',
    'InMemoryLog': 'stepstream.producer._memory',
    'Redaction': 'stepstream.producer._redaction',
    'Redactor': 'stepstream.producer._redaction',
    'SnapshotSaved': 'stepstream.producer._capability',
    'RunWriter': 'stepstream.producer._run',
    'SnapshotWriter': 'stepstream.producer._snapshots',
    'StepLog': 'stepstream.producer._protocol',
    'StepPersistence': 'stepstream.producer._capability',
    'StoredRecord': 'stepstream.producer._memory',
    'annotate_tool_effect': 'stepstream.producer._capability',
    'check_run_id': 'stepstream.ids',
    'current_run_id': 'stepstream.producer._capability',
    'definitions_of': 'stepstream.producer._definitions',
    'fingerprint': 'stepstream.producer._definitions',
    'is_provider_valid': 'stepstream.producer._validity',
    'replaying': 'stepstream.producer._current',
    'conversation_mark': 'stepstream.producer._marks',
    'mark_conversation': 'stepstream.producer._marks',
    'decide_deferred_call': 'stepstream.producer._resolution',
    'decision_for': 'stepstream.producer._resolution',
    'resolution_for': 'stepstream.producer._resolution',
    'resolve_tool_effect': 'stepstream.producer._resolution',
    'resolver_id': 'stepstream.producer._resolution',
}
"""Where each public name lives: imported on first use, so a command pays only for what it uses."""

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
    'RunWriter',
    'SnapshotSaved',
    'SnapshotWriter',
    'StepLog',
    'StepPersistence',
    'StoredRecord',
    'annotate_tool_effect',
    'check_run_id',
    'conversation_mark',
    'current_run_id',
    'decide_deferred_call',
    'decision_for',
    'definitions_of',
    'fingerprint',
    'is_provider_valid',
    'mark_conversation',
    'replaying',
    'resolution_for',
    'resolve_tool_effect',
    'resolver_id',
]

__getattr__ = lazy_exports(__name__, _WHERE)
