"""A batch as the apply rules see it: its records, what becomes of one, and one run's keys.

The types every part of the applier shares (`_apply.py` re-exports the public ones): a
`SourceRecord` as consumed, `Rejected` (raised by a rule: the record goes to the DLQ),
`Rejection` (a dead letter, with its reason), `BatchOutcome` (what applying a batch did),
and `RunKeys` (what is checked once per Kafka key and batch, and the run's keys, built once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepstream.errors import SchemaError
from stepstream.ids import is_run_id
from stepstream.schemas import STEP_EVENTS, TOOL_EFFECTS
from stepstream.storage import EFFECT, EVENT, RUN, SNAPSHOT, TRANSITION
from stepstream.topics import murmur2_partition

EVENTS, EFFECTS = STEP_EVENTS, TOOL_EFFECTS


@dataclass(slots=True)
class SourceRecord:
    """A record as consumed: where it is in the log, and its bytes.

    Never changed once made; not frozen only because a frozen dataclass is four times slower to
    make, and one is made per record.
    """

    topic: int
    """`EVENTS` or `EFFECTS`."""
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    unreadable: SchemaError | None = None
    """Why a Confluent wire-format record could not be turned into its single-object form (the
    value stays as it was in the log); None for every other record (`projector/_wire.py`)."""

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """(topic, partition, offset): unique in the log."""
        return (self.topic, self.partition, self.offset)


@dataclass(frozen=True, slots=True)
class Rejection:
    """A record that cannot apply, with its reason code and a sentence for people."""

    source: SourceRecord
    reason: str
    detail: str


@dataclass(slots=True)
class BatchOutcome:
    """What applying one batch did."""

    applied: int = 0
    duplicates: int = 0
    dead: list[Rejection] = field(default_factory=list)
    next_offsets: dict[tuple[int, int], int] = field(default_factory=dict)
    """(topic, partition) -> the offset after the batch's last record there."""
    expired_records: int = 0
    """Records of runs retention had dropped already, dropped too."""
    expired_runs: list[str] = field(default_factory=list)
    """The runs retention dropped in this batch."""


class Rejected(Exception):
    """A record that goes to the DLQ, and why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class RunKeys:
    """One Kafka key's records in a batch: what is checked once per key, and the run's keys."""

    __slots__ = (
        'effect',
        'effects',
        'envelope',
        'event',
        'home',
        'key',
        'run',
        'run_id',
        'snapshot',
        'transition',
        'valid',
    )

    def __init__(self, key: bytes | None, partitions: int) -> None:
        self.key = key
        self.run_id: str | None = None
        """The key as text, when it is UTF-8: every accepted record's run_id equals it."""
        self.valid = False
        """Whether the key is a valid run id (so records whose run_id is the key may be)."""
        self.home = -1
        self.effects: dict[bytes, tuple[bytes, ...]] = {}
        """The calls whose effect changed in the batch, with their unresolved keys before it."""
        self.envelope: tuple[Any, ...] = ()
        """The last envelope ids found plainly valid (`_checks._ids_plainly_valid`)."""
        if key is None:
            return
        self.home = murmur2_partition(key, partitions)
        try:
            self.run_id = key.decode()
        except UnicodeDecodeError:
            return
        self.valid = is_run_id(self.run_id)
        if not self.valid:
            return
        self.run = RUN.key(self.run_id)
        self.event: Callable[[int], bytes] = EVENT.under(self.run_id)
        self.transition: Callable[[int], bytes] = TRANSITION.under(self.run_id)
        self.effect: Callable[[str], bytes] = EFFECT.under(self.run_id)
        self.snapshot: Callable[[int], bytes] = SNAPSHOT.under(self.run_id)
