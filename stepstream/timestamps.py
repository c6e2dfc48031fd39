"""Timestamps as the log carries them: integer microseconds since the Unix epoch, in UTC.

The Avro schemas declare `timestamp` as `timestamp-micros`; the projector keeps the same integer
in its state. Both directions of the conversion live here, once, for every role.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

__all__ = ['EPOCH', 'from_micros', 'micros']

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
"""Microsecond 0."""

_MICROSECOND = timedelta(microseconds=1)


def micros(ts: datetime) -> int:
    """`ts` (timezone-aware) as exact integer microseconds since the epoch.

    ```python
    micros(datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC))  # -> 1_000_000
    ```
    """
    return (ts - EPOCH) // _MICROSECOND


def from_micros(value: int) -> datetime:
    """The UTC `datetime` of `value` microseconds since the epoch; `micros`' inverse."""
    return EPOCH + timedelta(microseconds=value)
