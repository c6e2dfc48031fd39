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

The hooks are thin: a run's state, its records and its durability points are `RunWriter`'s
(`_run.py`), one per `for_run` copy, made by `_binding.py`; what the options mean (their checks, a
spec, the media store they choose and the check of its bucket as a log starts) is `_options.py`'s;
`current_run` and `annotate_tool_effect` are in `_current.py`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic_ai import CallToolsNode, ModelRequestNode
from pydantic_ai.capabilities import AbstractCapability, durable_operation
from pydantic_ai.capabilities.abstract import (
    AgentNode,
    NodeResult,
    ValidatedToolArgs,
    WrapRunHandler,
    WrapToolExecuteHandler,
)
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart
from pydantic_ai.models import ModelRequestContext
from pydantic_ai.run import AgentRunResult
from pydantic_ai.tools import AgentDepsT, RunContext, ToolDefinition

from stepstream.media import MediaStore, Offloaded, offload_media
from stepstream.producer import _calls, _ends
from stepstream.producer._binding import parent_for, run_id_for, run_writer, with_parent_call
from stepstream.producer._current import annotate_tool_effect as annotate_tool_effect
from stepstream.producer._current import current_run as current_run
from stepstream.producer._current import current_run_id as current_run_id
from stepstream.producer._current import instead_of_persistence
from stepstream.producer._definitions import definitions_of
from stepstream.producer._engines import ATTEMPT_KEY as ATTEMPT_KEY
from stepstream.producer._engines import Attempt as Attempt
from stepstream.producer._engines import refuse_temporal_sandbox_import, refuse_undeclared_engine
from stepstream.producer._log import EventLog
from stepstream.producer._options import DefaultMedia, check_options, split_spec
from stepstream.producer._protocol import StepLog
from stepstream.producer._redaction import Redaction
from stepstream.producer._run import MAX_ERROR_CHARS as MAX_ERROR_CHARS
from stepstream.producer._run import RunWriter, usage_of
from stepstream.producer._run import SnapshotSaved as SnapshotSaved
from stepstream.schemas import StepEvent, ToolEffectTransition

logger = logging.getLogger('stepstream.producer')


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

    redaction: Redaction | None = None
    """What is redacted before anything is written (`Redaction`); default: the policy of
    `log.settings` (`STEPSTREAM_REDACTION`, on unless set to `off`). `Redaction.off()` writes
    every secret an agent handles (docs/security.md)."""

    # Per-capability state: a `for_run` copy starts with fresh values.
    _explicit_run_id_used: bool = field(default=False, init=False, repr=False)
    _default_media: DefaultMedia = field(default_factory=DefaultMedia, init=False, repr=False)
    _run: RunWriter = field(default=None, init=False, repr=False)  # type: ignore[assignment]
    """The run's state and appends, set by `for_run` on its copy (None on the capability itself)."""

    def __post_init__(self) -> None:
        check_options(
            self.log,
            self.run_id,
            self.parent_run_id,
            self.threshold_bytes,
            default_media=self.media_store is None,
        )

    @property
    def threshold_bytes(self) -> int:
        """The media threshold in effect: `media_threshold_bytes`, else the log's settings."""
        if self.media_threshold_bytes is not None:
            return self.media_threshold_bytes
        return self.log.settings.media.media_threshold_bytes

    def _media(self) -> MediaStore:
        """`media_store`, else the S3 bucket of the log's settings (`DefaultMedia`)."""
        if self.media_store is not None:
            return self.media_store
        return self._default_media.store(self.log.settings)

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
        settings, options = split_spec(args, kwargs)
        return cls(log=EventLog.shared(settings), **options)

    def compaction_transcript_handle(self) -> str | None:
        """The run id, as the handle a compaction receipt points back to (None before a run)."""
        return self.run_id

    async def for_run(self, ctx: RunContext[AgentDepsT]) -> AbstractCapability[AgentDepsT]:
        """Bind a copy to this `.run()`: its run id, writer, parent and agent name (`_binding`).

        The run id and the writer id are functions of the run context (and the explicit `run_id`),
        never random: a run re-executed by a durable-execution engine is the same run, same writer.
        """
        agent_name = self.agent_name or (ctx.agent.name if ctx.agent is not None else None)
        if (instead := await instead_of_persistence(self.metadata, agent_name)) is not None:
            return instead  # replayed (`stepstream.replay`): this run writes nothing
        refuse_temporal_sandbox_import()
        refuse_undeclared_engine(ctx.in_durable_context)
        if self.run_id is not None:
            if self._explicit_run_id_used:
                raise ValueError(
                    f'StepPersistence run_id {self.run_id!r} was already used by an earlier run; an explicit '
                    'run_id is for exactly one .run(). Pass conversation_id= to Agent.run to group runs.'
                )
            self._explicit_run_id_used = True
        run_id = run_id_for(self.run_id, self.agent_name, ctx.run_id)
        parent_run_id = parent_for(self.parent_run_id)
        bound = replace(
            self,
            run_id=run_id,
            parent_run_id=parent_run_id,
            agent_name=agent_name,
            metadata=with_parent_call(self.metadata, parent_run_id),
        )
        # Under an engine the media store is only used by the offload operation (an activity or
        # step), so workflow code never builds the S3 client.
        store = None if ctx.in_durable_context else self._media()
        bound._run = run_writer(bound, ctx, store)
        return bound

    # -- durable operations (an engine finds them on the capability) -------------------------

    @durable_operation('seal')
    async def _seal_durably(
        self, ctx: RunContext[Any], first_seq: int, count: int
    ) -> list[StepEvent | ToolEffectTransition]:
        """Journal the batch of records `first_seq .. first_seq + count - 1` as this operation's result.

        Their timestamps, durations and attempt marks were decided by this execution of the run;
        an engine that recovers the run returns the journaled batch instead, so the write that
        follows (and its retries) sends what the first execution decided. The records travel on
        the capability (its run writer), not as arguments: the arguments, which Prefect hashes
        into the operation's cache key, are the same on every execution.
        """
        sealing = self._run.sealing if self._run is not None else []
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
        await self.log.wait_acked([await self.log.append(record) for record in records])
        attempt = previous.next_write() if previous is not None else Attempt.first()
        return attempt.wrote(records, self.log.encode)

    # -- run lifecycle -----------------------------------------------------------------------

    async def wrap_run(self, ctx: RunContext[AgentDepsT], *, handler: WrapRunHandler) -> AgentRunResult[Any]:
        """Make this run the parent of any persisted run started inside it; end a run its caller left.

        When the code driving the run leaves before it ends (a `break` out of `agent.iter()`, a
        stream left early), Pydantic AI cancels the run and calls neither `after_run` nor
        `on_run_error`: the run ends `cancelled` here, saying the caller left (`_ends.left`).
        """
        token = current_run.set(self)
        try:
            return await handler()
        except BaseException as error:
            if self._run is not None:
                await _ends.left(self._run, ctx, error, capture_frontier=self.capture_frontier)
            raise
        finally:
            current_run.reset(token)
            if self._run is not None:
                self._run.close_liveness()  # however the run ended, its writer no longer speaks for it

    async def before_run(self, ctx: RunContext[AgentDepsT]) -> None:
        """Append `run_started` with the run's lineage and metadata, and wait for the broker.

        A durability point, so that no later record of the run can reach the log without it (a
        record the projector cannot place under a registered run stays invisible).
        """
        await _ends.start(self._run, ctx)

    async def after_run(
        self, ctx: RunContext[AgentDepsT], *, result: AgentRunResult[Any]
    ) -> AgentRunResult[Any]:
        """Save the final history if no boundary saved it, append `run_completed`, flush the run.

        A run that ends with `DeferredToolRequests` ends `run_waiting`, its history saved (`_ends.complete`).
        """
        await _ends.complete(self._run, ctx, result)
        return result

    async def on_run_error(self, ctx: RunContext[AgentDepsT], *, error: BaseException) -> AgentRunResult[Any]:
        """Save the live history at failure (if it holds a response), append `run_failed`, re-raise.

        `run_failed` is appended even when the failure snapshot cannot be (S3 down, a record too
        large): the run's end must be in the log. If the broker does not take it in time, the
        `EventLog` keeps it and sends it once the broker is back; the run's own error wins either
        way, with a note saying what could not be recorded.
        """
        await _ends.fail(self._run, ctx, error, capture_frontier=self.capture_frontier)
        raise error

    # -- model requests ----------------------------------------------------------------------

    async def before_model_request(
        self, ctx: RunContext[AgentDepsT], request_context: ModelRequestContext
    ) -> ModelRequestContext:
        """Append `model_request_started` (and snapshot the frontier when asked)."""
        run = self._run
        if self.capture_frontier:
            run.live = (ctx.messages, ctx.run_step)
            await run.snapshot(ctx, ctx.messages, ctx.run_step)
        await run.event(ctx, 'model_request_started', definitions=definitions_of(request_context))
        run.request_started = time.perf_counter_ns()
        return request_context

    async def after_model_request(
        self, ctx: RunContext[AgentDepsT], *, request_context: ModelRequestContext, response: ModelResponse
    ) -> ModelResponse:
        """Append `model_request_completed` with the response's usage and the request's duration."""
        run = self._run
        duration_us = (time.perf_counter_ns() - run.request_started) // 1000
        await run.event(ctx, 'model_request_completed', usage=usage_of(response), duration_us=duration_us)
        return response

    async def on_model_request_error(
        self, ctx: RunContext[AgentDepsT], *, request_context: ModelRequestContext, error: Exception
    ) -> ModelResponse:
        """Append `model_request_failed` and re-raise; `on_run_error` saves the history."""
        run = self._run
        duration_us = (time.perf_counter_ns() - run.request_started) // 1000
        await run.event(ctx, 'model_request_failed', error=repr(error), duration_us=duration_us)
        raise error

    # -- tools ---------------------------------------------------------------------------------

    async def before_tool_execute(
        self, ctx: RunContext[AgentDepsT], *, call: ToolCallPart, tool_def: ToolDefinition, args: Any
    ) -> Any:
        """Write ahead: the `started` transition is acknowledged before the tool body runs."""
        await _calls.started(self._run, ctx, call)
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
        await _calls.completed(self._run, ctx, call)
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
        await _calls.failed(self._run, ctx, call, error)
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
        """Record a body that asked the model to retry, ended with `ToolFailed`, or deferred its call.

        Pydantic AI treats those as control flow and calls neither `after_tool_execute` nor
        `on_tool_execute_error` for them; without this the call's effect would stay `started`
        (`unknown_after_crash`) although its body ended (`_calls.execute`).
        """
        return await _calls.execute(self._run, ctx, call, args, handler)

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
        return await _calls.annotated(
            run=self._run, ctx=ctx, call=call, key=idempotency_key, summary=effect_summary
        )

    # -- graph nodes ---------------------------------------------------------------------------

    async def after_node_run(
        self, ctx: RunContext[AgentDepsT], *, node: AgentNode[AgentDepsT], result: NodeResult[AgentDepsT]
    ) -> NodeResult[AgentDepsT]:
        """Snapshot after a settled tool cycle, with the pending tool-return request folded in.

        The live list is kept by reference (not copied) so that a later failure can save what
        the run held at that moment; the graph only mutates that list in place after the first
        boundary.
        """
        run = self._run
        run.live = (ctx.messages, ctx.run_step)
        if self.capture_frontier and isinstance(node, ModelRequestNode):
            await run.snapshot(ctx, ctx.messages, ctx.run_step)
        if isinstance(node, CallToolsNode):
            messages: Sequence[ModelMessage] = ctx.messages
            if isinstance(result, ModelRequestNode):
                messages = [*ctx.messages, result.request]
            await run.snapshot(ctx, messages, ctx.run_step, settled_only=True)
        return result
