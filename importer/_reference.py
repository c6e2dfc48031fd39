"""A reference store's runs as the importer reads them: plain records, each saying where it was read.

pydantic-ai-harness writes four kinds of record per run (its `RunRecord`, `StepEvent`s,
`ContinuableSnapshot`s and `ToolEffectRecord`s). The readers (`_stores.py`, `_postgres.py`) turn each
into one of the types here, checking every field as they go, so that a damaged record is refused
with the run and the record named (`DamagedStore`) before anything of its run is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import ValidationError
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter

from stepstream.errors import StepStreamError
from stepstream.schemas import REFERENCE_EVENT_KINDS

REFERENCE_EFFECT_STATUSES = frozenset({'started', 'completed', 'failed'})

MEDIA_MARK = '__harness_external_'
"""What every marker the reference's media walker writes into a history starts its keys with."""


class DamagedStore(StepStreamError):
    """A reference store's record that cannot be read (or written): the message names store, run and record.

    Raised before any record of that run is written; the runs before it are on the log whole.
    """


@dataclass(frozen=True, slots=True)
class ReferenceRunRecord:
    """The run's lineage as the reference registered it (its `RunRecord`)."""

    run_id: str
    conversation_id: str | None
    parent_run_id: str | None
    agent_name: str | None
    metadata: dict[str, str]
    started_at: datetime
    registration_id: str | None


@dataclass(frozen=True, slots=True)
class ReferenceEvent:
    """One of the run's step events (the reference's `StepEvent`), in the order it stored them."""

    kind: str
    step_index: int
    timestamp: datetime
    tool_call_id: str | None
    tool_name: str | None
    error: str | None
    metadata: dict[str, str]
    idempotency_key: str | None
    where: str


@dataclass(frozen=True, slots=True)
class ReferenceSnapshot:
    """One retained snapshot (the reference's `ContinuableSnapshot`), its history validated."""

    step_index: int
    timestamp: datetime
    state: Literal['complete', 'interrupted']
    idempotency_key: str | None
    messages: list[ModelMessage]
    where: str


@dataclass(frozen=True, slots=True)
class ReferenceEffect:
    """One ledger record (the reference's `ToolEffectRecord`).

    A SQLite or Postgres store keeps a call's latest, a file store every one it wrote.
    """

    tool_call_id: str
    tool_name: str
    status: Literal['started', 'completed', 'failed']
    started_at: datetime
    ended_at: datetime | None
    idempotency_key: str | None
    effect_summary: str | None
    where: str


@dataclass(slots=True)
class ReferenceRun:
    """Everything the reference store holds of one run, read and checked."""

    run: ReferenceRunRecord
    events: list[ReferenceEvent] = field(default_factory=list)
    snapshots: list[ReferenceSnapshot] = field(default_factory=list)
    effects: list[ReferenceEffect] = field(default_factory=list)

    @property
    def records(self) -> int:
        """How many records of the store this run is made of (its run record included)."""
        return 1 + len(self.events) + len(self.snapshots) + len(self.effects)


class Fields:
    """Typed reads of one stored record's fields, each failure naming the store, run and record."""

    def __init__(self, store: str, run_id: str, where: str, data: dict[str, Any]) -> None:
        """Read `data`, the record at `where` of run `run_id` in `store`."""
        self.store, self.run_id, self.where, self.data = store, run_id, where, data

    def damaged(self, what: str) -> DamagedStore:
        """The error for this record: store, run, record, what is wrong."""
        return damaged(self.store, self.run_id, self.where, what)

    def text(self, name: str) -> str:
        """A required string field."""
        value = self.data.get(name)
        if not isinstance(value, str):
            raise self.damaged(f'{name} is {type(value).__name__}, not text')
        return value

    def optional_text(self, name: str) -> str | None:
        """An optional string field."""
        value = self.data.get(name)
        if value is not None and not isinstance(value, str):
            raise self.damaged(f'{name} is {type(value).__name__}, not text')
        return value

    def integer(self, name: str) -> int:
        """A required integer field."""
        value = self.data.get(name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.damaged(f'{name} is {type(value).__name__}, not an integer')
        return value

    def time(self, name: str) -> datetime:
        """A required ISO 8601 timestamp (one without a zone is read as UTC)."""
        raw = self.text(name)
        return self._parse_time(name, raw)

    def optional_time(self, name: str) -> datetime | None:
        """An optional ISO 8601 timestamp."""
        raw = self.optional_text(name)
        return None if raw is None else self._parse_time(name, raw)

    def _parse_time(self, name: str, raw: str) -> datetime:
        try:
            parsed = datetime.fromisoformat(raw)
        except ValueError:
            raise self.damaged(f'{name} {raw!r:.60} is not an ISO 8601 time') from None
        return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)

    def metadata(self, name: str = 'metadata') -> dict[str, str]:
        """A string-to-string mapping, stored as an object or as its JSON text (None: empty)."""
        value = self.data.get(name)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise self.damaged(f'{name} is not JSON') from None
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise self.damaged(f'{name} is not a mapping of text to text')
        return dict(value)

    def choice(self, name: str, allowed: frozenset[str]) -> str:
        """A string field that must be one of `allowed`."""
        value = self.text(name)
        if value not in allowed:
            raise self.damaged(f'{name} {value!r:.60} is not one of {", ".join(sorted(allowed))}')
        return value


def damaged(store: str, run_id: str | None, where: str, what: str) -> DamagedStore:
    """`DamagedStore` for the record at `where` (of run `run_id`, when known) of `store`."""
    if run_id is None:  # the store as a whole: found before anything is written
        return DamagedStore(f'the reference store {store} is damaged: {where}: {what}; nothing was written')
    return DamagedStore(
        f'the reference store {store} is damaged: run {run_id!r}, {where}: {what}; '
        'nothing of this run was written'
    )


def run_record(fields: Fields) -> ReferenceRunRecord:
    """The run record in `fields` (the reference's `RunRecord`)."""
    return ReferenceRunRecord(
        run_id=fields.text('run_id'),
        conversation_id=fields.optional_text('conversation_id'),
        parent_run_id=fields.optional_text('parent_run_id'),
        agent_name=fields.optional_text('agent_name'),
        metadata=fields.metadata(),
        started_at=fields.time('started_at'),
        registration_id=fields.optional_text('registration_id'),
    )


def event(fields: Fields) -> ReferenceEvent:
    """The step event in `fields` (the reference's `StepEvent`)."""
    return ReferenceEvent(
        kind=fields.choice('kind', REFERENCE_EVENT_KINDS),
        step_index=fields.integer('step_index'),
        timestamp=fields.time('timestamp'),
        tool_call_id=fields.optional_text('tool_call_id'),
        tool_name=fields.optional_text('tool_name'),
        error=fields.optional_text('error'),
        metadata=fields.metadata(),
        idempotency_key=fields.optional_text('idempotency_key'),
        where=fields.where,
    )


def effect(fields: Fields) -> ReferenceEffect:
    """The ledger record in `fields` (the reference's `ToolEffectRecord`)."""
    return ReferenceEffect(
        tool_call_id=fields.text('tool_call_id'),
        tool_name=fields.text('tool_name'),
        status=fields.choice('status', REFERENCE_EFFECT_STATUSES),  # type: ignore[arg-type]
        started_at=fields.time('started_at'),
        ended_at=fields.optional_time('ended_at'),
        idempotency_key=fields.optional_text('idempotency_key'),
        effect_summary=fields.optional_text('effect_summary'),
        where=fields.where,
    )


def snapshot(fields: Fields, history: object) -> ReferenceSnapshot:
    """The snapshot in `fields` with `history`, its messages as JSON values (media restored)."""
    stored = fields.data.get('state')
    state: Literal['complete', 'interrupted']
    if stored is None or stored == 'complete':  # None: written before the reference had the field
        state = 'complete'
    elif stored == 'interrupted':
        state = 'interrupted'
    else:
        raise fields.damaged(f'state {stored!r:.60} is neither complete nor interrupted')
    try:
        messages = ModelMessagesTypeAdapter.validate_python(history)
    except ValidationError as exc:
        first = exc.errors()[0]
        at = '.'.join(str(p) for p in first['loc'])
        raise fields.damaged(
            f'its messages do not validate as Pydantic AI messages ({exc.error_count()} error(s); '
            f'first at {at or "the top"}: {first["msg"]})'
        ) from None
    return ReferenceSnapshot(
        step_index=fields.integer('step_index'),
        timestamp=fields.time('timestamp'),
        state=state,
        idempotency_key=fields.optional_text('idempotency_key'),
        messages=messages,
        where=fields.where,
    )
