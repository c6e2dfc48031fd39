"""The innermost persisted run of a task, and `annotate_tool_effect`, which writes through it.

`StepPersistence.wrap_run` sets `current_run` around a run; a delegate reads it to learn its parent,
and a tool body reads it to annotate its call.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any, Protocol

from pydantic_ai.messages import ToolCallPart
from pydantic_ai.tools import RunContext

logger = logging.getLogger('stepstream.producer')


class PersistedRun(Protocol):
    """What `current_run` holds: a run-bound `StepPersistence`, as its delegates and tool bodies see it.

    A protocol, so that this module stays below the capability that sets it.
    """

    run_id: str | None

    async def annotate(
        self,
        ctx: RunContext[Any],
        call: ToolCallPart,
        *,
        idempotency_key: str | None,
        effect_summary: str | None,
    ) -> bool:
        """Append an `annotated` transition for a call of this run (False: not its call, nothing written)."""
        ...


current_run: ContextVar[PersistedRun | None] = ContextVar('stepstream.current_run', default=None)
"""The run-bound capability of the innermost persisted run in this task.

Set around a run by `StepPersistence.wrap_run`. A delegate started from a tool reads it in
`for_run` to learn its parent; `annotate_tool_effect` reads it to find the run to annotate.
A ContextVar (not pydantic-ai's own run context) because the nested run overwrites those
before the delegate's capability can see its parent.
"""


current_call: ContextVar[tuple[str, str] | None] = ContextVar('stepstream.current_call', default=None)
"""The tool call whose body runs in this task, as (run id, tool call id); None outside a tool body.

Set by the capability around each tool body, so that a delegate started there records the exact
call that started it (`PARENT_CALL_KEY`) beside its parent run.
"""


def current_run_id() -> str | None:
    """The run id of the innermost persisted run in this task, or None.

    Pass it as `parent_run_id` to a delegate in another process, where ContextVars do not reach.
    """
    run = current_run.get()
    return run.run_id if run is not None else None


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


class Replaying(Protocol):
    """What `stepstream.replay` puts in place of the `StepPersistence` of a run started while it replays."""

    async def capability_for(self, agent_name: str | None) -> Any | None:
        """The capability to use instead of the run's `StepPersistence`, or None to persist as usual.

        A blank capability writes nothing; a delegate's is its own replay; a fork's live part persists.
        """
        ...


replaying: ContextVar[Replaying | None] = ContextVar('stepstream.replaying', default=None)
"""Set by `stepstream.replay` in the task that replays; None otherwise.

While it is set, a `StepPersistence` writes nothing, and asks it what to do instead: a replay
re-executes recorded runs, and its steps are not a production run's. The one exception is a
fork's own `StepPersistence`, whose metadata names the run it forks (`FORKED_FROM`): a fork is a
new run, written like any other.
"""

FORKED_FROM = 'stepstream.forked_from'
"""Run metadata of a fork (`stepstream replay --from-step`): the recorded run it was forked from."""
FORKED_AT_STEP = 'stepstream.forked_at_step'
"""Run metadata of a fork: the step from which a live model answered instead of the recording."""


async def instead_of_persistence(metadata: dict[str, str], agent_name: str | None) -> Any | None:
    """While replaying, what a `StepPersistence` with this run metadata uses instead (None: persist)."""
    replay = replaying.get()
    if replay is None or FORKED_FROM in metadata:
        return None
    return await replay.capability_for(agent_name)
