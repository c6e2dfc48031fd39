"""`StepPersistence`: the Pydantic AI capability that appends a run's trail to the log.

It follows the hooks and run identity of pydantic-ai-harness `StepPersistence`, but it never
reads anything back: each boundary becomes one appended record, and each snapshot carries only
what changed since the previous snapshot of the same run.

Under a durable-execution engine (Pydantic AI's DBOS, Temporal or Prefect integrations) the run's
records are held until the next durability point and written there by one durable operation of
the engine. When the engine recovers a workflow it re-executes the run: the operations that
already happened return their journaled result instead of writing again, and the run's id,
writer and `seq` numbering come out the same, so the recovered run continues its own trail
(docs/decisions/0008-replay-safe-identity.md). A write that runs again sends the same bytes: where
the engine re-computes an operation's arguments (DBOS, Prefect) the batch is journaled first by a
`seal` operation, and large values move to the media store in an `offload` operation, never in
workflow code (docs/decisions/0027-durable-writes-same-bytes.md).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import secrets
import time
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from opentelemetry import trace
from pydantic_ai import CallToolsNode, CapabilityEvent, ModelRequestNode
from pydantic_ai.capabilities import AbstractCapability, durable_operation
from pydantic_ai.capabilities.abstract import (
    AgentNode,
    NodeResult,
    ValidatedToolArgs,
    WrapRunHandler,
    WrapToolExecuteHandler,
)
from pydantic_ai.exceptions import ModelRetry, ToolFailed, ToolFailedError, ToolRetryError
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart
from pydantic_ai.models import ModelRequestContext
from pydantic_ai.run import AgentRunResult
from pydantic_ai.tools import AgentDepsT, RunContext, ToolDefinition

from stepstream.errors import StepStreamError
from stepstream.ids import check_run_id, to_run_id
from stepstream.media import MediaStore, Offloaded, S3MediaStore, offload_media
from stepstream.producer._engines import (
    in_temporal_workflow,
    refuse_temporal_sandbox_import,
    refuse_undeclared_engine,
)
from stepstream.producer._liveness import OpenRun
from stepstream.producer._log import EventLog
from stepstream.producer._protocol import Ack, StepLog
from stepstream.producer._snapshots import SnapshotWriter
from stepstream.schemas import (
    EventKind,
    LogRecord,
    ModelUsage,
    SnapshotDelta,
    SnapshotState,
    StepEvent,
    ToolEffectTransition,
    record_maker,
)
from stepstream.settings import Settings
from stepstream.telemetry import span

if TYPE_CHECKING:
    pass

logger = logging.getLogger('stepstream.producer')

ATTEMPT_KEY = 'stepstream.attempt'
"""Metadata key on the events a recovered attempt writes: which attempt of the run wrote them."""


@functools.cache
def _this_process() -> str:
    """Tells the processes that executed a run's durable operations apart (see `Attempt`).

    Drawn on first use, not at import: Temporal's workflow sandbox refuses randomness at import.
    """
    return secrets.token_hex(8)


current_run: ContextVar[StepPersistence[Any] | None] = ContextVar('stepstream.current_run', default=None)
"""The run-bound capability of the innermost persisted run in this task.

Set around a run by `StepPersistence.wrap_run`. A delegate started from a tool reads it in
`for_run` to learn its parent; `annotate_tool_effect` reads it to find the run to annotate.
A ContextVar (not pydantic-ai's own run context) because the nested run overwrites those
before the delegate's capability can see its parent.
"""


def current_run_id() -> str | None:
    """The run id of the innermost persisted run in this task, or None.

    Pass it as `parent_run_id` to a delegate in another process, where ContextVars do not reach.
    """
    run = current_run.get()
    return run.run_id if run is not None else None


@dataclass(frozen=True)
class Attempt:
    """Which execution of a run wrote its records, as journaled by a durable-execution engine.

    Every durable write returns the attempt that performed it. An engine that recovers a run
    returns the journaled attempt for writes that already happened, so the run can tell, before
    it writes anything new, that it is a later attempt than the one that began it.
    """

    process: str
    number: int

    def next_write(self) -> Attempt:
        """The attempt that performs a write in this process after this one."""
        if self.process == _this_process():
            return self
        return Attempt(_this_process(), self.number + 1)

    @staticmethod
    def first() -> Attempt:
        """The attempt that performs a run's first write, in this process."""
        return Attempt(_this_process(), 1)


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


def _no_metadata() -> dict[str, str]:
    return {}


@dataclass
class StepPersistence(AbstractCapability[AgentDepsT]):
    """Append-only step trail, delta snapshots and a write-ahead tool-effect ledger, on Kafka.

    ```python
    async with EventLog(settings) as log:
        agent = Agent(model, capabilities=[StepPersistence(log=log, agent_name='librarian')])
        await agent.run('find X', conversation_id='conv-1')
    ```

    Durability points wait for the broker (acks=all): a tool's `started` transition before
    the tool body runs, every snapshot before its hook returns, and the end of the run.
    Everything else is batched, in order. If the broker does not acknowledge in time, the run
    fails with `StepStreamUnavailable`.
    """

    id: str | None = field(default='stepstream', kw_only=True)

    log: StepLog
    """The process's shared appender: an `EventLog`, or an `InMemoryLog` in tests."""

    agent_name: str | None = None
    """Logical agent name; with no explicit `run_id`, each run's id is `{agent_name}-{ctx.run_id}`.

    The id is a function of the run context only, so a durable-execution engine that re-executes
    the run gets the same id; characters outside `[A-Za-z0-9_.-]` are mapped by `to_run_id`.
    """

    run_id: str | None = None
    """Explicit id for exactly one `.run()`; a second run with it raises `ValueError`."""

    parent_run_id: str | None = None
    """The spawning run; inferred from an enclosing persisted run when unset."""

    metadata: dict[str, str] = field(default_factory=_no_metadata)
    """Stored on the run and on every event."""

    capture_frontier: bool = False
    """Also snapshot accepted inputs and tool-call frontiers before they execute."""

    media_store: MediaStore | None = None
    """Where large values go before a snapshot is appended; default: the S3 bucket of `log.settings`."""

    media_threshold_bytes: int | None = None
    """Values of at least this many bytes move to `media_store`; default: `log.settings`' threshold."""

    # Per-run state, fresh in every `for_run` copy.
    _explicit_run_id_used: bool = field(default=False, init=False, repr=False)
    _writer_id: str = field(default='', init=False, repr=False)
    _seq: int = field(default=0, init=False, repr=False)
    _snapshot_seq: int = field(default=0, init=False, repr=False)
    _unacked: list[Ack] = field(default_factory=list, init=False, repr=False)
    _durable_engine: bool = field(default=False, init=False, repr=False)
    _held: list[LogRecord] = field(default_factory=list, init=False, repr=False)
    _attempt: Attempt | None = field(default=None, init=False, repr=False)
    _sealing: list[LogRecord] = field(default_factory=list, init=False, repr=False)
    """The batch `_seal_durably` journals, handed over outside its arguments."""
    _context_run_id: str | None = field(default=None, init=False, repr=False)
    _open_calls: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    """Tool calls recorded as started, with when their body began (`time.perf_counter_ns`)."""
    _request_started: int = field(default=0, init=False, repr=False)
    """When the current model request began (`time.perf_counter_ns`); one at a time per run."""
    _snapshots: SnapshotWriter | None = field(default=None, init=False, repr=False)
    _default_store: MediaStore | None = field(default=None, init=False, repr=False)
    _last_snapshot_step: int | None = field(default=None, init=False, repr=False)
    _live: tuple[list[ModelMessage], int] | None = field(default=None, init=False, repr=False)
    _conversation_id: str | None = field(default=None, init=False, repr=False)
    _step_index: int = field(default=0, init=False, repr=False)
    """The step of the newest event: what a heartbeat or a process-written end says."""
    _open: OpenRun | None = field(default=None, init=False, repr=False)
    """This run in its log's liveness keeper, from `run_started` until its end is appended."""
    _ended_by_process: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.run_id is not None:
            check_run_id(self.run_id)
        if self.parent_run_id is not None:
            check_run_id(self.parent_run_id, what='parent_run_id')
        if not isinstance(self.log, StepLog):
            raise TypeError(
                f'StepPersistence(log=...) needs an EventLog (or another StepLog), '
                f'got {type(self.log).__name__}'
            )
        threshold = self.threshold_bytes
        limit = getattr(self.log, 'max_record_bytes', None)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold <= 0:
            raise ValueError(f'media_threshold_bytes must be a positive int, got {threshold!r}')
        if limit is not None and threshold >= limit:
            raise ValueError(
                f'media_threshold_bytes ({threshold}) must stay below the record limit ({limit}): '
                'payloads under the threshold stay inline in records'
            )

    @property
    def threshold_bytes(self) -> int:
        """The media threshold in effect: `media_threshold_bytes`, else the log's settings."""
        if self.media_threshold_bytes is not None:
            return self.media_threshold_bytes
        return self.log.settings.media_threshold_bytes

    def _media(self) -> MediaStore:
        """`media_store`, else one S3 store for the log's settings, made once per capability."""
        if self.media_store is not None:
            return self.media_store
        if self._default_store is None:
            self._default_store = S3MediaStore.from_settings(self.log.settings)
        return self._default_store

    @classmethod
    def from_spec(cls, *args: Any, **kwargs: Any) -> StepPersistence[Any]:
        """Build from a serialisable spec, e.g. an agent spec file.

        ```python
        StepPersistence.from_spec(bootstrap_servers='kafka:9092', topic_prefix='prod', agent_name='librarian')
        ```

        Capability options (`agent_name`, `run_id`, `parent_run_id`, `metadata`, `capture_frontier`)
        are taken as they are; every `Settings` field (`bootstrap_servers`, `topic_prefix`, the
        `s3_*` media settings, ...) selects the process's shared `EventLog`, with unset fields
        from `STEPSTREAM_*` variables. Anything else is rejected rather than guessed at.
        """
        if args:
            raise TypeError('StepPersistence.from_spec takes keyword options only')
        options = {'agent_name', 'run_id', 'parent_run_id', 'metadata', 'capture_frontier'}
        setting_names = {f.name for f in fields(Settings)}
        unknown = sorted(set(kwargs) - options - setting_names)
        if unknown:
            raise ValueError(
                f'unknown StepPersistence spec option(s) {unknown}; expected capability options '
                f'{sorted(options)} or settings {sorted(setting_names)}'
            )
        settings = Settings.from_env(**{k: v for k, v in kwargs.items() if k in setting_names})
        return cls(log=EventLog.shared(settings), **{k: v for k, v in kwargs.items() if k in options})

    def compaction_transcript_handle(self) -> str | None:
        """The run id, as the handle a compaction receipt points back to (None before a run)."""
        return self.run_id

    async def for_run(self, ctx: RunContext[AgentDepsT]) -> AbstractCapability[AgentDepsT]:
        """Bind a copy to this `.run()`: resolve the run id, the writer, the parent and the agent name.

        The run id and the writer id are functions of the run context (and the explicit
        `run_id`), never random, so that a run re-executed by a durable-execution engine is the
        same run with the same writer.
        """
        refuse_temporal_sandbox_import()
        refuse_undeclared_engine(ctx.in_durable_context)
        if self.run_id is not None:
            if self._explicit_run_id_used:
                raise ValueError(
                    f'StepPersistence run_id {self.run_id!r} was already used by an earlier run; an explicit '
                    'run_id is for exactly one .run(). Pass conversation_id= to Agent.run to group runs.'
                )
            self._explicit_run_id_used = True
            run_id = self.run_id
        elif ctx.run_id is not None and self.agent_name is not None:
            run_id = to_run_id(f'{self.agent_name}-{ctx.run_id}')
        elif ctx.run_id is not None:
            run_id = to_run_id(ctx.run_id)
        else:
            raise RuntimeError('StepPersistence needs a run id: set run_id= or agent_name=')
        parent = self.parent_run_id
        if parent is None:
            enclosing = current_run.get()
            parent = enclosing.run_id if enclosing is not None else None
        agent_name = self.agent_name
        if agent_name is None and ctx.agent is not None:
            agent_name = ctx.agent.name
        bound = replace(self, run_id=run_id, parent_run_id=parent, agent_name=agent_name)
        # Under an engine the media store is only used by the offload operation (an activity or
        # step), so workflow code never builds the S3 client.
        store = None if ctx.in_durable_context else self._media()
        if ctx.in_durable_context and self.log.sealer is not None:
            raise StepStreamError(
                'erasure (STEPSTREAM_ERASURE_KEY) is not supported under a durable-execution engine yet: '
                'unset it for this process, or run the agent outside the engine (decision 0033)'
            )
        bound._snapshots = SnapshotWriter(store, self.threshold_bytes)
        bound._writer_id = _writer_id(run_id, ctx.run_id)
        bound._context_run_id = ctx.run_id
        bound._durable_engine = ctx.in_durable_context
        return bound

    # -- appending ---------------------------------------------------------------------------

    def _step_event(
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
    ) -> StepEvent:
        """The run's next step event; its `seq` is taken only once `_append` accepts it."""
        assert self.run_id is not None
        return _new_step_event(
            run_id=self.run_id,
            seq=self._seq,
            writer_id=self._writer_id,
            timestamp=datetime.now(UTC),
            kind=kind,
            step_index=step_index,
            agent_name=self.agent_name,
            conversation_id=self._conversation_id,
            parent_run_id=self.parent_run_id,
            tool_call_id=tool_call_id,
            tool_name=tool_name,
            error=error,
            metadata=metadata,
            idempotency_key=idempotency_key,
            snapshot=snapshot,
            usage=usage,
            duration_us=duration_us,
            trace_id=trace_id,
            span_id=span_id,
        )

    async def _append(self, record: LogRecord) -> None:
        """Take the record's `seq` once the log accepts it, then send it (or hold it for the engine).

        Build the record (`_step_event`, `_effect`) right before calling this: nothing between them awaits,
        so concurrent hooks of one run (parallel tool calls) never share a `seq`. A record the log
        refuses (an id rule, `RecordTooLarge`) raises here and leaves no gap.
        """
        value = self.log.encode(record)
        self._seq += 1
        if self._open is not None:
            self._open.last_append = time.monotonic()
        if self._durable_engine:
            self._held.append(record)
        else:
            self._unacked.append(await self.log.send(record, value))

    def _event_metadata(self) -> dict[str, str]:
        attempt = self._attempt.next_write() if self._attempt is not None else Attempt.first()
        if attempt.number == 1:
            return self.metadata
        return {**self.metadata, ATTEMPT_KEY: str(attempt.number)}

    async def _event(
        self,
        ctx: RunContext[AgentDepsT],
        kind: EventKind,
        *,
        tool_call_id: str | None = None,
        tool_name: str | None = None,
        error: str | None = None,
        snapshot: SnapshotDelta | None = None,
        usage: ModelUsage | None = None,
        duration_us: int | None = None,
    ) -> None:
        step_index = self._step_index = ctx.run_step
        current = trace.get_current_span().get_span_context()
        traced = current.is_valid
        record = self._step_event(
            kind,
            step_index,
            tool_call_id=tool_call_id,
            tool_name=tool_name,
            error=error,
            metadata=self._event_metadata() if self._durable_engine else self.metadata,
            idempotency_key=f'{self._seq}:{step_index}:{kind}:{tool_call_id or ""}',
            snapshot=snapshot,
            usage=usage,
            duration_us=duration_us,
            trace_id=f'{current.trace_id:032x}' if traced else None,
            span_id=f'{current.span_id:016x}' if traced else None,
        )
        await self._append(record)

    async def _effect(
        self,
        call: ToolCallPart,
        status: Literal['started', 'annotated', 'completed', 'failed'],
        *,
        idempotency_key: str | None = None,
        effect_summary: str | None = None,
        error: str | None = None,
    ) -> None:
        assert self.run_id is not None
        record = _new_transition(
            run_id=self.run_id,
            seq=self._seq,
            writer_id=self._writer_id,
            timestamp=datetime.now(UTC),
            tool_call_id=call.tool_call_id,
            tool_name=call.tool_name,
            status=status,
            agent_name=self.agent_name,
            conversation_id=self._conversation_id,
            parent_run_id=self.parent_run_id,
            idempotency_key=idempotency_key,
            effect_summary=effect_summary,
            error=error,
        )
        await self._append(record)

    def _heartbeat(self) -> StepEvent:
        """The run's `run_heartbeat`: its writer is alive. It takes no `seq` (it names the next one)."""
        return self._step_event('run_heartbeat', self._step_index, metadata={}, idempotency_key=None)

    async def _end_by_process(self, reason: str) -> None:
        """Append `run_cancelled` for a process that stops (cleanly) while this run is open.

        Not under a durable-execution engine: the engine owns the run and recovers it in another
        process, whose records continue the trail; an end written here would take their `seq`.
        """
        self._open = None
        if self._durable_engine or self._ended_by_process:
            return
        self._ended_by_process = True
        record = self._step_event(
            'run_cancelled',
            self._step_index,
            error=reason,
            metadata=self.metadata,
            idempotency_key=f'{self._seq}:{self._step_index}:run_cancelled:',
        )
        await self._append(record)

    def _close_liveness(self) -> None:
        """The run's end is about to be appended: its writer stops speaking for it."""
        self.log.liveness.close(self._open)
        self._open = None

    async def _durable(self, ctx: RunContext[AgentDepsT]) -> None:
        """A durability point: wait until everything this run appended is acknowledged.

        Under a durable-execution engine, the records held since the last point are written
        here by one durable operation, so a recovered run does not write them again.
        """
        with span('stepstream.durability_point', attributes={'stepstream.run_id': self.run_id or ''}):
            if self._durable_engine:
                held, self._held = self._held, []
                if held and not in_temporal_workflow():
                    # DBOS and Prefect re-compute an operation's arguments when they recover a run:
                    # journal the batch as a result first, so that a write run again sends it again
                    # byte for byte (and, on Prefect, is recognised by its arguments).
                    self._sealing = held
                    try:
                        held = await self._seal_durably(ctx, held[0].seq, len(held))
                    finally:
                        self._sealing = []
                self._attempt = await self._write_durably(ctx, held, self._attempt)
                return
            unacked, self._unacked = self._unacked, []
            await self.log.wait_acked(unacked)

    @durable_operation('seal')
    async def _seal_durably(
        self, ctx: RunContext[Any], first_seq: int, count: int
    ) -> list[StepEvent | ToolEffectTransition]:
        """Journal the batch of records `first_seq .. first_seq + count - 1` as this operation's result.

        Their timestamps, durations and attempt marks were decided by this execution of the run;
        an engine that recovers the run returns the journaled batch instead, so the write that
        follows (and its retries) sends what the first execution decided. The records travel on
        the capability, not as arguments: the arguments, which Prefect hashes into the
        operation's cache key, are the same on every execution.
        """
        sealing = self._sealing
        if not sealing or sealing[0].seq != first_seq or len(sealing) != count:
            raise RuntimeError(
                'stepstream: the seal operation ran outside the process of its run; it needs an engine '
                'that runs operations in the workflow process (DBOS, Prefect)'
            )
        return list(sealing)

    @durable_operation('offload')
    async def _offload_durably(self, ctx: RunContext[Any], messages: list[ModelMessage]) -> Offloaded:
        """Move the large values of `messages` to the media store: I/O, so an operation of the engine.

        Under Temporal this is an activity (the walk uses a worker thread and the upload is I/O,
        neither allowed in workflow code); under DBOS and Prefect a step or task, whose journaled
        result (the lean messages, references in place, and the objects stored) a recovered run
        reuses. The references are content addresses, so an upload that runs again stores the
        same objects.
        """
        return await offload_media(messages, self._media(), self.threshold_bytes)

    @durable_operation('write')
    async def _write_durably(
        self,
        ctx: RunContext[Any],
        records: list[StepEvent | ToolEffectTransition],
        previous: Attempt | None,
    ) -> Attempt:
        """Write `records` and wait for the broker: one durable operation of the engine.

        Returns the attempt that did it. When the engine recovers the run, it returns the
        journaled attempt instead of running this again, which is how the run learns that it is
        a later attempt (`Attempt.next_write`). A partial write that is run again only repeats
        records with the same `seq`, which the projector ignores.
        """
        acks = [await self.log.append(record) for record in records]
        await self.log.wait_acked(acks)
        return previous.next_write() if previous is not None else Attempt.first()

    async def _snapshot(
        self,
        ctx: RunContext[AgentDepsT],
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
        writer = self._snapshots
        assert writer is not None, 'for_run binds a snapshot writer'
        plan = writer.plan(messages)
        if (settled_only and not plan.valid) or (changed_only and writer.unchanged(plan)):
            return
        snapshot_seq = self._snapshot_seq
        sealer = self.log.sealer
        if sealer is not None:  # erasure on: content and media sealed with the conversation's key
            assert self.run_id is not None
            delta = await sealer.delta(
                writer,
                plan,
                snapshot_seq,
                conversation_id=self._conversation_id or self.run_id,
                run_id=self.run_id,
            )
        else:
            offload = functools.partial(self._offload_durably, ctx) if self._durable_engine else None
            delta = await writer.delta(plan, snapshot_seq, offload=offload)
        state = delta.state
        await self._event(ctx, 'snapshot_saved', snapshot=delta)
        self._snapshot_seq += 1  # only once the record is accepted, like its `seq`
        await self._durable(ctx)
        writer.commit(plan)
        self._last_snapshot_step = step_index
        assert self.run_id is not None
        await ctx.emit(
            SnapshotSaved(
                persistence_run_id=self.run_id,
                conversation_id=self._conversation_id,
                step_index=step_index,
                snapshot_seq=snapshot_seq,
                state=state,
            )
        )

    # -- run lifecycle -----------------------------------------------------------------------

    async def wrap_run(self, ctx: RunContext[AgentDepsT], *, handler: WrapRunHandler) -> AgentRunResult[Any]:
        """Make this run the parent of any persisted run started inside it."""
        token = current_run.set(self)
        try:
            return await handler()
        finally:
            current_run.reset(token)
            self._close_liveness()  # however the run ended, its writer no longer speaks for it

    async def before_run(self, ctx: RunContext[AgentDepsT]) -> None:
        """Append `run_started` with the run's lineage and metadata, and wait for the broker.

        A durability point, so that no later record of the run can reach the log without it (a
        record the projector cannot place under a registered run stays invisible).
        """
        self._conversation_id = ctx.conversation_id
        await self._event(ctx, 'run_started')
        try:
            await self._durable(ctx)
        except Exception as error:
            # Pydantic AI does not call `on_run_error` for a failure in `before_run`.
            await self._record_failure(ctx, error, repr(error))
            raise
        assert self.run_id is not None
        # Acknowledged, so heartbeats never reach the log before the run they speak for.
        self._open = self.log.liveness.open(self.run_id, heartbeat=self._heartbeat, end=self._end_by_process)

    async def after_run(
        self, ctx: RunContext[AgentDepsT], *, result: AgentRunResult[Any]
    ) -> AgentRunResult[Any]:
        """Save the final history if no boundary saved it, append `run_completed`, flush the run."""
        step = self._last_snapshot_step if self._last_snapshot_step is not None else ctx.run_step
        await self._snapshot(ctx, result.all_messages(), step, settled_only=True, changed_only=True)
        self._close_liveness()
        await self._event(ctx, 'run_completed')
        await self._durable(ctx)
        return result

    async def on_run_error(self, ctx: RunContext[AgentDepsT], *, error: BaseException) -> AgentRunResult[Any]:
        """Save the live history at failure (if it holds a response), append `run_failed`, re-raise.

        `run_failed` is appended even when the failure snapshot cannot be (S3 down, a record too
        large): the run's end must be in the log. If the broker does not take it in time, the
        `EventLog` keeps it and sends it once the broker is back; the run's own error wins either
        way, with a note saying what could not be recorded.
        """
        reason = repr(error)
        if self._live is not None:
            live, step_index = self._live
            messages = list(live)
            has_response = any(isinstance(m, ModelResponse) for m in messages)
            if has_response or (self.capture_frontier and messages):
                try:
                    await self._snapshot(ctx, messages, step_index)
                except Exception as snapshot_error:
                    error.add_note(
                        f'stepstream could not save or confirm the failure snapshot: {snapshot_error}'
                    )
                    reason = f'{reason} (failure snapshot: {snapshot_error!r})'
        await self._record_failure(ctx, error, reason)
        raise error

    async def _record_failure(self, ctx: RunContext[AgentDepsT], error: BaseException, reason: str) -> None:
        """Append `run_failed` (`run_cancelled` for a cancelled task); say so on `error` if unconfirmed.

        Cancellation is not a failure of the run: whoever cancelled it decided so, and views show
        `cancelled` rather than an error to investigate.
        """
        if len(reason) > MAX_ERROR_CHARS:  # an error text must not make the failure record too large
            reason = f'{reason[:MAX_ERROR_CHARS]}... ({len(reason) - MAX_ERROR_CHARS} more characters)'
        kind: EventKind = 'run_cancelled' if isinstance(error, asyncio.CancelledError) else 'run_failed'
        self._close_liveness()
        if self._ended_by_process:
            return  # its process already wrote the end (`EventLog.close`, SIGTERM)
        try:
            await self._event(ctx, kind, error=reason)
            await self._durable(ctx)
        except Exception as log_error:
            error.add_note(
                f'stepstream could not confirm the failure record ({log_error}); it is kept and sent again '
                'while the EventLog stays open'
            )

    # -- model requests ----------------------------------------------------------------------

    async def before_model_request(
        self, ctx: RunContext[AgentDepsT], request_context: ModelRequestContext
    ) -> ModelRequestContext:
        """Append `model_request_started` (and snapshot the frontier when asked)."""
        if self.capture_frontier:
            self._live = (ctx.messages, ctx.run_step)
            await self._snapshot(ctx, ctx.messages, ctx.run_step)
        await self._event(ctx, 'model_request_started')
        self._request_started = time.perf_counter_ns()
        return request_context

    async def after_model_request(
        self, ctx: RunContext[AgentDepsT], *, request_context: ModelRequestContext, response: ModelResponse
    ) -> ModelResponse:
        """Append `model_request_completed` with the response's usage and the request's duration."""
        duration_us = (time.perf_counter_ns() - self._request_started) // 1000
        await self._event(ctx, 'model_request_completed', usage=_usage_of(response), duration_us=duration_us)
        return response

    async def on_model_request_error(
        self, ctx: RunContext[AgentDepsT], *, request_context: ModelRequestContext, error: Exception
    ) -> ModelResponse:
        """Append `model_request_failed` and re-raise; `on_run_error` saves the history."""
        duration_us = (time.perf_counter_ns() - self._request_started) // 1000
        await self._event(ctx, 'model_request_failed', error=repr(error), duration_us=duration_us)
        raise error

    # -- tools ---------------------------------------------------------------------------------

    async def before_tool_execute(
        self, ctx: RunContext[AgentDepsT], *, call: ToolCallPart, tool_def: ToolDefinition, args: Any
    ) -> Any:
        """Write ahead: the `started` transition is acknowledged before the tool body runs."""
        await self._effect(call, 'started')
        await self._event(ctx, 'tool_call_started', tool_call_id=call.tool_call_id, tool_name=call.tool_name)
        await self._durable(ctx)
        self._open_calls[call.tool_call_id] = time.perf_counter_ns()
        return args

    async def after_tool_execute(
        self,
        ctx: RunContext[AgentDepsT],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: Any,
        result: Any,
    ) -> Any:
        """Append the `completed` transition and event (acknowledged with the next snapshot)."""
        duration_us = self._tool_duration(call)
        await self._effect(call, 'completed')
        await self._event(
            ctx,
            'tool_call_completed',
            tool_call_id=call.tool_call_id,
            tool_name=call.tool_name,
            duration_us=duration_us,
        )
        return result

    async def on_tool_execute_error(
        self,
        ctx: RunContext[AgentDepsT],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: Any,
        error: Exception,
    ) -> Any:
        """Append the `failed` transition and event, then re-raise."""
        await self._tool_failed(ctx, call, error)
        raise error

    async def wrap_tool_execute(
        self,
        ctx: RunContext[AgentDepsT],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: ValidatedToolArgs,
        handler: WrapToolExecuteHandler,
    ) -> Any:
        """Record a body that ended by asking the model to retry (`ModelRetry`) or by `ToolFailed`.

        Pydantic AI treats those as control flow and calls neither `after_tool_execute` nor
        `on_tool_execute_error` for them; without this the call's effect would stay `started`
        (`unknown_after_crash`) although its body ended, and its end would not be timed.
        """
        try:
            return await handler(args)
        except (ModelRetry, ToolFailed, ToolRetryError, ToolFailedError) as error:
            if call.tool_call_id in self._open_calls:
                await self._tool_failed(ctx, call, error)
            raise

    async def _tool_failed(
        self, ctx: RunContext[AgentDepsT], call: ToolCallPart, error: BaseException
    ) -> None:
        duration_us = self._tool_duration(call)
        await self._effect(call, 'failed', error=repr(error))
        await self._event(
            ctx,
            'tool_call_failed',
            tool_call_id=call.tool_call_id,
            tool_name=call.tool_name,
            error=repr(error),
            duration_us=duration_us,
        )

    def _tool_duration(self, call: ToolCallPart) -> int | None:
        """How long the call's body ran, in microseconds; None for a call not recorded as started."""
        started = self._open_calls.pop(call.tool_call_id, None)
        return None if started is None else (time.perf_counter_ns() - started) // 1000

    async def annotate(
        self,
        ctx: RunContext[Any],
        call: ToolCallPart,
        *,
        idempotency_key: str | None,
        effect_summary: str | None,
    ) -> bool:
        """Append an `annotated` transition for a call of this run (see `annotate_tool_effect`).

        A durability point: the annotation exists to guide recovery after a crash, so it is
        acknowledged before the tool goes on to its side effect. Returns False, writing nothing,
        when `ctx` is not a tool call this run recorded as started (an agent without
        `StepPersistence` running inside one of this run's tools has its own run and call ids).
        """
        if ctx.run_id != self._context_run_id or call.tool_call_id not in self._open_calls:
            return False
        await self._effect(call, 'annotated', idempotency_key=idempotency_key, effect_summary=effect_summary)
        await self._durable(ctx)
        return True

    # -- graph nodes ---------------------------------------------------------------------------

    async def after_node_run(
        self, ctx: RunContext[AgentDepsT], *, node: AgentNode[AgentDepsT], result: NodeResult[AgentDepsT]
    ) -> NodeResult[AgentDepsT]:
        """Snapshot after a settled tool cycle, with the pending tool-return request folded in.

        The live list is kept by reference (not copied) so that a later failure can save what
        the run held at that moment; the graph only mutates that list in place after the first
        boundary.
        """
        self._live = (ctx.messages, ctx.run_step)
        if self.capture_frontier and isinstance(node, ModelRequestNode):
            await self._snapshot(ctx, ctx.messages, ctx.run_step)
        if isinstance(node, CallToolsNode):
            messages: Sequence[ModelMessage] = ctx.messages
            if isinstance(result, ModelRequestNode):
                messages = [*ctx.messages, result.request]
            await self._snapshot(ctx, messages, ctx.run_step, settled_only=True)
        return result


async def annotate_tool_effect(
    ctx: RunContext[Any], *, idempotency_key: str | None = None, effect_summary: str | None = None
) -> None:
    """Record how to recognise a tool's side effect, from inside the tool body.

    ```python
    @agent.tool
    async def open_pr(ctx: RunContext[None], title: str) -> str:
        await annotate_tool_effect(ctx, idempotency_key=f'pr:{title}', effect_summary='opens a PR')
        ...
    ```

    Appends an `annotated` transition; the projection keeps both fields after the call's
    terminal transition, so an orchestrator sweeping `unknown_after_crash` effects can decide
    whether a replay is safe. A no-op (logged at debug level, nothing written) outside a tool
    call that a persisted run recorded as started, for example in the tool of an agent without
    `StepPersistence` that runs inside a persisted agent's tool.
    """
    run = current_run.get()
    recorded = False
    if run is not None and ctx.tool_call_id is not None and ctx.tool_name is not None:
        call = ToolCallPart(tool_name=ctx.tool_name, tool_call_id=ctx.tool_call_id)
        recorded = await run.annotate(
            ctx, call, idempotency_key=idempotency_key, effect_summary=effect_summary
        )
    if not recorded:
        logger.debug(
            'stepstream: annotate_tool_effect(%r) outside a recorded tool call (tool_call_id=%r): '
            'nothing written',
            idempotency_key,
            ctx.tool_call_id,
        )


def _usage_of(response: ModelResponse) -> ModelUsage:
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


def _writer_id(run_id: str, context_run_id: str | None) -> str:
    """The writer of a run: the same for every execution of one run, different across runs.

    Derived from the run id and the context's run id, which a durable-execution engine gives a
    re-executed run again; two runs that reuse one explicit `run_id` (each `.run()` has its own
    context run id) still show as two writers, i.e. as a conflict.
    """
    if context_run_id is None:
        return secrets.token_hex(8)
    return hashlib.sha256(f'{run_id}\x00{context_run_id}'.encode('utf-8', 'surrogatepass')).hexdigest()[:16]
