"""Continuing, forking and resuming a run: a snapshot's messages, for `Agent.run(message_history=...)`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stepstream.erasure import ContentErased, ErasureError, is_sealed_text
from stepstream.errors import ConversationLive, NotFound, NotWaiting, UsageError
from stepstream.schemas import RESUMES_KEY, ContinuableSnapshot, ToolEffectRecord

if TYPE_CHECKING:
    from pydantic_ai.messages import ModelMessage
    from pydantic_ai.tools import DeferredToolResults

    from stepstream.readmodel._reader import ProjectionReader


async def continue_run(
    reader: ProjectionReader, *, run_id: str, include_interrupted: bool = False
) -> list[ModelMessage]:
    """The latest continuable history of a run, ready for `Agent.run(message_history=...)`.

    Only `complete` snapshots unless `include_interrupted=True` (check
    `list_unresolved_tool_effects` before resuming from an interrupted one). Raises
    `LookupError` when the run has no such snapshot, and `ContentErased` when its content was
    erased (`stepstream forget`).
    """
    snapshot = await reader.latest_snapshot(run_id, include_interrupted=include_interrupted)
    if snapshot is None:
        kind = 'snapshot' if include_interrupted else 'complete snapshot'
        raise LookupError(f'no {kind} for run_id {run_id!r} in the projection')
    return _content(snapshot)


async def continue_conversation(
    reader: ProjectionReader,
    conversation_id: str,
    *,
    allow_live: bool = False,
    include_interrupted: bool = False,
) -> list[ModelMessage]:
    """The latest continuable history of a conversation: its latest-started run's (`continue_run`).

    Refused (`ConversationLive`, naming the run and its writer) while that run is live (reads
    `running`: its writer is still at it), unless `allow_live=True`; `NotFound` for a conversation
    the projection holds no run of (decision 0062).
    """
    conversation = await reader.get_conversation(conversation_id)
    if conversation is None:
        raise NotFound(f'no run of conversation {conversation_id!r} in the projection')
    run = conversation.latest_run
    if conversation.live and not allow_live:
        raise ConversationLive(
            f'conversation {conversation_id!r} is live: its latest run {run.run_id!r} is running, '
            f'written by {run.registration_id!r}; wait for it to end, or pass allow_live=True to '
            'continue from its history anyway',
            run.run_id,
            run.registration_id,
        )
    return await continue_run(reader, run_id=run.run_id, include_interrupted=include_interrupted)


async def fork_run(
    reader: ProjectionReader,
    *,
    run_id: str,
    snapshot_seq: int | None = None,
    include_interrupted: bool = False,
) -> list[ModelMessage]:
    """The messages of any retained snapshot, to start a new run from.

    Without `snapshot_seq`, the latest complete one (or the latest of any state with
    `include_interrupted=True`), as `continue_run` picks it.
    """
    if snapshot_seq is None:
        return await continue_run(reader, run_id=run_id, include_interrupted=include_interrupted)
    snapshot = await reader.get_snapshot(run_id, snapshot_seq)
    if snapshot is None:
        raise LookupError(f'run_id {run_id!r} has no snapshot {snapshot_seq} in the projection')
    return _content(snapshot)


def _content(snapshot: ContinuableSnapshot) -> list[ModelMessage]:
    if snapshot.erased:
        raise ContentErased(
            f'the content of run {snapshot.run_id!r} (conversation {snapshot.conversation_id!r}) was '
            'erased: its structure remains, its messages cannot be continued from'
        )
    return snapshot.messages


@dataclass(frozen=True)
class Resumption:
    """What resumes a run that ended waiting, in any process: `agent.run(**resumption.run_kwargs())`."""

    run_id: str
    """The run it resumes."""
    message_history: list[ModelMessage]
    """The run's final history, its deferred calls included (its `interrupted` snapshot)."""
    deferred_tool_results: DeferredToolResults
    """Each deferred call's decision, as Pydantic AI takes it."""
    conversation_id: str | None
    """The run's conversation: the resumed run continues it."""
    metadata: dict[str, str] = field(default_factory=dict)
    """For the resumed run's capability (`StepPersistence(metadata=...)`): names the run it resumes."""

    def run_kwargs(self) -> dict[str, Any]:
        """`message_history`, `deferred_tool_results` and `conversation_id`, for `Agent.run`."""
        return {
            'message_history': self.message_history,
            'deferred_tool_results': self.deferred_tool_results,
            'conversation_id': self.conversation_id,
        }


async def resume_run(reader: ProjectionReader, run_id: str) -> Resumption:
    """The history and the decisions that resume `run_id`, a run that ended waiting (`run_waiting`).

    ```python
    resumption = await resume_run(reader, 'support-0193...')
    capability = StepPersistence(log=log, metadata=resumption.metadata)
    result = await agent.run(**resumption.run_kwargs())  # with `capability` among its capabilities
    ```

    Each deferred call's first decision on the log (`stepstream approve`, `deny`, `complete`, or
    `decide_deferred_call`) becomes its entry in `DeferredToolResults`: an approval (with its changed
    arguments, as `ToolApproved(override_args=...)`), a denial (`ToolDenied` with its message), an
    outside call's result, or its error (as `ModelRetry`, which the model sees). Refused
    (`NotWaiting`) for a run that did not end waiting, for one another run resumed already (status
    `resumed`, naming that run), and while one of its calls still waits, named; `ContentErased`, naming
    the call, when a call's content was sealed and its key destroyed (`stepstream forget`). The resumed run's
    capability, given `Resumption.metadata`, marks the waiting run resumed on the log when it starts.
    """
    from pydantic_ai.tools import DeferredToolResults

    run = await reader.get_run(run_id)
    if run is None:
        raise UsageError(f'no run {run_id!r} in the projection')
    if run.status == 'resumed':
        raise NotWaiting(f'run {run_id!r} was resumed already, by run {run.resumed_by!r}')
    if run.status != 'waiting':
        raise NotWaiting(f'run {run_id!r} is {run.status}: only a run that ended waiting resumes')
    results = DeferredToolResults()
    for effect in await reader.list_tool_effects(run_id):
        if effect.deferral is not None:
            _add_decision(results, effect)
    history = await continue_run(reader, run_id=run_id, include_interrupted=True)
    return Resumption(run_id, history, results, run.conversation_id, {RESUMES_KEY: run_id})


def _add_decision(results: DeferredToolResults, effect: ToolEffectRecord) -> None:
    """The call's decision in Pydantic AI's terms; `NotWaiting` while it has none."""
    from pydantic_ai.exceptions import ModelRetry
    from pydantic_ai.tools import ToolApproved, ToolDenied

    decision, call = effect.resolution, effect.tool_call_id
    if effect.content_erased:
        raise ContentErased(
            f'tool call {call!r} ({effect.tool_name}) of run {effect.run_id!r} cannot resume: its arguments '
            'and its decision were erased (stepstream forget)'
        )
    if decision is not None and any(
        is_sealed_text(v) for v in (decision.args, decision.result, decision.error)
    ):
        raise ErasureError(
            f'tool call {call!r} ({effect.tool_name}) of run {effect.run_id!r}: its decision is sealed '
            '(erasure is on for its writer): resume it with STEPSTREAM_ERASURE_KEY set'
        )
    if decision is None:
        what = 'an approval' if effect.deferral == 'approval' else 'its result'
        raise NotWaiting(
            f'tool call {call!r} ({effect.tool_name}) of run {effect.run_id!r} still waits for {what}: '
            'decide it first (stepstream approve, deny or complete)'
        )
    if decision.resolution == 'approved':
        args = None if decision.args is None else json.loads(decision.args)
        results.approvals[call] = True if args is None else ToolApproved(override_args=args)
    elif decision.resolution == 'denied':
        results.approvals[call] = ToolDenied(decision.error or 'The tool call was denied.')
    elif decision.resolution == 'returned':
        results.calls[call] = json.loads(decision.result or 'null')
    else:  # failed
        results.calls[call] = ModelRetry(decision.error or 'The tool call failed.')
