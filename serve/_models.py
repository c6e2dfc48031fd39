"""The API's response models: what every JSON endpoint returns, and so what its OpenAPI schema says.

The wire shape of a read-side record (`RunRecord`, `StepEvent`, `ToolEffectRecord`, ...) is declared
here once, with its descriptions, and read off the record by field name (`FromRecord.of`): there is
no copy written by hand, and tests/test_record_shapes.py fails when a record grows a field that no
shape here, nor its list of internal fields, names.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, Self

from pydantic import AliasPath, BaseModel, ConfigDict, Field

from stepstream.readmodel import ProjectionStatus
from stepstream.schemas import MAX_NOTE_CHARS


class FromRecord(BaseModel):
    """An API shape read off a read-side record by its attributes' names, nested shapes included."""

    model_config = ConfigDict(from_attributes=True)

    @classmethod
    def of(cls, record: object) -> Self:
        """The API shape of `record` (a `RunRecord`, `StepEvent`, ... dataclass)."""
        return cls.model_validate(record, from_attributes=True)


class Usage(FromRecord):
    """What a run used: sums over its model requests and tool calls (events since schema v3)."""

    model_requests: int
    requests: int
    input_tokens: int = Field(description='Including cache reads and writes, as Pydantic AI counts them.')
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    cost_usd: str | None = Field(
        description="The priced requests' costs summed, as exact decimal text; null while none was priced."
    )
    unpriced_requests: int = Field(description='Model requests without a cost: cost_usd leaves them out.')
    model_request_us: int = Field(description='Microseconds spent in model requests.')
    tool_calls: int
    tool_call_failures: int
    tool_call_us: int = Field(description='Microseconds spent in tool bodies.')


class ModelRequestUsage(FromRecord):
    """What one model request used, as Pydantic AI reported it on the response."""

    model_name: str | None
    provider: str | None
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    requests: int
    finish_reason: str | None
    cost_usd: str | None


class Run(FromRecord):
    """Lineage and status of one run."""

    run_id: str
    conversation_id: str | None
    parent_run_id: str | None
    agent_name: str | None
    metadata: dict[str, str]
    started_at: datetime | None
    registration_id: str | None = Field(description='The writer_id that registered the run.')
    status: str = Field(
        description='running | stale (running, but nothing new for STEPSTREAM_STALE_AFTER_S) | completed '
        '| failed | cancelled'
    )
    ended_at: datetime | None
    error: str | None
    event_count: int
    last_seq: int
    gaps: list[tuple[int, int]] = Field(description='Inclusive ranges of seq that never arrived.')
    conflicting_writers: list[str]
    rejected: dict[str, int] = Field(description="This run's records that went to the DLQ, by reason.")
    usage: Usage
    parent_expired: bool = Field(
        default=False, description='The parent run was dropped by the retention policy (docs/retention.md).'
    )


class RunPage(BaseModel):
    """One page of runs and the cursor of the next."""

    runs: list[Run]
    next_after: str | None = Field(
        description='Pass as `after` for the next page; null when this page is the last.'
    )


class Event(FromRecord):
    """One step event; a `snapshot_saved` event names its snapshot but does not carry its messages."""

    run_id: str
    seq: int
    writer_id: str
    timestamp: datetime
    kind: str
    step_index: int
    agent_name: str | None
    conversation_id: str | None
    parent_run_id: str | None
    tool_call_id: str | None
    tool_name: str | None
    error: str | None
    metadata: dict[str, str]
    idempotency_key: str | None
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
    usage: ModelRequestUsage | None = Field(description='For model_request_completed (since schema v3).')
    duration_us: int | None = Field(description='For model request and tool call ends: microseconds taken.')
    trace_id: str | None = Field(description='The OpenTelemetry trace the event was written under.')
    span_id: str | None = Field(description='The OpenTelemetry span the event was written under.')


class Resolution(FromRecord):
    """An operator's resolution of an unknown effect, as the ledger keeps it."""

    resolution: Literal['happened', 'did_not_happen']
    resolved_by: str = Field(description='The operator (their settings, or their OS user).')
    writer_id: str = Field(description='The process that wrote the resolution to the log.')
    resolved_at: datetime
    note: str
    resolves_seq: int = Field(description='The seq of the `started` transition it answers.')
    applied: bool = Field(
        description='Whether it decides the status; false: history only (the effect had ended, or '
        'an earlier resolution decided it).'
    )


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


class Resolved(BaseModel):
    """A resolution written to the log, and the effect as the projection shows it now."""

    written: Resolution
    applied: bool = Field(description='Whether the projection read here shows it already.')
    effect: ToolEffect


class ToolEffect(FromRecord):
    """The merged state of one tool call's side effect."""

    run_id: str
    tool_call_id: str
    tool_name: str
    status: str = Field(description='started | annotated | completed | failed | resolved (by an operator)')
    unknown_after_crash: bool = Field(
        description='No terminal transition and its run is not live (stale, failed or cancelled): '
        'the side effect may or may not have happened.'
    )
    in_flight: bool = Field(
        default=False,
        description='No terminal transition yet, and its run is live: the call may still finish.',
    )
    started_at: datetime | None
    ended_at: datetime | None
    idempotency_key: str | None
    effect_summary: str | None
    error: str | None
    last_seq: int
    resolution: Resolution | None = Field(description="The operator's resolution that decides the status.")
    resolutions: list[Resolution] = Field(description='Every resolution written for the call, oldest first.')


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
        )


class Problem(BaseModel):
    """Why a request failed."""

    detail: str
