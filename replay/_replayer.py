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
from dataclasses import dataclass, field
from typing import Any, Literal

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
from stepstream.replay._compare import as_json, diff, normalised, request_difference
from stepstream.replay._recording import NotReplayable, Recording, load_recording

ToolMode = Literal['recorded', 'live']
Outcome = Literal['matched', 'diverged', 'in_doubt', 'erased', 'unreplayable', 'forked']

NOT_RECORDED = (
    'written before schema v6: tool definitions, model settings and the output type are not in this '
    "run's records, so they were not checked"
)


@dataclass(slots=True)
class Divergence:
    """The first place the replayed code did something the recording did not."""

    step: int
    """The step as the log numbers it (`step_index`: the model request it happened in or after)."""
    kind: str
    """`instructions`, `request_content`, `tool_name`, `tool_arguments`, `tool_result`,
    `final_output`, `extra_request` (the code made a request the recording does not have),
    `missing_request` (a recorded request the code did not make) or `error` (the code raised)."""
    detail: str
    recorded: Any = None
    replayed: Any = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    @property
    def diff(self) -> str:
        """A unified diff of the recorded and replayed values."""
        return diff(self.recorded, self.replayed)


@dataclass(slots=True)
class ReplayReport:
    """What replaying one run found."""

    run_id: str
    outcome: Outcome
    """`matched`; `diverged` (see `divergence`); `in_doubt` (matched up to a tool call the recording
    holds in doubt, where replay stops); `erased` or `unreplayable` (see `detail`)."""
    steps: int = 0
    """Model requests served from the recording."""
    tools: ToolMode = 'recorded'
    divergence: Divergence | None = None
    detail: str = ''
    notes: list[str] = field(default_factory=list)
    forked_run_id: str | None = None
    """A fork's new run (`stepstream.replay.fork_run_from_step`), written from the live step on."""

    @property
    def ok(self) -> bool:
        """True when nothing the recording holds was done differently (`matched`, `in_doubt`, `forked`)."""
        return self.outcome in ('matched', 'in_doubt', 'forked')

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data (`stepstream replay --json`)."""
        divergence = self.divergence
        return {
            'run_id': self.run_id,
            'outcome': self.outcome,
            'ok': self.ok,
            'steps': self.steps,
            'tools': self.tools,
            'detail': self.detail,
            'notes': self.notes,
            'forked_run_id': self.forked_run_id,
            'divergence': None
            if divergence is None
            else {
                'step': divergence.step,
                'kind': divergence.kind,
                'detail': divergence.detail,
                'tool_name': divergence.tool_name,
                'tool_call_id': divergence.tool_call_id,
                'recorded': to_jsonable_python(divergence.recorded, fallback=str),
                'replayed': to_jsonable_python(divergence.replayed, fallback=str),
                'diff': divergence.diff,
            },
        }

    def text(self) -> str:
        """The report for a person: one line, and for a divergence where and what, with its diff."""
        head = f'{self.run_id}: {self.outcome} after {self.steps} step(s), tools {self.tools}'
        lines = [head + (f': {self.detail}' if self.detail else '')]
        if self.divergence is not None:
            d = self.divergence
            call = f' ({d.tool_name} {d.tool_call_id})' if d.tool_name else ''
            lines += [
                f'  step {d.step}: {d.kind}{call}: {d.detail}',
                *('  ' + x for x in d.diff.splitlines()),
            ]
        lines += [f'  note: {note}' for note in self.notes]
        return '\n'.join(lines)


class _Stop(Exception):
    """Ends the replayed run: the report is already decided."""


def _never(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    raise AssertionError('a replay serves every model request from the recording; no model is called')


class _Replayer(AbstractCapability[Any]):
    """Serves the recording to one replayed run and notes the first divergence."""

    def __init__(
        self, recording: Recording, tools: ToolMode, failed: dict[str, str], live_from: int | None = None
    ) -> None:
        self.recording = recording
        self.tools = tools
        self.live_from = live_from
        """A fork's step from which the live model answers and the tools run (`stepstream.replay.fork`)."""
        self.failed = failed
        """Recorded tool calls that ended by raising, with their error."""
        self.served = 0
        self.divergence: Divergence | None = None
        self.ended: str | None = None
        """Why the replay ended before the agent did, when that is a match (the recording ends there)."""
        self.in_doubt: str | None = None

    def stop(self, divergence: Divergence) -> _Stop:
        if self.divergence is None:
            self.divergence = divergence
        return _Stop(divergence.detail)

    async def wrap_model_request(
        self, ctx: RunContext[Any], *, request_context: Any, handler: Any
    ) -> ModelResponse:
        """Compare the request the code built with the recorded one; answer with the recorded response."""
        recording, k, step = self.recording, self.served, ctx.run_step
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
        outcome = self.recording.outcome(call_id)
        if outcome is None and call_id in self.failed:
            if self.tools == 'live':
                try:
                    again = await handler(args)
                except Exception:  # it raises again, as recorded
                    self.ended = f'tool {name!r} raised at step {step}, as recorded ({self.failed[call_id]})'
                    raise _Stop(self.ended) from None
                raise self.stop(
                    Divergence(
                        step,
                        'tool_result',
                        _SAY['tool_result'],
                        {'error': self.failed[call_id]},
                        again,
                        name,
                        call_id,
                    )
                )
            self.ended = f'the recorded call {name!r} ({call_id}) raised: {self.failed[call_id]}'
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
    recorded: tuple[str, str] | None, request_context: Any
) -> tuple[str, Any, Any] | None:
    """(kind, recorded, replayed) when the request's tools, output or settings are not the recorded ones."""
    if recorded is None:
        return None  # written before schema v6: not checked (the report says so)
    text = definitions_of(request_context)
    if fingerprint(text) == recorded[0]:
        return None
    was, now = json.loads(recorded[1]), json.loads(text)
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
    if tools not in ('recorded', 'live'):
        raise ValueError(f"tools must be 'recorded' or 'live', not {tools!r}")
    try:
        recording = await load_recording(reader, run_id)
    except NotReplayable as exc:
        return ReplayReport(
            run_id, 'erased' if exc.reason == 'erased' else 'unreplayable', tools=tools, detail=str(exc)
        )
    replayer = _Replayer(recording, tools, await failed_calls(reader, run_id))
    report = ReplayReport(
        run_id, 'matched', tools=tools, notes=[] if recording.definitions else [NOT_RECORDED]
    )
    result = await execute(agent, recording, replayer, FunctionModel(_never), [], deps)
    if result is not None:
        _check_end(replayer, result.new_messages(), recording)
    return decide(report, replayer)


async def failed_calls(reader: Any, run_id: str) -> dict[str, str]:
    """The run's tool calls that ended by raising, with their error, from the ledger."""
    effects = await reader.list_tool_effects(run_id)
    return {e.tool_call_id: e.error or 'an error' for e in effects if e.status == 'failed'}


async def execute(
    agent: Agent[Any, Any],
    recording: Recording,
    replayer: _Replayer,
    model: Any,
    capabilities: list[Any],
    deps: Any,
) -> Any:
    """Run the agent from the recording's start with the replayer: its result, or None when it stopped."""
    token = replaying.set(recording.run.run_id)
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


def decide(report: ReplayReport, replayer: _Replayer) -> ReplayReport:
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


def _check_end(replayer: _Replayer, new: list[ModelMessage], recording: Recording) -> None:
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
