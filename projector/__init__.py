"""The `Projector` that materializes the log into shards, and the tools over them (rebuild, verify).

It writes the shards through `stepstream.storage`; the queries over them are the read model's
(`stepstream.readmodel`), which reads the same shards and which this package never imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.projector._dead_letters import DeadLetterHeaders
    from stepstream.projector._membership import Membership
    from stepstream.projector._observe import DEFAULT_MAX_LAG, ProjectorObserver
    from stepstream.projector._options import GroupMember, ProjectorParts, Rebuilding
    from stepstream.projector._projector import Projector
    from stepstream.projector._rebuild import progress_bar, rebuild
    from stepstream.projector._verify import Difference, verify_paths

_WHERE = {
    'DEFAULT_MAX_LAG': 'stepstream.projector._observe',
    'DeadLetterHeaders': 'stepstream.projector._dead_letters',
    'Difference': 'stepstream.projector._verify',
    'GroupMember': 'stepstream.projector._options',
    'Membership': 'stepstream.projector._membership',
    'Projector': 'stepstream.projector._projector',
    'ProjectorObserver': 'stepstream.projector._observe',
    'ProjectorParts': 'stepstream.projector._options',
    'Rebuilding': 'stepstream.projector._options',
    'progress_bar': 'stepstream.projector._rebuild',
    'rebuild': 'stepstream.projector._rebuild',
    'verify_paths': 'stepstream.projector._verify',
}
"""Where each public name lives: imported on first use, so a command pays only for what it uses."""

__all__ = [
    'DEFAULT_MAX_LAG',
    'DeadLetterHeaders',
    'Difference',
    'GroupMember',
    'Membership',
    'Projector',
    'ProjectorObserver',
    'ProjectorParts',
    'Rebuilding',
    'progress_bar',
    'rebuild',
    'verify_paths',
]

__getattr__ = lazy_exports(__name__, _WHERE)
