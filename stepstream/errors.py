"""Errors a user of stepstream can meet, each saying what happened and what to do."""

from __future__ import annotations


class StepStreamError(Exception):
    """Base class of every stepstream error."""


class StepStreamUnavailable(StepStreamError):
    """The Kafka cluster did not answer or did not acknowledge a write in time.

    Raised at durability points (a tool's `started` transition, a snapshot, the end of a run):
    the run fails rather than continue without its record.
    """


class RecordTooLarge(StepStreamError):
    """A record is still above the size limit after its large parts were moved to media."""


class MediaUnavailable(StepStreamError):
    """The media store (S3) could not be reached or refused the request."""


class SchemaError(StepStreamError):
    """Bytes that are not a stepstream record, or a record of an unknown schema."""
