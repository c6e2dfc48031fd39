"""The API's response models: what every JSON endpoint returns, and so what its OpenAPI schema says.

A read-side record (`RunRecord`, `StepEvent`, `ToolEffectRecord`, ...) is declared once, in
stepstream.schemas; its API shape derives from that declaration (`shows`): a field, its type and
its description (the field's docstring) come from the record, and a field the record declares
`internal` is left out. A shape declares only what the record does not have (a property shown as
a field). So a field added to a record shows in the API, the explorer's JSON and the OpenAPI
schema with nothing else to write.
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    Self,
    TypeVar,
    Union,
    cast,
    get_args,
    get_origin,
    get_type_hints,
)

from pydantic import AliasPath, BaseModel, ConfigDict, Field, create_model

from stepstream.readmodel import ProjectionStatus, RunCounts, WaitingCall
from stepstream.schemas import (
    DEFERRALS,
    MAX_NOTE_CHARS,
    RUN_STATUSES,
    EffectResolution,
    ModelUsage,
    RunRecord,
    RunUsage,
    StepEvent,
    ToolEffectRecord,
)
from stepstream.shapes import field_docs, plain_type, shown_fields


class FromRecord(BaseModel):
    """An API shape read off a read-side record by its attributes' names, nested shapes included."""

    model_config = ConfigDict(from_attributes=True)

    @classmethod
    def of(cls, record: object) -> Self:
        """The API shape of `record` (a `RunRecord`, `StepEvent`, ... dataclass)."""
        return cls.model_validate(record, from_attributes=True)


_SHAPES: dict[type, type[FromRecord]] = {}
"""Each record type that has an API shape, and its shape: a nested record is shown as its shape."""

_Shape = TypeVar('_Shape', bound=FromRecord)


def shows(record: type) -> Callable[[type[_Shape]], type[_Shape]]:
    """Make the decorated class the API shape of the dataclass `record`, derived from its declaration.

    The shape has one field per field of `record` that is not `internal` (stepstream.shapes), in
    its order, with its type (a `Literal` shown as `str`, a nested record as that record's shape)
    and its docstring as the description; every field is required (a response always carries it).
    The class body declares only what is not a field of the record: values derived from it (a
    property, a nested attribute), appended after the record's fields.
    """

    def make(declared: type[_Shape]) -> type[_Shape]:
        hints = get_type_hints(record)
        docs = field_docs(record)
        made: dict[str, Any] = {}
        for f in shown_fields(record):
            made[f.name] = (_shown_type(hints[f.name]), Field(description=docs.get(f.name)))
        for name, info in declared.model_fields.items():
            if name in made:
                raise TypeError(
                    f'{declared.__name__}.{name} is a field of {record.__name__}: declare it there'
                )
            made[name] = (info.annotation, info)
        shape: type[FromRecord] = create_model(
            declared.__name__, __base__=FromRecord, __doc__=declared.__doc__, __module__=__name__, **made
        )
        _SHAPES[record] = shape
        return cast('type[_Shape]', shape)

    return make


def _shown_type(annotation: Any) -> Any:
    """How the API shows a record field's type: records as their shapes, the rest as `plain_type`."""
    if annotation in _SHAPES:
        return _SHAPES[annotation]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        return Union[tuple(_shown_type(a) for a in args)]  # noqa: UP007 (built from a tuple)
    if origin is list:
        return list[_shown_type(args[0])]  # type: ignore[misc]
    return plain_type(annotation)


if TYPE_CHECKING:  # to the type checker, a shape has its record's attributes: they are its fields
    _RunUsage = RunUsage
    _ModelUsage = ModelUsage
    _RunRecord = RunRecord
    _StepEvent = StepEvent
    _EffectResolution = EffectResolution
    _ToolEffectRecord = ToolEffectRecord
    _RunCounts = RunCounts
    _WaitingCall = WaitingCall
else:
    _RunUsage = _ModelUsage = _RunRecord = _StepEvent = _EffectResolution = _ToolEffectRecord = _RunCounts = (
        _WaitingCall
    ) = object


@shows(RunUsage)
class Usage(FromRecord, _RunUsage):
    """What a run used: sums over its model requests and tool calls (events since schema v3)."""


@shows(ModelUsage)
class ModelRequestUsage(FromRecord, _ModelUsage):  # type: ignore[misc]  # (the record is frozen)
    """What one model request used, as Pydantic AI reported it on the response."""


@shows(RunRecord)
class Run(FromRecord, _RunRecord):
    """Lineage and status of one run."""


class RunPage(BaseModel):
    """One page of runs and the cursor of the next."""

    runs: list[Run]
    next_after: str | None = Field(
        description='Pass as `after` for the next page; null when this page is the last.'
    )


@shows(StepEvent)
class Event(FromRecord, _StepEvent):  # type: ignore[misc]  # (the record is frozen)
    """One step event; a `snapshot_saved` event names its snapshot but does not carry its messages."""

    snapshot_seq: int | None = Field(
        default=None,
        validation_alias=AliasPath('snapshot', 'snapshot_seq'),
        description='For snapshot_saved: the snapshot it saved.',
    )
    snapshot_state: str | None = Field(
        default=None,
        validation_alias=AliasPath('snapshot', 'state'),
        description='For snapshot_saved: complete | interrupted.',
    )


@shows(EffectResolution)
class Resolution(FromRecord, _EffectResolution):
    """An operator's resolution of an unknown effect, as the ledger keeps it."""


class ResolveRequest(BaseModel):
    """An operator's answer to an `unknown_after_crash` effect."""

    resolution: Literal['happened', 'did_not_happen'] = Field(
        description='Whether the side effect happened (found it done) or did not (safe to retry).'
    )
    note: str = Field(min_length=1, max_length=MAX_NOTE_CHARS, description='Why: what was checked.')
    operator: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="Who resolves it; default: the service's STEPSTREAM_OPERATOR (or its OS user).",
    )
    force: bool = Field(
        default=False,
        description='Resolve a call that is still in flight (its run is live): only when you know '
        'its process is gone.',
    )


@shows(ToolEffectRecord)
class ToolEffect(FromRecord, _ToolEffectRecord):
    """The merged state of one tool call's side effect."""

    unknown_after_crash: bool = Field(
        description='No terminal transition and its run is not live (stale or ended): the side effect '
        'may or may not have happened. Never a `deferred` call: it waits, it is not in doubt.'
    )


class Resolved(BaseModel):
    """A resolution written to the log, and the effect as the projection shows it now."""

    written: Resolution
    applied: bool = Field(description='Whether the projection read here shows it already.')
    effect: ToolEffect


@shows(WaitingCall)
class Deferred(FromRecord, _WaitingCall):  # type: ignore[misc]  # (the record is frozen)
    """A deferred call that waits for a decision (`effect`: the whole call), and the call's own facts."""

    run_id: str = Field(validation_alias=AliasPath('effect', 'run_id'))
    tool_call_id: str = Field(validation_alias=AliasPath('effect', 'tool_call_id'))
    tool_name: str = Field(validation_alias=AliasPath('effect', 'tool_name'))
    kind: str | None = Field(
        validation_alias=AliasPath('effect', 'deferral'),
        description="What it waits for: approval | question | external (the effect's `deferral`).",
    )
    args: str | None = Field(
        validation_alias=AliasPath('effect', 'args'), description='Its arguments (JSON), redacted as stored.'
    )
    deferral_metadata: str | None = Field(
        validation_alias=AliasPath('effect', 'deferral_metadata'),
        description='The metadata its tool deferred it with (JSON), or null.',
    )
    content_erased: bool = Field(
        default=False,
        validation_alias=AliasPath('effect', 'content_erased'),
        description='Its arguments and metadata were sealed and their key destroyed (`stepstream forget`): '
        'both read as null.',
    )
    waited_s: float = Field(default=0.0, description='Seconds it had waited when this answer was made.')


class DeferredPage(BaseModel):
    """One page of the calls that wait, and the cursor of the next."""

    calls: list[Deferred]
    next_after: str | None = Field(
        description='Pass as `after` for the next page; null when this page is the last.'
    )


class Decided(BaseModel):
    """A decision written to the log (the one that decides the call), and the call as shown now."""

    written: Resolution
    applied: bool = Field(
        description='Whether the projection read here shows it already (false: answered 202, before it did).'
    )
    effect: ToolEffect


class DecisionConflict(BaseModel):
    """Why a decision does not decide the call: it does not wait, or an earlier decision won."""

    detail: str
    decision: Resolution | None = Field(
        default=None, description='The decision that stands; null when the call was never deferred.'
    )
    written: Resolution | None = Field(
        default=None, description="This request's decision, when it was written after the one that stands."
    )


class SnapshotSummary(BaseModel):
    """A retained snapshot, without its messages."""

    run_id: str
    snapshot_seq: int
    seq: int
    step_index: int
    state: str = Field(description='complete | interrupted')
    timestamp: datetime | None
    idempotency_key: str | None
    message_count: int
    erased: bool = Field(
        default=False,
        description='The content was erased (`stepstream forget`): no messages, the rest stays.',
    )


class Snapshot(SnapshotSummary):
    """A snapshot with its full message history."""

    messages: list[dict[str, Any]] = Field(
        description=(
            "Pydantic AI's JSON of the history (`ModelMessagesTypeAdapter.validate_python` reads it "
            'back). Offloaded binaries are URL parts (`image-url`, `document-url`, ...) whose `url` is '
            "this service's `/api/media/{sha256}` or the media store's public URL."
        )
    )


class SnapshotPage(BaseModel):
    """One page of a run's snapshots, oldest first."""

    snapshots: list[SnapshotSummary]
    next_after: int | None = Field(description='Pass as `after` for the next page; null on the last.')


class TreeNode(BaseModel):
    """A run in a lineage tree, with its depth below the tree's top."""

    depth: int
    run: Run


class Lineage(BaseModel):
    """A run's place in its lineage: the root of it, and the whole tree under that root."""

    root: Run
    tree: list[TreeNode] = Field(description='Depth first, children in the order they started.')


class DeadLetter(BaseModel):
    """A record the projector could not apply, as it sits in the `{prefix}.dlq` topic."""

    partition: int
    offset: int
    timestamp: datetime | None
    reason: str | None
    detail: str | None
    source_topic: str | None
    source_partition: int | None
    source_offset: int | None
    key: str | None = Field(description='The source record key (the run_id) when it is UTF-8.')
    value_bytes: int
    envelope: bool = Field(description='The record was too large: the value is a JSON summary of it.')


class DeadLetters(BaseModel):
    """The newest dead letters of every DLQ partition, newest first."""

    entries: list[DeadLetter]
    total: int = Field(description='Records the DLQ topic holds (its end offsets minus its start).')
    error: str | None = Field(description='Why the DLQ could not be read, if it could not.')


@shows(RunCounts)
class Counts(FromRecord, _RunCounts):  # type: ignore[misc]  # (the record is frozen)
    """How many runs read each status and belong to each agent, and how many calls are in doubt."""


def counts_total(parts: list[Counts]) -> Counts:
    """The sum of several members' counts."""
    by_status: Counter[str] = Counter()
    by_agent: Counter[str] = Counter()
    waiting: Counter[str] = Counter()
    for part in parts:
        by_status.update(part.by_status)
        by_agent.update(part.by_agent)
        waiting.update(part.waiting_calls)
    return Counts(
        by_status={s: by_status[s] for s in RUN_STATUSES},
        by_agent=dict(sorted(by_agent.items())),
        unresolved_effects=sum(p.unresolved_effects for p in parts),
        broken_chains=sum(p.broken_chains for p in parts),
        waiting_calls={kind: waiting[kind] for kind in sorted(DEFERRALS)},
    )


class PartitionLag(BaseModel):
    """How far one partition's shard is behind its topic."""

    topic: str
    partition: int
    applied: int = Field(description='The next offset the projection will apply.')
    end: int | None = Field(description='The topic partition end offset; null if the broker did not answer.')
    lag: int | None
    projector_pid: int | None = Field(
        default=None, description="The pid of the projector applying this partition's shard; null: none does."
    )
    last_batch_at: datetime | None = Field(
        default=None, description='When a projector last committed a batch to the shard.'
    )


class Status(BaseModel):
    """Where the projection stands."""

    state: str | None = Field(description='live | rebuilding | rebuilt; null before the first start.')
    topic_prefix: str | None
    partitions: list[PartitionLag]
    total_lag: int | None
    applied_per_second: float
    updated_at: datetime | None
    dead_lettered: int
    dead_lettered_by_reason: dict[str, int]
    conflicting_runs: int
    parked_records: int
    shards: list[int]
    missing_shards: list[int]
    broker_error: str | None = Field(description='Why the end offsets are missing, when they are.')
    runs: Counts | None = Field(
        default=None,
        description="This service's shards' counts (a group member's own); null: a shard here predates "
        'the counts (rebuild it) or is missing. `GET /api/counts` sums a whole group.',
    )

    @classmethod
    def of(cls, status: ProjectionStatus, partitions: list[PartitionLag], broker_error: str | None) -> Status:
        """The API shape of a `ProjectionStatus` with the lag the broker told."""
        lags = [p.lag for p in partitions]
        return cls(
            state=status.state,
            topic_prefix=status.topic_prefix,
            partitions=partitions,
            total_lag=None if not lags or None in lags else sum(lag for lag in lags if lag is not None),
            applied_per_second=status.applied_per_second,
            updated_at=status.updated_at,
            dead_lettered=status.dead_lettered,
            dead_lettered_by_reason=status.dead_lettered_by_reason,
            conflicting_runs=status.conflicting_runs,
            parked_records=status.parked_records,
            shards=status.shards,
            missing_shards=status.missing_shards,
            broker_error=broker_error,
            runs=None if status.runs is None else Counts.of(status.runs),
        )


class Problem(BaseModel):
    """Why a request failed."""

    detail: str
