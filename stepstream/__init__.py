"""stepstream: durable, auditable step persistence for Pydantic AI agents on a Kafka log.

The top-level package holds the pieces every part shares: `Settings` and the error types.
Producer, projector, schemas and media live in their own subpackages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.errors import (
        MediaUnavailable,
        ProjectionInUse,
        ProjectionMismatch,
        RecordTooLarge,
        SchemaError,
        SchemaRegistryError,
        StepStreamError,
        StepStreamUnavailable,
        UsageError,
    )
    from stepstream.settings import Settings

_WHERE = {
    'MediaUnavailable': 'stepstream.errors',
    'ProjectionInUse': 'stepstream.errors',
    'ProjectionMismatch': 'stepstream.errors',
    'RecordTooLarge': 'stepstream.errors',
    'SchemaError': 'stepstream.errors',
    'SchemaRegistryError': 'stepstream.errors',
    'Settings': 'stepstream.settings',
    'StepStreamError': 'stepstream.errors',
    'StepStreamUnavailable': 'stepstream.errors',
    'UsageError': 'stepstream.errors',
}
"""Where each public name lives: imported on first use, so a command pays only for what it uses."""

__all__ = [
    'MediaUnavailable',
    'ProjectionInUse',
    'ProjectionMismatch',
    'RecordTooLarge',
    'SchemaError',
    'SchemaRegistryError',
    'Settings',
    'StepStreamError',
    'StepStreamUnavailable',
    'UsageError',
]

__getattr__ = lazy_exports(__name__, _WHERE)
