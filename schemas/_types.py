"""Record types: what travels on the topics.

The wire records (`StepEvent`, `ToolEffectTransition`) are what the `.avsc` files describe, with
the values their fields take. What the projection hands back is `_records.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from stepstream.shapes import internal

if TYPE_CHECKING:  # importing Pydantic AI takes half a second: the CLI's views do without it
    pass

EventKind = Literal[
    'run_started',
    'run_completed',
    'run_failed',
    'run_cancelled',
    'run_waiting',
    'model_request_started',
    'model_request_completed',
    'model_request_failed',
    'tool_call_started',
    'tool_call_completed',
    'tool_call_failed',
    'tool_call_deferred',
    'snapshot_saved',
    'run_heartbeat',
    'chain_signed',
    'run_resumed',
    'conversation_marked',
]
"""Boundary that produced a `StepEvent`; `run_heartbeat` is no boundary but the writer saying it is alive.

A heartbeat takes no `seq` (its `seq` is the one the writer's next record will take) and is not an
event of the run's trail: the projector only reads its timestamp (docs/decisions/0026-writer-liveness.md).
Nor is `chain_signed`, the writer's signature of its run's chain head at a durability point
(`stepstream.signing`): its `seq` is the number of records the head covers, its `prev_hash` the head.
Nor is `run_resumed`, which another run's writer appends, keyed by a run that ended waiting, when it
starts to resume it: its metadata names the resuming run (`RESUMED_BY_KEY`), its `seq` is 0
(docs/decisions/0057-resumed-runs.md). Nor is `conversation_marked`, which anyone may append keyed by
a run of a conversation to title or archive the conversation: its metadata holds `TITLE_KEY` and
`ARCHIVED_KEY`, its `seq` is 0 (docs/decisions/0062-conversations-as-a-view.md)."""

UNCHAINED_KINDS = frozenset({'run_heartbeat', 'chain_signed', 'run_resumed', 'conversation_marked'})
"""Step event kinds appended beside a run's trail: they take no `seq` and are not chained."""

RESUMES_KEY = 'stepstream.resumes'
"""The `run_started` metadata key of a run that resumes another: the run id it resumes."""

PARENT_CALL_KEY = 'stepstream.parent_call'
"""The `run_started` metadata key of a delegate started inside a tool body of its parent run: that
call's `tool_call_id`, so that the parent's call links the exact child it started."""

TITLE_KEY = 'stepstream.title'
"""The `conversation_marked` metadata key: the conversation's title (at most `MAX_TITLE_CHARS`)."""

ARCHIVED_KEY = 'stepstream.archived'
"""The `conversation_marked` metadata key: `true` (archived) or `false` (listed again)."""

MAX_TITLE_CHARS = 200
"""The longest title a conversation may be given."""

RESUMED_BY_KEY = 'stepstream.resumed_by'
"""The `run_resumed` metadata key: the run id that resumes the run the mark is keyed by."""

EVENT_KINDS: frozenset[str] = frozenset(EventKind.__args__)  # type: ignore[attr-defined]

REFERENCE_EVENT_KINDS: frozenset[str] = frozenset(
    {
        'run_started',
        'run_completed',
        'run_failed',
        'model_request_started',
        'model_request_completed',
        'model_request_failed',
        'tool_call_started',
        'tool_call_completed',
        'tool_call_failed',
    }
)
"""The event kinds the reference (pydantic-ai-harness's step persistence) records, each one of ours:
what `stepstream import` reads and `stepstream.reference` answers with (docs/migrating.md)."""

ToolEffectStatus = Literal['started', 'annotated', 'completed', 'failed', 'resolved', 'deferred']
"""A tool call's effect status. `started` as the latest transition means the call has not ended:
`in_flight` while its run is live, `unknown_after_crash` once it is not;
`resolved` (schema v2) is an operator's answer to that: the effect `happened` or `did_not_happen`;
`deferred` (schema v4): the call waits for a person's approval, an answer or an outside system's
result (`Deferral`), which its run ended without: never in doubt
(docs/decisions/0053-deferred-calls-and-waiting.md)."""

TOOL_EFFECT_STATUSES: frozenset[str] = frozenset(ToolEffectStatus.__args__)  # type: ignore[attr-defined]

Deferral = Literal['approval', 'question', 'external']
"""What a `deferred` call waits for, as Pydantic AI's `DeferredToolKind` says: `approval`
(`requires_approval=True`, `ApprovalRequired`: a person decides whether it runs), `question`
(`CallDeferred(kind='question')`: someone gives the content it asks for) or `external` (`CallDeferred`:
an outside system gives its result)."""

DEFERRALS: frozenset[str] = frozenset(Deferral.__args__)  # type: ignore[attr-defined]

SnapshotState = Literal['complete', 'interrupted']
"""`complete`: every tool call has its result. `interrupted`: captured with tool work open."""

Resolution = Literal['happened', 'did_not_happen']
"""What an operator found out about an `unknown_after_crash` effect."""

RESOLUTIONS: frozenset[str] = frozenset(Resolution.__args__)  # type: ignore[attr-defined]

Decision = Literal['approved', 'denied', 'returned', 'failed']
"""A person's or an outside system's answer to a `deferred` call (schema v5), written as a
`resolved` transition that answers the call's `deferred` one: `approved` (it runs, with `args` in
place of its own when given), `denied` (it does not; the model sees `error`), `returned` (an outside
call's `result`, JSON) or `failed` (an outside call's `error`). The first one in the log decides
(docs/decisions/0056-decisions-on-the-log.md)."""

DECISIONS: frozenset[str] = frozenset(Decision.__args__)  # type: ignore[attr-defined]

MAX_NOTE_CHARS = 4000
"""The longest note a resolution may carry; the projector refuses longer ones as `invalid`."""

RunStatus = Literal['running', 'stale', 'waiting', 'resumed', 'completed', 'failed', 'cancelled']
"""A run's status. `stale` is never stored: a reader derives it from a `running` run's last record
time (its writer's heartbeats included, docs/decisions/0026-writer-liveness.md). `waiting`: the run
ended with `DeferredToolRequests`, its deferred calls waiting for a decision or a result; its last
snapshot holds the history to resume from (docs/decisions/0053-deferred-calls-and-waiting.md).
`resumed`: a run that ended waiting, which another run resumes (its `run_resumed` mark, decision 0057)."""

RUN_STATUSES: tuple[str, ...] = RunStatus.__args__  # type: ignore[attr-defined]
"""Every `RunStatus`, in the order the views show them."""

ChainStatus = Literal['intact', 'broken', 'unchained']
"""Whether a run's records form its hash chain (decision 0048): `unchained` for a run written before it."""

CHAIN_STATUSES: tuple[str, ...] = ChainStatus.__args__  # type: ignore[attr-defined]
"""Every `ChainStatus`."""


def _no_metadata() -> dict[str, str]:
    return {}


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotDelta:
    """A snapshot as the log stores it: what it shares with the previous one, and the new tail.

    The full history is `patched(previous_messages)[:prefix_len] + tail`; for an append-only history
    the tail is only what the last step added, so the log grows linearly with the run.
    """

    snapshot_seq: int
    state: SnapshotState
    prefix_len: int
    messages: str
    """JSON list of the tail's `ModelMessage`s (Pydantic AI's own JSON)."""
    patch: str | None = None
    """Since schema v2: fields Pydantic AI stamped on earlier messages after the previous snapshot.

    A JSON list of `{"at": index, "set": {field: JSON value}}`, applied to the previous history
    before its first `prefix_len` messages are kept; None when nothing was stamped. It saves
    re-sending a whole message (a folded tool-return request gets its `timestamp`, `run_id`,
    `conversation_id` and `instructions` once it is sent). See docs/decisions/0019-snapshot-patches.md.
    """
    media: list[str] | None = None
    """Since schema v4: the URI of every object the writer put in the media store for this tail.

    Sorted, each once; plain or sealed, any part type or nesting, the references inside a JSON
    payload included; empty when nothing was offloaded. The walk that offloaded them lists them
    (`stepstream.media.offload_media`), so nobody has to find them in the content. None from an
    earlier writer: `stepstream.media.snapshot_media` then reads them from `messages`.
    """


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelUsage:
    """Since schema v3: what one model request used, as Pydantic AI reported it on its response.

    Token counts follow `pydantic_ai.usage.RequestUsage` (`input_tokens` includes the cache reads
    and writes). `cost_usd` is `RequestUsage.cost` as decimal text, None where it could not be
    priced: money stays exact through the log and the per-run sums.
    """

    model_name: str | None = None
    provider: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    requests: int = 1
    finish_reason: str | None = None
    cost_usd: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StepEvent:
    """One boundary of an agent run, as written to `{prefix}.step-events`."""

    run_id: str
    seq: int
    writer_id: str
    timestamp: datetime
    kind: EventKind
    step_index: int = 0
    agent_name: str | None = None
    conversation_id: str | None = None
    parent_run_id: str | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    error: str | None = None
    metadata: dict[str, str] = field(default_factory=_no_metadata)
    idempotency_key: str | None = None
    snapshot: SnapshotDelta | None = field(
        default=None, metadata=internal("the views name an event's snapshot (seq, state), not its content")
    )
    usage: ModelUsage | None = None
    """Since schema v3, on `model_request_completed`: the response's model, tokens and cost."""
    duration_us: int | None = None
    """Since schema v3, on model request and tool call ends: how long it took, in microseconds (the
    writer's monotonic clock)."""
    trace_id: str | None = None
    """Since schema v3: the OpenTelemetry trace the event was written under, as 32 hex digits."""
    span_id: str | None = None
    """Since schema v3: the OpenTelemetry span the event was written under, as 16 hex digits."""
    prev_hash: str | None = field(
        default=None, metadata=internal("a link of the run's hash chain, checked by an audit, not read")
    )
    """Since schema v5: SHA-256 (hex) of the Avro body of the run's previous record (`chain_hash`); None on
    a run's first record, heartbeats and resolutions, and from earlier writers (unchained)."""
    request_fingerprint: str | None = field(
        default=None, metadata=internal('what a model request was made with, read by replay')
    )
    """Since schema v6, on `model_request_started`: SHA-256 (hex) of `request_definitions`' JSON."""
    request_definitions: str | None = field(
        default=None, metadata=internal('what a model request was made with, read by replay')
    )
    """Since schema v6, on `model_request_started` when the fingerprint changed (always the run's first):
    the tools' definitions, the output mode and tools and the model settings, as canonical JSON."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolEffectTransition:
    """One status change of a tool call's side effect, as written to `{prefix}.tool-effects`."""

    run_id: str
    seq: int
    writer_id: str
    timestamp: datetime
    tool_call_id: str
    tool_name: str
    status: ToolEffectStatus
    agent_name: str | None = None
    conversation_id: str | None = None
    parent_run_id: str | None = None
    idempotency_key: str | None = None
    effect_summary: str | None = None
    error: str | None = None
    resolution: Resolution | Decision | None = None
    """Since schema v2, `resolved` only: what the operator found out; since v5, or the `Decision` on a
    deferred call."""
    resolved_by: str | None = None
    """Since schema v2, `resolved` only: the operator (the `writer_id` is the process that wrote it)."""
    note: str | None = None
    """Since schema v2, `resolved` only: why, in the operator's words."""
    prev_hash: str | None = field(
        default=None, metadata=internal("a link of the run's hash chain, checked by an audit, not read")
    )
    """Since schema v3: SHA-256 (hex) of the Avro body of the run's previous record (`chain_hash`); None on
    a run's first record, heartbeats and resolutions, and from earlier writers (unchained)."""
    deferral: Deferral | None = None
    """Since schema v4, `deferred` only: `approval`, `question` or `external`."""
    args: str | None = None
    """Since schema v4, `deferred`: the call's arguments as a JSON object, redacted; since v5, on an
    `approved` decision, the arguments it runs with instead (None: its own)."""
    deferral_metadata: str | None = None
    """Since schema v4, `deferred` only: the metadata the tool deferred with (JSON), or None."""
    result: str | None = None
    """Since schema v5, on a `returned` decision only: the outside call's result, as JSON, redacted."""


LogRecord = StepEvent | ToolEffectTransition
"""Anything the producer appends."""

_Record = TypeVar('_Record')


def record_maker(cls: type[_Record]) -> Callable[..., _Record]:
    """A constructor of the frozen, slotted dataclass `cls`: the same object, at a fraction of the cost.

    It takes the fields by keyword, as `cls` does. A frozen dataclass's `__init__` sets each field
    through `object.__setattr__`, which looks the field up on the class every time; the producer
    builds one record per hook (twenty fields of a `StepEvent`), so this sets each slot through its
    descriptor, found once, instead. Defaults and default factories are `cls`'s own; neither
    checks anything (`cls` has no `__post_init__`).
    """
    if not dataclasses.is_dataclass(cls) or hasattr(cls, '__post_init__') or '__slots__' not in vars(cls):
        raise TypeError(f'record_maker needs a slotted dataclass without __post_init__, got {cls!r}')
    fields = dataclasses.fields(cls)
    if not all(f.init for f in fields):
        raise TypeError(f'record_maker sets every field from its arguments; {cls!r} has init=False fields')
    env: dict[str, Any] = {'_new': object.__new__, '_cls': cls, '_MISSING': dataclasses.MISSING}
    params, body = [], []
    for i, f in enumerate(fields):
        env[f'_set{i}'] = vars(cls)[f.name].__set__
        if f.default is not dataclasses.MISSING:
            env[f'_default{i}'] = f.default
            params.append(f'{f.name}=_default{i}')
        elif f.default_factory is not dataclasses.MISSING:
            env[f'_factory{i}'] = f.default_factory
            params.append(f'{f.name}=_MISSING')
            body.append(f'    _set{i}(_r, _factory{i}() if {f.name} is _MISSING else {f.name})')
            continue
        else:
            params.append(f.name)
        body.append(f'    _set{i}(_r, {f.name})')
    name = cls.__name__
    source = '\n'.join(
        [f'def {name}(*, {", ".join(params)}):', '    _r = _new(_cls)', *body, '    return _r']
    )
    exec(source, env)  # our own code, made from the dataclass's fields
    maker: Callable[..., _Record] = env[name]
    return maker
