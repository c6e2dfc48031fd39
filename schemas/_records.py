"""Read-side records: what the projection hands back (`RunRecord`, `ContinuableSnapshot`, `ToolEffectRecord`).

They carry the field names of their pydantic-ai-harness namesakes, so code written against the
harness reads the same here; they add what a log knows and a single store does not (seq, writer,
gaps). The records that travel on the topics are `_types.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal

from stepstream.schemas._types import (
    ChainStatus,
    Decision,
    Deferral,
    Resolution,
    RunStatus,
    SnapshotState,
    ToolEffectStatus,
)
from stepstream.shapes import internal

if TYPE_CHECKING:  # importing Pydantic AI takes half a second: the CLI's views do without it
    from pydantic_ai.messages import ModelMessage


def _no_metadata() -> dict[str, str]:
    return {}


@dataclass(kw_only=True, slots=True)
class RunUsage:
    """What a run used: the sums over its `model_request_completed` and tool call end events.

    Events written before schema v3 carry no usage and add nothing but their counts.
    """

    model_requests: int = 0
    """`model_request_completed` events."""
    requests: int = 0
    input_tokens: int = 0
    """Including cache reads and writes, as Pydantic AI counts them."""
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cost_usd: str | None = None
    """The sum of the priced requests' costs as exact decimal text; None while none was priced."""
    unpriced_requests: int = 0
    """Model requests with no cost (no price known, or written before v3): `cost_usd` leaves them out."""
    model_request_us: int = 0
    """Time spent in model requests (completed and failed), in microseconds."""
    tool_calls: int = 0
    """Tool calls that ended (`tool_call_completed` or `tool_call_failed`)."""
    tool_call_failures: int = 0
    tool_call_us: int = 0
    """Time spent in tool bodies, in microseconds."""


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """Lineage and status of one run, as the projection knows it."""

    run_id: str
    agent_name: str | None = None
    conversation_id: str | None = None
    parent_run_id: str | None = None
    parent_expired: bool = False
    """The parent run was dropped by the retention policy: the run named by `parent_run_id` is no
    longer in the projection (docs/retention.md)."""
    status: RunStatus = 'running'
    """running | stale (running, but nothing new for STEPSTREAM_STALE_AFTER_S) | waiting (ended with
    deferred calls that wait for an approval, an answer or an outside result) | resumed (ended
    waiting, and another run resumes it: `resumed_by`) | completed | failed
    | cancelled (its task was cancelled, its caller left it, or its process stopped with it open)."""
    started_at: datetime | None = None
    ended_at: datetime | None = None
    error: str | None = None
    metadata: dict[str, str] = field(default_factory=_no_metadata)
    registration_id: str | None = None
    """The `writer_id` that registered the run (its `run_started`)."""
    event_count: int = 0
    """Records applied for this run, across both topics."""
    last_seq: int = -1
    gaps: list[tuple[int, int]] = field(default_factory=list)
    """Inclusive ranges of seq below `last_seq` that never arrived: `[(3, 3), (7, 9)]`."""
    usage: RunUsage = field(default_factory=RunUsage)
    """The sums of its model requests' usage and of its tool calls' durations."""
    conflicting_writers: list[str] = field(default_factory=list)
    """Other writers that claimed this run_id; their records are kept apart."""
    rejected: dict[str, int] = field(default_factory=dict)
    """This run's own records that went to the DLQ, by reason (`seq_jump`, `duplicate_seq`, ...)."""
    last_record_at: datetime | None = field(
        default=None, metadata=internal('`status` is judged by it (stale); the views show the status')
    )
    """When the newest of the run's step events or heartbeats was written (by its writer's clock)."""
    chain: ChainStatus = 'unchained'
    """intact | broken | unchained: whether each record the projection holds of the run links
    (`prev_hash`) to the record before it; unchained for a run written before the hash chain.
    Signatures are checked by `stepstream audit verify`, which reads the topics (docs/audit.md)."""
    chain_break_seq: int | None = None
    """The seq of the first record whose link is not the hash of the record before it (broken)."""
    chain_break_at: str | None = None
    """Where that record stands in the log: `step_events/<partition>` or `tool_effects/<partition>`."""
    resumes: str | None = None
    """The run this run resumes (its `run_started` metadata `stepstream.resumes`, `resume_run`), or None."""
    resumed_by: str | None = None
    """The run that resumes this one, a run that ended waiting (status `resumed`), or None."""
    resumed_at: datetime | None = None
    """When the run that resumes it started to (its `run_resumed` mark's time), or None."""


@dataclass(kw_only=True, slots=True)
class ContinuableSnapshot:
    """A full message history a run can be continued or forked from."""

    run_id: str
    step_index: int
    messages: list[ModelMessage]
    snapshot_seq: int = 0
    seq: int = 0
    conversation_id: str | None = None
    parent_run_id: str | None = None
    agent_name: str | None = None
    timestamp: datetime | None = None
    state: SnapshotState = 'complete'
    idempotency_key: str | None = None
    erased: bool = False
    """True when the content was erased (`stepstream forget`): `messages` is empty, the rest stays."""


@dataclass(kw_only=True, slots=True)
class EffectResolution:
    """An operator's resolution of an effect, or a decision on a deferred call, as the ledger keeps it.

    Applied or not: every one written is kept, in log order.
    """

    resolution: Resolution | Decision
    """happened | did_not_happen (an effect in doubt); approved | denied | returned | failed (a
    deferred call)."""
    resolved_by: str
    """The operator (their settings, or their OS user)."""
    writer_id: str
    """The process that wrote the resolution to the log."""
    resolved_at: datetime
    note: str
    resolves_seq: int
    """The seq of the `started` (or `deferred`) transition it answers."""
    args: str | None = None
    """`approved`: the arguments the call runs with instead of its own (JSON), or None."""
    result: str | None = None
    """`returned`: the outside call's result (JSON)."""
    error: str | None = None
    """`denied`: what the model is told; `failed`: the outside call's error."""
    applied: bool
    """Whether it decides the effect's status: it answers the `started` (a resolution) or `deferred`
    (a decision) transition that is still the effect's latest, and no earlier one did. Otherwise it
    is history only (the effect had ended, or an earlier one decided it)."""


def _no_resolutions() -> list[EffectResolution]:
    return []


@dataclass(kw_only=True, slots=True)
class ToolEffectRecord:
    """The merged state of one tool call's effect: the latest status plus what was annotated."""

    run_id: str
    tool_call_id: str
    tool_name: str
    status: ToolEffectStatus
    """started | annotated | completed | failed | resolved (by an operator) | deferred (waits for an
    approval or an outside result: never in doubt)."""
    in_flight: bool = False
    """Not ended (`started`) and its run is live: the call may still finish. Read, never stored."""
    started_at: datetime | None = None
    ended_at: datetime | None = None
    idempotency_key: str | None = None
    effect_summary: str | None = None
    error: str | None = None
    last_seq: int = -1
    resolution: EffectResolution | None = None
    """The operator's resolution that decides the status (`resolved`), if any."""
    resolutions: list[EffectResolution] = field(default_factory=_no_resolutions)
    """Every resolution written for this call, oldest first: the audit trail."""
    deferral: Deferral | None = None
    """For a `deferred` call: what it waits for: `approval` (a person decides whether it runs),
    `question` (someone gives the content it asks for) or `external` (an outside system gives its result)."""
    args: str | None = None
    """For a `deferred` call: its arguments as a JSON object, redacted as stored."""
    deferral_metadata: str | None = None
    """For a `deferred` call: the metadata its tool gave when it deferred, as JSON (None for none)."""
    content_erased: bool = False
    """Its content was sealed (erasure on) and `stepstream forget` destroyed the key: its arguments,
    metadata and its decisions' arguments, results and messages read as None. Read, never stored."""
    status_seq: int = field(
        default=-1, metadata=internal("what a resolution answers: the resolution's `resolves_seq` shows it")
    )
    """The seq of the transition that decides the status (for `started`: what a resolution answers)."""

    @property
    def unknown_after_crash(self) -> bool:
        """Not ended, and its run is not live (stale, failed, cancelled): it may or may not have happened.

        A call `in_flight` is not: its writer is alive and may still record its end.
        """
        return self.status == 'started' and not self.in_flight

    @property
    def doubt(self) -> Literal['in_flight', 'unknown_after_crash'] | None:
        """What an unended call is: `in_flight` or `unknown_after_crash`; None once it ended."""
        if self.status != 'started':
            return None
        return 'in_flight' if self.in_flight else 'unknown_after_crash'
