"""The audit: verify from the topics alone that every run is exactly what its writers wrote.

`audit_log` reads the log (any topic prefix: a copy verifies like the original) and reports,
per run, integrity (the hash chain, the order, the writers' signatures) and completeness
(against a checkpoint, and whether the run ended); `take_checkpoint` signs what the log holds
now. The threat model and the routine are in docs/audit.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.audit._chains import RunIntegrity, verify_run
    from stepstream.audit._checkpoint import Checkpoint, put_checkpoint_s3, take_checkpoint
    from stepstream.audit._records import Break, Seen
    from stepstream.audit._verify import AuditReport, RunVerdict, audit_log

_WHERE = {
    'AuditReport': 'stepstream.audit._verify',
    'Break': 'stepstream.audit._records',
    'Checkpoint': 'stepstream.audit._checkpoint',
    'RunIntegrity': 'stepstream.audit._chains',
    'RunVerdict': 'stepstream.audit._verify',
    'Seen': 'stepstream.audit._records',
    'audit_log': 'stepstream.audit._verify',
    'put_checkpoint_s3': 'stepstream.audit._checkpoint',
    'take_checkpoint': 'stepstream.audit._checkpoint',
    'verify_run': 'stepstream.audit._chains',
}
"""Where each public name lives: imported on first use, so a command pays only for what it uses."""

__all__ = [
    'AuditReport',
    'Break',
    'Checkpoint',
    'RunIntegrity',
    'RunVerdict',
    'Seen',
    'audit_log',
    'put_checkpoint_s3',
    'take_checkpoint',
    'verify_run',
]

__getattr__ = lazy_exports(__name__, _WHERE)
