"""stepstream: durable, auditable step persistence for Pydantic AI agents on a Kafka log.

The top-level package holds the pieces every part shares: `Settings` and the error types.
Producer, projector, schemas and media live in their own subpackages.
"""

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
