"""A run's tool calls on the ledger: started (write-ahead), completed, failed, deferred.

The capability's tool hooks hand each call here. A call's `started` transition is acknowledged
before its body runs, so no side effect happens without a record; its end says how the body
ended. A body that defers the call (`CallDeferred`, `ApprovalRequired`), and a call the agent
never ran because it needs approval (`requires_approval=True`), end as `deferred`: they wait for
a decision or an outside result, which is not a crash and never in doubt
(docs/decisions/0053-deferred-calls-and-waiting.md).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic_ai import DeferredToolRequests
from pydantic_ai.exceptions import (
    ApprovalRequired,
    CallDeferred,
    ModelRetry,
    ToolFailed,
    ToolFailedError,
    ToolRetryError,
)
from pydantic_ai.messages import ToolCallPart
from pydantic_ai.tools import RunContext
from pydantic_core import to_json

from stepstream.erasure import SEALED_CALL_ARGS, SEALED_CALL_METADATA
from stepstream.producer._current import current_call
from stepstream.producer._run import RunWriter
from stepstream.schemas import Deferral

ENDED_AS_CONTROL_FLOW = (ModelRetry, ToolFailed, ToolRetryError, ToolFailedError)
"""How a body ends that Pydantic AI treats as control flow: neither `after_tool_execute` nor
`on_tool_execute_error` is called for it."""


async def started(run: RunWriter, ctx: RunContext[Any], call: ToolCallPart) -> None:
    """Write ahead: the call's `started` transition and event, acknowledged before its body runs."""
    await run.effect(call, 'started')
    await run.event(ctx, 'tool_call_started', tool_call_id=call.tool_call_id, tool_name=call.tool_name)
    await run.durable(ctx)
    run.open_calls[call.tool_call_id] = time.perf_counter_ns()


async def completed(run: RunWriter, ctx: RunContext[Any], call: ToolCallPart) -> None:
    """The call's `completed` transition and event (acknowledged with the next durability point)."""
    duration_us = _duration(run, call)
    await run.effect(call, 'completed')
    await run.event(
        ctx,
        'tool_call_completed',
        tool_call_id=call.tool_call_id,
        tool_name=call.tool_name,
        duration_us=duration_us,
    )


async def failed(run: RunWriter, ctx: RunContext[Any], call: ToolCallPart, error: BaseException) -> None:
    """The call's `failed` transition and its `tool_call_failed` event."""
    duration_us = _duration(run, call)
    await run.effect(call, 'failed', error=repr(error))
    await run.event(
        ctx,
        'tool_call_failed',
        tool_call_id=call.tool_call_id,
        tool_name=call.tool_name,
        error=repr(error),
        duration_us=duration_us,
    )


async def annotated(
    *, run: RunWriter, ctx: RunContext[Any], call: ToolCallPart, key: str | None, summary: str | None
) -> bool:
    """The call's `annotated` transition, acknowledged (`annotate_tool_effect`); False if not this run's call.

    A call is this run's when `ctx` is this run's and its `started` transition was recorded.
    """
    if ctx.run_id != run.context_run_id or call.tool_call_id not in run.open_calls:
        return False
    await run.effect(call, 'annotated', idempotency_key=key, effect_summary=summary)
    await run.durable(ctx)
    return True


async def execute(
    run: RunWriter,
    ctx: RunContext[Any],
    call: ToolCallPart,
    args: Any,
    handler: Callable[[Any], Awaitable[Any]],
) -> Any:
    """Run the body, recording the ends that Pydantic AI passes by the other hooks.

    A body that asks the model to retry (`ModelRetry`) or ends with `ToolFailed` is `failed`; one
    that defers its call (`CallDeferred`, `ApprovalRequired`) is `deferred` at once, so that the
    call never reads in doubt while it waits. A body that is cancelled leaves its call `started`:
    whether its effect happened is not known.
    """
    within = current_call.set((run.run_id, call.tool_call_id))
    try:
        return await handler(args)
    except ENDED_AS_CONTROL_FLOW as error:
        if call.tool_call_id in run.open_calls:
            await failed(run, ctx, call, error)
        raise
    except CallDeferred as deferral:
        await deferred(run, ctx, call, deferral.kind, deferral.metadata)
        raise
    except ApprovalRequired as deferral:
        await deferred(run, ctx, call, 'approval', deferral.metadata)
        raise
    finally:
        current_call.reset(within)


async def deferred(
    run: RunWriter,
    ctx: RunContext[Any],
    call: ToolCallPart,
    deferral: Deferral,
    metadata: dict[str, Any] | None,
) -> None:
    """The call's `deferred` transition (what it waits for, its arguments and metadata) and event.

    With erasure on, the arguments and the metadata are sealed with the conversation's key (decision 0033).
    """
    if call.tool_call_id in run.deferred:
        return
    run.deferred.add(call.tool_call_id)
    _duration(run, call)
    redact = run.redaction.value
    args = to_json(redact(call.args_as_dict())).decode()
    given = None if metadata is None else to_json(redact(metadata), fallback=repr).decode()
    if run.log.sealer is not None:  # erasure on: the person's content, sealed as a snapshot's is
        key = await run.log.sealer.key_for(run.conversation_id or run.run_id)
        where = (run.run_id, call.tool_call_id)
        args = key.seal_text(args, *where, SEALED_CALL_ARGS)
        given = None if given is None else key.seal_text(given, *where, SEALED_CALL_METADATA)
    await run.effect(call, 'deferred', deferral=deferral, args=args, deferral_metadata=given)
    await run.event(ctx, 'tool_call_deferred', tool_call_id=call.tool_call_id, tool_name=call.tool_name)


async def waiting(run: RunWriter, ctx: RunContext[Any], requests: DeferredToolRequests) -> None:
    """Record every call a run ends waiting on (`DeferredToolRequests`) that is not recorded yet.

    A tool declared `requires_approval=True` never reaches its body, so its call is first seen here.
    """
    for call in [*requests.approvals, *requests.calls]:
        await deferred(
            run, ctx, call, requests.kind(call.tool_call_id), requests.metadata.get(call.tool_call_id)
        )


def _duration(run: RunWriter, call: ToolCallPart) -> int | None:
    """How long the call's body ran, in microseconds; None for a call not recorded as started."""
    began = run.open_calls.pop(call.tool_call_id, None)
    return None if began is None else (time.perf_counter_ns() - began) // 1000
