"""The audit: verify from the topics alone that every run is exactly what its writers wrote.

`audit_log` reads the log (any topic prefix: a copy verifies like the original) and reports,
per run, integrity (the hash chain, the order, the writers' signatures) and completeness
(against a checkpoint, and whether the run ended); `take_checkpoint` signs what the log holds
now. The threat model and the routine are in docs/audit.md.
"""

from stepstream.audit._chains import Break, RunIntegrity, Seen, verify_run
from stepstream.audit._checkpoint import Checkpoint, put_checkpoint_s3, take_checkpoint
from stepstream.audit._verify import AuditReport, RunVerdict, audit_log

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
