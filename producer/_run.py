"""`RunWriter`: one persisted run's state, and the records it builds and appends.

`StepPersistence.for_run` makes one per `.run()`; the capability's hooks stay thin and call it.
It holds what a run counts and keeps (its `seq`, the snapshot writer, the records held for a
durable-execution engine, the open tool calls, its liveness handle) and owns every append: step
events, tool-effect transitions, snapshots, heartbeats and the run's end, and its durability
points. The durable operations themselves stay methods of the capability (an engine finds them
there); the writer calls them through the bound methods it is given.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, TypedDict, Unpack

from opentelemetry import trace
from pydantic_ai import CapabilityEvent
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart
from pydantic_ai.tools import RunContext

from stepstream.media import Offloaded
from stepstream.producer._definitions import Definitions
from stepstream.producer._engines import ATTEMPT_KEY, Attempt, in_temporal_workflow
from stepstream.producer._liveness import OpenRun
from stepstream.producer._protocol import Ack, StepLog
from stepstream.producer._redaction import Redaction
from stepstream.producer._snapshots import SnapshotWriter
from stepstream.schemas import (
    Deferral,
    EventKind,
    LogRecord,
    ModelUsage,
    SnapshotDelta,
    SnapshotState,
    StepEvent,
    ToolEffectTransition,
    chain_hash,
    record_maker,
)
from stepstream.signing import SIGNATURE, SIGNING_KEY, Signer
from stepstream.telemetry import span

_new_step_event = record_maker(StepEvent)
_new_transition = record_maker(ToolEffectTransition)
"""`StepEvent(...)` and `ToolEffectTransition(...)`, several times cheaper: a hook builds one or two."""

MAX_ERROR_CHARS = 8192
"""The longest error text a `run_failed` record carries (the rest is cut, and says how much)."""


@dataclass(kw_only=True)
class SnapshotSaved(CapabilityEvent, namespace='stepstream', name='snapshot_saved'):
    """A snapshot was acknowledged by the broker (it is durable, not yet projected)."""

    persistence_run_id: str
    conversation_id: str | None
    step_index: int
    snapshot_seq: int
    state: SnapshotState


Records = list[StepEvent | ToolEffectTransition]


class TransitionFields(TypedDict, total=False):
    """A transition's fields besides its call and status (`deferral` and after: a `deferred` one's)."""

    idempotency_key: str | None
    effect_summary: str | None
    error: str | None
    deferral: Deferral | None
    args: str | None
    deferral_metadata: str | None


class DurableOperations(Protocol):
    """The bound capability's durable operations: methods of the capability, where an engine finds them."""

    async def _seal_durably(self, ctx: RunContext[Any], first_seq: int, count: int) -> Records: ...

    async def _write_durably(
        self, ctx: RunContext[Any], records: Records, previous: Attempt | None
    ) -> Attempt: ...

    async def _offload_durably(self, ctx: RunContext[Any], messages: list[ModelMessage]) -> Offloaded: ...


@dataclass(slots=True, eq=False)
class RunWriter:
    """One bound run's state and its appends; `StepPersistence.for_run` makes one per `.run()`.

    `operations` reaches the bound capability's durable operations, called under a
    durable-execution engine; weakly, as the capability holds this writer (no reference cycle
    keeps a finished run's history in memory).
    """

    log: StepLog
    run_id: str
    writer_id: str
    agent_name: str | None
    parent_run_id: str | None
    metadata: dict[str, str]
    context_run_id: str | None
    durable_engine: bool
    snapshots: SnapshotWriter
    operations: Callable[[], DurableOperations | None]
    redaction: Redaction
    signer: Signer | None = None
    """The writer's signing key (`STEPSTREAM_SIGNING_KEY`): set, each durability point signs the head."""
    seq: int = 0
    head: str | None = None
    """The run's chain head: `chain_hash` of its last appended record, which the next one carries."""
    signed: str | None = None
    """The head this writer signed last: a durability point where the chain did not move signs nothing."""
    snapshot_seq: int = 0
    unacked: list[Ack] = field(default_factory=list)
    held: list[LogRecord] = field(default_factory=list)
    attempt: Attempt | None = None
    sealing: list[LogRecord] = field(default_factory=list)
    """The batch the `seal` operation journals, handed over outside its arguments."""
    open_calls: dict[str, int] = field(default_factory=dict)
    """Tool calls recorded as started, with when their body began (`time.perf_counter_ns`)."""
    request_started: int = 0
    """When the current model request began (`time.perf_counter_ns`); one at a time per run."""
    definitions: Definitions = field(default_factory=Definitions)
    last_snapshot_step: int | None = None
    live: tuple[list[ModelMessage], int] | None = None
    conversation_id: str | None = None
    step_index: int = 0
    """The step of the newest event: what a heartbeat or a process-written end says."""
    open: OpenRun | None = None
    """This run in its log's liveness keeper, from `run_started` until its end is appended."""
    ended_by_process: bool = False
    ended: bool = False
    """The run's end is decided (`_ends`): no other end is written for it."""
    deferred: set[str] = field(default_factory=set)
    """Tool calls recorded as `deferred` (`_calls.deferred`), each once."""

    # -- appending ---------------------------------------------------------------------------

    def step_event(
        self,
        kind: EventKind,
        step_index: int,
        *,
        metadata: dict[str, str],
        idempotency_key: str | None,
        tool_call_id: str | None = None,
        tool_name: str | None = None,
        error: str | None = None,
        snapshot: SnapshotDelta | None = None,
        usage: ModelUsage | None = None,
        duration_us: int | None = None,
        trace_id: str | None = None,
        span_id: str | None = None,
        linked: bool = True,
        request_fingerprint: str | None = None,
        request_definitions: str | None = None,
        timestamp: datetime | None = None,
    ) -> StepEvent:
        """The run's next step event, linked to the chain's head; its `seq` is taken once `append` accepts it.

        A heartbeat is not `linked`: it takes no `seq` and is not part of the run's trail. Nor does
        a signed head (`chain_signed`), which carries the head it signs as its link. `timestamp`
        (default: now) is an imported record's, as its store recorded it (`stepstream.importer`).
        """
        return _new_step_event(
            run_id=self.run_id,
            seq=self.seq,
            writer_id=self.writer_id,
            timestamp=timestamp or datetime.now(UTC),
            kind=kind,
            step_index=step_index,
            agent_name=self.agent_name,
            conversation_id=self.conversation_id,
            parent_run_id=self.parent_run_id,
            tool_call_id=tool_call_id,
            tool_name=tool_name,
            error=self.redaction.text(error),
            metadata=metadata,
            idempotency_key=idempotency_key,
            snapshot=snapshot,
            usage=usage,
            duration_us=duration_us,
            trace_id=trace_id,
            span_id=span_id,
            prev_hash=self.head if linked else None,
            request_fingerprint=request_fingerprint,
            request_definitions=request_definitions,
        )

    async def append(self, record: LogRecord, *, send: bool = True) -> bytes:
        """Take the record's `seq` once the log accepts it, then send it (or hold it for the engine).

        Build the record (`step_event`, `transition`) right before calling this: nothing between them
        awaits, so concurrent hooks of one run (parallel tool calls) never share a `seq`. A record the
        log refuses (an id rule, `RecordTooLarge`) raises here and leaves no gap. Not `send`: the
        record only takes its `seq` and moves the head (an import sends it later, or never).
        """
        value = self.log.encode(record)
        self.seq += 1
        self.head = chain_hash(value)
        if self.open is not None:
            self.open.last_append = time.monotonic()
        if send:
            await self._send(record, value)
        return value

    async def _send(self, record: LogRecord, value: bytes) -> None:
        if self.durable_engine:
            self.held.append(record)
        else:
            self.unacked.append(await self.log.send(record, value))

    async def sign_head(self) -> None:
        """Append a `chain_signed` event for the head (`stepstream.signing`), if a key is set and it moved."""
        head = self.head
        if self.signer is None or head is None or head == self.signed:
            return
        self.signed = head
        signature = self.signer.sign(self.run_id, self.seq, head)
        metadata = {SIGNATURE: signature, SIGNING_KEY: self.signer.key_id}
        record = self.step_event('chain_signed', self.step_index, metadata=metadata, idempotency_key=None)
        await self.send_beside(record)

    async def send_beside(self, record: StepEvent) -> None:
        """Send (or hold for the engine) a record beside the run's trail: it takes no `seq`, moves no head."""
        await self._send(record, self.log.encode(record))

    def event_metadata(self) -> dict[str, str]:
        """The metadata of an event written under an engine: marked with its attempt after the first."""
        attempt = self.attempt.next_write() if self.attempt is not None else Attempt.first()
        if attempt.number == 1:
            return self.metadata
        return {**self.metadata, ATTEMPT_KEY: str(attempt.number)}

    async def event(
        self,
        ctx: RunContext[Any],
        kind: EventKind,
        *,
        tool_call_id: str | None = None,
        tool_name: str | None = None,
        error: str | None = None,
        snapshot: SnapshotDelta | None = None,
        usage: ModelUsage | None = None,
        duration_us: int | None = None,
        metadata: dict[str, str] | None = None,
        definitions: str | None = None,
    ) -> None:
        """Append the step event `kind` at the context's step, with the current span's ids.

        A model request's `definitions` go in as a fingerprint, and in full when they changed.
        """
        step_index = self.step_index = ctx.run_step
        request_fingerprint, definitions = self.definitions.stamp(definitions)
        current = trace.get_current_span().get_span_context()
        traced = current.is_valid
        record = self.step_event(
            kind,
            step_index,
            tool_call_id=tool_call_id,
            tool_name=tool_name,
            error=error,
            metadata=metadata or (self.event_metadata() if self.durable_engine else self.metadata),
            idempotency_key=f'{self.seq}:{step_index}:{kind}:{tool_call_id or ""}',
            snapshot=snapshot,
            usage=usage,
            duration_us=duration_us,
            trace_id=f'{current.trace_id:032x}' if traced else None,
            span_id=f'{current.span_id:016x}' if traced else None,
            request_fingerprint=request_fingerprint,
            request_definitions=definitions,
        )
        await self.append(record)

    async def effect(
        self,
        call: ToolCallPart,
        status: Literal['started', 'annotated', 'completed', 'failed', 'deferred'],
        **fields: Unpack[TransitionFields],
    ) -> None:
        """Append the call's tool-effect transition to `status` (`transition`)."""
        await self.append(self.transition(call.tool_call_id, call.tool_name, status, **fields))

    def transition(
        self,
        tool_call_id: str,
        tool_name: str,
        status: Literal['started', 'annotated', 'completed', 'failed', 'deferred'],
        *,
        timestamp: datetime | None = None,
        **fields: Unpack[TransitionFields],
    ) -> ToolEffectTransition:
        """The call's next transition, redacted and linked to the head, at `timestamp` (default: now)."""
        return _new_transition(
            run_id=self.run_id,
            seq=self.seq,
            writer_id=self.writer_id,
            timestamp=timestamp or datetime.now(UTC),
            tool_call_id=tool_call_id,
            tool_name=tool_name,
            status=status,
            agent_name=self.agent_name,
            conversation_id=self.conversation_id,
            parent_run_id=self.parent_run_id,
            idempotency_key=self.redaction.text(fields.get('idempotency_key')),
            effect_summary=self.redaction.text(fields.get('effect_summary')),
            error=self.redaction.text(fields.get('error')),
            prev_hash=self.head,
            deferral=fields.get('deferral'),
            args=fields.get('args'),
            deferral_metadata=fields.get('deferral_metadata'),
        )

    # -- liveness ----------------------------------------------------------------------------

    def heartbeat(self) -> StepEvent:
        """The run's `run_heartbeat`: its writer is alive. It takes no `seq` (it names the next one)."""
        return self.step_event(
            'run_heartbeat', self.step_index, metadata={}, idempotency_key=None, linked=False
        )

    async def end_by_process(self, reason: str) -> None:
        """Append `run_cancelled` for a process that stops (cleanly) while this run is open.

        Not under a durable-execution engine: the engine owns the run and recovers it in another
        process, whose records continue the trail; an end written here would take their `seq`.
        """
        self.open = None
        if self.durable_engine or self.ended_by_process:
            return
        self.ended_by_process = True
        record = self.step_event(
            'run_cancelled',
            self.step_index,
            error=reason,
            metadata=self.metadata,
            idempotency_key=f'{self.seq}:{self.step_index}:run_cancelled:',
        )
        await self.append(record)
        await self.sign_head()

    def close_liveness(self) -> None:
        """The run's end is about to be appended: its writer stops speaking for it."""
        self.log.liveness.close(self.open)
        self.open = None

    # -- durability points and snapshots ---------------------------------------------------

    def _operations(self) -> DurableOperations:
        operations = self.operations()
        assert operations is not None, 'a run writer is used only through its bound capability'
        return operations

    async def durable(self, ctx: RunContext[Any]) -> None:
        """A durability point: wait until everything this run appended is acknowledged.

        Under a durable-execution engine, the records held since the last point are written
        here by one durable operation, so a recovered run does not write them again.
        """
        with span('stepstream.durability_point', attributes={'stepstream.run_id': self.run_id or ''}):
            await self.sign_head()
            if self.durable_engine:
                held, self.held = self.held, []
                if held and not in_temporal_workflow():
                    # DBOS and Prefect re-compute an operation's arguments when they recover a run:
                    # journal the batch as a result first, so that a write run again sends it again
                    # byte for byte (and, on Prefect, is recognised by its arguments).
                    self.sealing = held
                    try:
                        held = await self._operations()._seal_durably(ctx, held[0].seq, len(held))
                    finally:
                        self.sealing = []
                self.attempt = attempt = await self._operations()._write_durably(ctx, held, self.attempt)
                if attempt.head is not None:  # the journaled write's head, which the log holds
                    self.head, self.signed = attempt.head, attempt.signed or self.signed
                return
            unacked, self.unacked = self.unacked, []
            await self.log.wait_acked(unacked)

    async def snapshot(
        self,
        ctx: RunContext[Any],
        messages: Sequence[ModelMessage],
        step_index: int,
        *,
        settled_only: bool = False,
        changed_only: bool = False,
    ) -> None:
        """Save `messages` as the next snapshot: `complete` if provider-valid, else `interrupted`.

        `settled_only` skips an unsettled history (a tool-cycle boundary); `changed_only` skips
        one equal to the last snapshot (the end-of-run fallback).
        """
        writer = self.snapshots
        plan = writer.plan(messages)
        if (settled_only and not plan.valid) or (changed_only and writer.unchanged(plan)):
            return
        snapshot_seq = self.snapshot_seq
        sealer = self.log.sealer
        if sealer is not None:  # erasure on: content and media sealed with the conversation's key
            delta = await sealer.delta(
                writer,
                plan,
                snapshot_seq,
                conversation_id=self.conversation_id or self.run_id,
                run_id=self.run_id,
            )
        else:
            offload = (
                functools.partial(self._operations()._offload_durably, ctx) if self.durable_engine else None
            )
            delta = await writer.delta(plan, snapshot_seq, offload=offload)
        state = delta.state
        await self.event(ctx, 'snapshot_saved', snapshot=delta)
        self.snapshot_seq += 1  # only once the record is accepted, like its `seq`
        await self.durable(ctx)
        writer.commit(plan)
        self.last_snapshot_step = step_index
        await ctx.emit(
            SnapshotSaved(
                persistence_run_id=self.run_id,
                conversation_id=self.conversation_id,
                step_index=step_index,
                snapshot_seq=snapshot_seq,
                state=state,
            )
        )


def usage_of(response: ModelResponse) -> ModelUsage:
    """What the response says it used: `RequestUsage`'s token counts and cost, its model and provider."""
    usage = response.usage
    return ModelUsage(
        model_name=response.model_name,
        provider=response.provider_name,
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cache_read_tokens=usage.cache_read_tokens,
        cache_write_tokens=usage.cache_write_tokens,
        requests=usage.requests,
        finish_reason=response.finish_reason,
        cost_usd=None if usage.cost is None else str(usage.cost),
    )
