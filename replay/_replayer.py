"""Re-executing an agent against a recorded run: the recorded model's answers served, each request checked.

`replay_run` runs the agent's own code once more. A capability of the replay's own sits around
every model request (it never calls a model: it compares the request the code built with the
recorded one and returns the recorded response) and every tool call (`recorded`: the recorded
result, the tool not run; `live`: the tool runs and its result is compared). The first
difference stops the run and is the report's divergence.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

from pydantic_ai import Agent, ModelRetry
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import ToolFailed
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.tools import RunContext, ToolDefinition
from pydantic_core import to_jsonable_python

from stepstream.producer import definitions_of, fingerprint, replaying
from stepstream.replay._compare import as_json, normalised, request_difference
from stepstream.replay._recording import NotReplayable, Recording, load_recording
from stepstream.replay._report import NOT_RECORDED, Divergence, Outcome, ReplayReport, ToolMode
from stepstream.schemas import RunRecord


class _Muted:
    """While a replay starts: the replayed run's own `StepPersistence` writes nothing."""

    async def capability_for(self, agent_name: str | None) -> Any | None:
        return AbstractCapability()


MUTED = _Muted()


class _Stop(Exception):
    """Ends the replayed run: the report is already decided."""


def _never(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    raise AssertionError('a replay serves every model request from the recording; no model is called')


class Replayer(AbstractCapability[Any]):
    """Serves the recording to one replayed run and notes the first divergence."""

    def __init__(
        self,
        recording: Recording,
        tools: ToolMode,
        *,
        reader: Any,
        live_from: int | None = None,
        root: Replayer | None = None,
    ) -> None:
        self.recording = recording
        self.tools = tools
        self.reader = reader
        self.root = root or self
        """The replayer of the run replayed; a delegate's notes its divergence there."""
        self.children: list[RunRecord] | None = None
        """The recorded delegates not yet replayed, in the order they started (read when first asked)."""
        self.step = 0
        self.live_from = live_from
        """A fork's step from which the live model answers and the tools run (`stepstream.replay.fork`)."""
        self.served = 0
        self.divergence: Divergence | None = None
        self.ended: str | None = None
        """Why the replay ended before the agent did, when that is a match (the recording ends there)."""
        self.in_doubt: str | None = None

    def stop(self, divergence: Divergence) -> _Stop:
        if self.root is not self:
            divergence.detail = f'in delegate {self.recording.run.run_id}: {divergence.detail}'
        if self.root.divergence is None:
            self.root.divergence = divergence
        return _Stop(divergence.detail)

    async def wrap_run(self, ctx: RunContext[Any], *, handler: Any) -> Any:
        """While this run runs, a run it starts (a delegate) asks this replayer what to do."""
        token = replaying.set(self)
        try:
            return await handler()
        finally:
            replaying.reset(token)

    async def capability_for(self, agent_name: str | None) -> Any | None:
        """What a delegate started while replaying uses instead of its `StepPersistence`.

        Its own replay, against the next recorded delegate of its agent name this run started; or
        None (persisted as usual) in a fork's live part.
        """
        if self.live_from is not None and self.step >= self.live_from:
            return None
        if self.children is None:
            tree = await self.reader.run_tree(self.recording.run.run_id)
            self.children = [r for r in tree if r.parent_run_id == self.recording.run.run_id]
        child = next((r for r in self.children if r.agent_name == agent_name), None)
        if child is None:
            raise self.stop(
                Divergence(
                    self.step,
                    'extra_request',
                    f'the code started a delegate ({agent_name}) the recording does not have',
                )
            )
        self.children.remove(child)
        try:
            recording = await load_recording(self.reader, child.run_id)
        except NotReplayable as exc:
            raise self.stop(
                Divergence(self.step, 'request_content', f'its delegate cannot be replayed: {exc}')
            ) from None
        return Replayer(recording, self.tools, reader=self.reader, root=self.root)

    async def wrap_model_request(
        self, ctx: RunContext[Any], *, request_context: Any, handler: Any
    ) -> ModelResponse:
        """Compare the request the code built with the recorded one; answer with the recorded response."""
        recording, k, step = self.recording, self.served, ctx.run_step
        self.step = step
        live = self.live_from is not None and step >= self.live_from
        if live and (step > self.live_from or k >= len(recording.requests)):  # type: ignore[operator]
            return await handler(request_context)  # past the recording: the fork's own model
        replayed = request_context.messages[-1]
        if k >= len(recording.requests):
            raise self.stop(
                Divergence(
                    step,
                    'extra_request',
                    'the code made a model request the recording does not have',
                    None,
                    normalised(replayed),
                )
            )
        names = {t.name for t in request_context.model_request_parameters.function_tools}
        # A run's last request, snapshotted before it was sent, carries no instructions yet.
        pending = k >= len(recording.responses)
        found = (
            request_difference(recording.requests[k], replayed, names, instructions=not pending)
            if isinstance(replayed, ModelRequest)
            else ('request_content', normalised(recording.requests[k]), normalised(replayed))
        )
        if found is None:
            found = _definitions_difference(recording.definitions.get(step), request_context)
        if found is not None:
            kind, was, now = found
            raise self.stop(Divergence(step, kind, _SAY[kind], was, now))
        if live:  # the fork's first live step: its request matched the recorded one
            return await handler(request_context)
        if k >= len(recording.responses):  # the recording ends at this request (its model failed, or a crash)
            if recording.in_doubt:  # it crashed after this request, in a tool whose end was never written
                self.in_doubt = (
                    f'the recording ends at step {step}, with {recording.in_doubt_text()} started and no '
                    'recorded end: whether it ran is not known, so replay stops here'
                )
                raise _Stop(self.in_doubt)
            self.ended = f"the recording ends at step {step}'s request, which matched"
            raise _Stop(self.ended)
        self.served += 1
        return copy.deepcopy(recording.responses[k])

    async def on_tool_validate_error(
        self, ctx: RunContext[Any], *, call: ToolCallPart, tool_def: ToolDefinition, args: Any, error: Any
    ) -> Any:
        """A recorded call the tool now refuses (its parameters changed) is a `tool_arguments` divergence."""
        if _ended(self.recording.outcome(call.tool_call_id)) == 'retried':
            raise error  # refused in the recording too: the retry prompts are compared in the next request
        raise self.stop(
            Divergence(
                ctx.run_step,
                'tool_arguments',
                f'tool {call.tool_name!r} no longer accepts the recorded arguments',
                call.args_as_dict(),
                {'error': str(error), 'parameters': tool_def.parameters_json_schema},
                call.tool_name,
                call.tool_call_id,
            )
        )

    async def wrap_tool_execute(
        self, ctx: RunContext[Any], *, call: ToolCallPart, tool_def: ToolDefinition, args: Any, handler: Any
    ) -> Any:
        """`recorded`: the recorded result (or retry) without running the tool; `live`: run it and compare."""
        step, call_id, name = ctx.run_step, call.tool_call_id, call.tool_name
        if self.live_from is not None and step >= self.live_from:
            return await handler(args)  # a fork's live step: its calls are new
        outcome, error = self.recording.outcome(call_id), self.recording.failed.get(call_id)
        if outcome is None and error is not None:
            if self.tools == 'live':
                try:
                    again = await handler(args)
                except Exception:  # it raises again, as recorded
                    self.ended = f'tool {name!r} raised at step {step}, as recorded ({error})'
                    raise _Stop(self.ended) from None
                raise self.stop(
                    Divergence(
                        step,
                        'tool_result',
                        _SAY['tool_result'],
                        {'error': error},
                        again,
                        name,
                        call_id,
                    )
                )
            self.ended = f'the recorded call {name!r} ({call_id}) raised: {error}'
            raise _Stop(self.ended)
        if outcome is None or _ended(outcome) == 'interrupted':
            self.in_doubt = (
                f'step {step}: tool {name!r} ({call_id}) has no recorded end'
                + (' (in doubt)' if call_id in self.recording.in_doubt else '')
                + ': whether it ran is not known, so replay stops here'
            )
            raise _Stop(self.in_doubt)
        ended, recorded = _ended(outcome), outcome.content
        message = recorded if isinstance(recorded, str) else as_json(recorded)
        if self.tools == 'recorded':
            if ended == 'retried':
                raise ModelRetry(message)
            if ended == 'failed':
                raise ToolFailed(message)
            return copy.deepcopy(recorded)
        raised: Exception | None = None
        try:
            result: Any = await handler(args)
            replayed: Any = result
        except (ModelRetry, ToolFailed) as exc:
            raised, replayed = exc, {'retried' if isinstance(exc, ModelRetry) else 'failed': exc.message}
        was = recorded if ended == 'success' else {ended: recorded}
        if to_jsonable_python(was, fallback=str) != to_jsonable_python(replayed, fallback=str):
            raise self.stop(
                Divergence(step, 'tool_result', _SAY['tool_result'], was, replayed, name, call_id)
            )
        if raised is not None:
            raise raised
        return result


def _ended(outcome: ToolReturnPart | RetryPromptPart | None) -> str | None:
    """How a recorded call ended: `success`, `retried`, `failed`, `denied`, `interrupted`; None: no end."""
    if outcome is None:
        return None
    return 'retried' if isinstance(outcome, RetryPromptPart) else outcome.outcome


def _definitions_difference(
    recorded: tuple[str, dict[str, Any]] | None, request_context: Any
) -> tuple[str, Any, Any] | None:
    """(kind, recorded, replayed) when the request's tools, output or settings are not the recorded ones."""
    if recorded is None:
        return None  # written before schema v6: not checked (the report says so)
    text = definitions_of(request_context)
    if fingerprint(text) == recorded[0]:
        return None
    was, now = recorded[1], json.loads(text)
    if was == now:
        return None  # the same definitions written in another order
    if was.get('tools') != now['tools']:
        old_tools = {t['name']: t for t in was.get('tools', [])}
        new_tools = {t['name']: t for t in now['tools']}
        changed = sorted(
            n for n in old_tools.keys() | new_tools.keys() if old_tools.get(n) != new_tools.get(n)
        )
        return (
            'tool_definitions',
            {n: old_tools.get(n) for n in changed},
            {n: new_tools.get(n) for n in changed},
        )
    if was.get('output') != now['output']:
        return 'output_type', was.get('output'), now['output']
    return 'settings', was.get('settings'), now['settings']


_SAY = {
    'tool_definitions': 'the tools offered to the model are defined otherwise than recorded',
    'output_type': 'the output type (mode, output tools or schema) differs from the recorded one',
    'settings': 'the model settings differ from the recorded ones',
    'instructions': "the instructions or system prompt differ from the recorded request's",
    'request_content': 'the request differs from the recorded one',
    'tool_name': 'the recording called a tool the agent no longer has',
    'tool_result': 'the tool returned something other than the recorded result (tool drift)',
}


async def replay_run(
    agent: Agent[Any, Any],
    run_id: str,
    *,
    reader: Any,
    tools: ToolMode = 'recorded',
    deps: Any = None,
) -> ReplayReport:
    """Re-execute `agent` against the recorded run `run_id` (read through `reader`) and report.

    No model is called: each request the agent builds is compared with the recorded one and
    answered with the recorded response. With `tools='recorded'` (the default) no tool runs: each
    call gets its recorded result or retry; with `tools='live'` the tools run and a result that
    differs from the recorded one is a `tool_result` divergence. `StepPersistence` on the agent
    writes nothing while it replays. Volatile values are normalised (`stepstream.replay._compare`).
    """
    recording = await recording_or_report(reader, run_id, tools)
    if isinstance(recording, ReplayReport):
        return recording
    replayer = Replayer(recording, tools, reader=reader)
    report = ReplayReport(
        run_id, 'matched', tools=tools, notes=[] if recording.definitions else [NOT_RECORDED]
    )
    result = await execute(agent, recording, replayer, FunctionModel(_never), [], deps)
    if result is not None:
        _check_end(replayer, result.new_messages(), recording)
    return decide(report, replayer)


async def recording_or_report(reader: Any, run_id: str, tools: ToolMode) -> Recording | ReplayReport:
    """The run's recording, or the report of why it cannot be replayed (`erased`, `unreplayable`)."""
    if tools not in ('recorded', 'live'):
        raise ValueError(f"tools must be 'recorded' or 'live', not {tools!r}")
    try:
        return await load_recording(reader, run_id)
    except NotReplayable as exc:
        outcome: Outcome = 'erased' if exc.reason == 'erased' else 'unreplayable'
        return ReplayReport(run_id, outcome, tools=tools, detail=str(exc))


async def execute(
    agent: Agent[Any, Any],
    recording: Recording,
    replayer: Replayer,
    model: Any,
    capabilities: list[Any],
    deps: Any,
) -> Any:
    """Run the agent from the recording's start with the replayer: its result, or None when it stopped."""
    token = replaying.set(MUTED)  # the run itself writes nothing; the replayer answers inside it
    try:
        return await agent.run(
            recording.user_prompt,
            message_history=recording.history or None,
            model=model,
            deps=deps,
            capabilities=[replayer, *capabilities],
            conversation_id=recording.run.conversation_id,
        )
    except BaseException as exc:  # the replayed code's own failure is a finding, not a crash
        if isinstance(exc, KeyboardInterrupt | SystemExit | asyncio.CancelledError) and not _stopped(exc):
            raise
        if not _stopped(exc):
            replayer.stop(
                Divergence(
                    replayer.served,
                    'error',
                    f'the replayed code raised {type(exc).__name__}: {exc}',
                    recording.run.status,
                    f'{type(exc).__name__}: {exc}',
                )
            )
        return None
    finally:
        replaying.reset(token)


def decide(report: ReplayReport, replayer: Replayer) -> ReplayReport:
    """The report's outcome from what the replayer noted."""
    report.steps = replayer.served
    if replayer.divergence is not None:
        report.outcome, report.divergence = 'diverged', replayer.divergence
    elif replayer.in_doubt is not None:
        report.outcome, report.detail = 'in_doubt', replayer.in_doubt
    elif replayer.ended is not None:
        report.detail = replayer.ended
    return report


def _stopped(exc: BaseException) -> bool:
    """The exception (or one inside a group, or its cause) is the replay's own stop."""
    if isinstance(exc, _Stop):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(_stopped(e) for e in exc.exceptions)
    return exc.__cause__ is not None and _stopped(exc.__cause__)


def _check_end(replayer: Replayer, new: list[ModelMessage], recording: Recording) -> None:
    """After the agent ended: every recorded response served, and the messages it ended with recorded."""
    if replayer.served < len(recording.responses):
        step = replayer.served + 1
        raise_at = recording.requests[replayer.served] if replayer.served < len(recording.requests) else None
        replayer.stop(
            Divergence(
                step,
                'missing_request',
                'the code ended before a request the recording has',
                normalised(raise_at) if raise_at is not None else None,
                None,
            )
        )
        return
    recorded = [normalised(m) for m in _interleaved(recording)]
    replayed = [normalised(m) for m in new]
    if recorded != replayed:
        index = next(
            (i for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)) if a != b),
            min(len(recorded), len(replayed)),
        )
        replayer.stop(
            Divergence(
                replayer.served,
                'final_output',
                'the run ended with other messages than recorded',
                recorded[index:],
                replayed[index:],
            )
        )


def _interleaved(recording: Recording) -> list[ModelMessage]:
    out: list[ModelMessage] = []
    for i, request in enumerate(recording.requests):
        out.append(request)
        if i < len(recording.responses):
            out.append(recording.responses[i])
    return out
