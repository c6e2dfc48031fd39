"""How a run begins and ends on the log: started, completed, waiting, failed, cancelled, left.

Every way of running an agent ends in one of these, written by the run's own writer (decision
0014: what the writer knows, it records): `run_completed` for a result; `run_waiting` for a run
that ended with `DeferredToolRequests`, its final history saved so another process can resume it
(decision 0053); `run_failed` for an error; `run_cancelled` for a cancelled task, and for a caller
that left the run before it ended (an `iter()` it stopped driving, a stream it stopped reading),
which is not a crash. A process that stops with runs open ends them too (`RunWriter.end_by_process`).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from pydantic_ai import DeferredToolRequests
from pydantic_ai.messages import ModelResponse
from pydantic_ai.run import AgentRunResult
from pydantic_ai.tools import RunContext

from stepstream.errors import UsageError
from stepstream.ids import is_run_id
from stepstream.producer import _calls
from stepstream.producer._redaction import REDACTION_KEY
from stepstream.producer._run import MAX_ERROR_CHARS, RunWriter
from stepstream.schemas import RESUMED_BY_KEY, RESUMES_KEY, EventKind, StepEvent

CALLER_LEFT = (
    'the caller left the run before it ended (it stopped driving agent.iter() or reading the stream); '
    'its process did not crash'
)
"""The error of the `run_cancelled` written for a run its caller abandoned."""

CANCELLED = (
    'the run was cancelled before it ended: its task was cancelled, or its caller stopped reading its '
    'events (run_stream_events); its process did not crash'
)
"""How the `run_cancelled` of a cancelled task begins (its `CancelledError` follows)."""


async def start(run: RunWriter, ctx: RunContext[Any]) -> None:
    """`before_run`: append `run_started` and wait for the broker, then open the run's liveness."""
    run.conversation_id = ctx.conversation_id
    resumes = run.metadata.get(RESUMES_KEY)
    if resumes is not None and (not is_run_id(resumes) or resumes == run.run_id):
        raise UsageError(f'metadata {RESUMES_KEY!r} names no other run to resume: {resumes[:100]!r}')
    await run.event(ctx, 'run_started', metadata={**run.metadata, REDACTION_KEY: run.redaction.label})
    if resumes is not None:
        await _mark_resumed(run, resumes)
    try:
        await run.durable(ctx)
    except Exception as error:
        # Pydantic AI does not call `on_run_error` for a failure in `before_run`.
        await record_failure(run, ctx, error, repr(error))
        raise
    # Acknowledged, so heartbeats never reach the log before the run they speak for.
    run.open = run.log.liveness.open(run.run_id, heartbeat=run.heartbeat, end=run.end_by_process)


async def _mark_resumed(run: RunWriter, waiting: str) -> None:
    """Append `run_resumed` keyed by the run this one resumes (`resume_run`'s metadata), beside its trail.

    It lands in the waiting run's partition, after its `run_waiting`: the projector links the two
    there (decision 0057). It takes no `seq`, of either run.
    """
    mark = StepEvent(
        run_id=waiting,
        seq=0,
        writer_id=run.writer_id,
        timestamp=datetime.now(UTC),
        kind='run_resumed',
        agent_name=run.agent_name,
        conversation_id=run.conversation_id,
        metadata={RESUMED_BY_KEY: run.run_id},
    )
    await run.send_beside(mark)


async def complete(run: RunWriter, ctx: RunContext[Any], result: AgentRunResult[Any]) -> None:
    """`after_run`: the final history unless a boundary saved it, `run_completed`, a durability point.

    A run whose output is `DeferredToolRequests` ends `run_waiting` instead: each call it waits on
    is `deferred`, and its final history, the pending calls included, is saved whatever its state
    (`interrupted`: calls without results), so that `continue_run(..., include_interrupted=True)`
    hands another process what to resume with `deferred_tool_results`.
    """
    run.ended = True
    step = run.last_snapshot_step if run.last_snapshot_step is not None else ctx.run_step
    waits = isinstance(result.output, DeferredToolRequests)
    if waits:
        await _calls.waiting(run, ctx, result.output)
    await run.snapshot(ctx, result.all_messages(), step, settled_only=not waits, changed_only=True)
    run.close_liveness()
    await run.event(ctx, 'run_waiting' if waits else 'run_completed')
    await run.durable(ctx)


async def fail(run: RunWriter, ctx: RunContext[Any], error: BaseException, *, capture_frontier: bool) -> None:
    """`on_run_error`: the live history at failure (if it holds a response), then `run_failed`."""
    reason = f'{CANCELLED} ({error!r})' if isinstance(error, asyncio.CancelledError) else repr(error)
    await _end_with_live_history(run, ctx, error, reason, capture_frontier=capture_frontier)


async def left(run: RunWriter, ctx: RunContext[Any], error: BaseException, *, capture_frontier: bool) -> None:
    """The run ended without `after_run` or `on_run_error`: its caller left it, or it is being torn down.

    Pydantic AI cancels the run when the code driving it leaves early (a `break` out of
    `agent.iter()`, a `run_stream` left after its first chunk, a `GeneratorExit`); no other hook
    hears of it. The run ends `run_cancelled`, saying the caller left, with the live history
    saved as at a failure. Nothing is written for a run that never started on the log, nor under
    a durable-execution engine, which owns the run and recovers it.
    """
    if run.ended or run.seq == 0 or run.durable_engine:
        return
    reason = CALLER_LEFT if isinstance(error, asyncio.CancelledError | GeneratorExit) else repr(error)
    await _end_with_live_history(run, ctx, error, reason, capture_frontier=capture_frontier)


async def _end_with_live_history(
    run: RunWriter, ctx: RunContext[Any], error: BaseException, reason: str, *, capture_frontier: bool
) -> None:
    run.ended = True
    if run.live is not None:
        live, step_index = run.live
        messages = list(live)
        has_response = any(isinstance(m, ModelResponse) for m in messages)
        if has_response or (capture_frontier and messages):
            try:
                await run.snapshot(ctx, messages, step_index)
            except Exception as snapshot_error:
                error.add_note(f'stepstream could not save or confirm the failure snapshot: {snapshot_error}')
                reason = f'{reason} (failure snapshot: {snapshot_error!r})'
    await record_failure(run, ctx, error, reason)


async def record_failure(run: RunWriter, ctx: RunContext[Any], error: BaseException, reason: str) -> None:
    """Append `run_failed` (`run_cancelled` for a cancelled or left run); say so on `error` if unconfirmed.

    Cancellation is not a failure of the run: whoever cancelled it decided so, and views show
    `cancelled` rather than an error to investigate.
    """
    run.ended = True
    if len(reason) > MAX_ERROR_CHARS:  # an error text must not make the failure record too large
        reason = f'{reason[:MAX_ERROR_CHARS]}... ({len(reason) - MAX_ERROR_CHARS} more characters)'
    cancelled = isinstance(error, asyncio.CancelledError | GeneratorExit)
    kind: EventKind = 'run_cancelled' if cancelled else 'run_failed'
    run.close_liveness()
    if run.ended_by_process:
        return  # its process already wrote the end (`EventLog.close`, SIGTERM)
    try:
        await run.event(ctx, kind, error=reason)
        await run.durable(ctx)
    except Exception as log_error:
        error.add_note(
            f'stepstream could not confirm the failure record ({log_error}); it is kept and sent again '
            'while the EventLog stays open'
        )
