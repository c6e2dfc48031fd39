"""The replay's own capability: the recording served to one replayed run, and its first divergence noted.

It is a run capability, so it sits after the agent's own (unless one of theirs orders itself
innermost): around every model request and tool call it is the innermost wrapper, and the last
`before_tool_execute` to see a call before its tool. A model request: the request
the code built is compared with the recorded one, then answered with the recorded response by
the model it wraps (`Served`), so every capability's `after_model_request` runs on it, and the
response that enters the history is compared with the recorded one. A tool call: what would
reach the tool, after every capability's say, is compared with the recorded call; then
`recorded` answers with the recorded result, the tool not run, and `live` runs it and compares
its result. `replay_run` (`stepstream.replay._run`) runs the agent with it.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic_ai import ModelRetry
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import ToolFailed
from pydantic_ai.messages import (
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models import Model
from pydantic_ai.tools import RunContext, ToolDefinition
from pydantic_core import to_jsonable_python

from stepstream.producer import replaying
from stepstream.replay._compare import (
    arguments_differ,
    as_json,
    definitions_difference,
    normalised,
    request_difference,
    response_difference,
    validated,
)
from stepstream.replay._recording import NotReplayable, Recording, load_recording
from stepstream.replay._report import Divergence, ToolMode
from stepstream.replay._served import Answer, Served
from stepstream.schemas import RunRecord


class Stop(Exception):
    """Ends the replayed run: the report is already decided."""


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
        self.answer: ModelResponse | None = None
        """The recorded response `Served` answers the current request with (None: the model answers)."""
        self.answered: int | None = None
        """The index of the response served for the current request, until it entered the history."""

    def stop(self, divergence: Divergence) -> Stop:
        if self.root is not self:
            divergence.detail = f'in delegate {self.recording.run.run_id}: {divergence.detail}'
        if self.root.divergence is None:
            self.root.divergence = divergence
        return Stop(divergence.detail)

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
        """Compare the request the code built with the recorded one; `Served` answers it as recorded.

        The handler is called, as in production, so every capability's `before_model_request` and
        `after_model_request` run; `after_node_run` compares what entered the history.
        """
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
            found = definitions_difference(recording.definitions.get(step), request_context)
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
                raise Stop(self.in_doubt)
            self.ended = f"the recording ends at step {step}'s request, which matched"
            raise Stop(self.ended)
        self.served += 1
        # The request goes on down the handler, as in production: `Served` answers it with the
        # recorded response and every capability's `after_model_request` runs on that answer.
        self.answer, self.answered = recording.responses[k], k
        try:
            return await handler(request_context)
        finally:
            self.answer = None

    def get_wrapper_model(self, model: Model) -> Model | None:
        """The model every request of the replayed run reaches: it answers with the recorded response."""
        return Served(model, self)

    async def after_node_run(self, ctx: RunContext[Any], *, node: Any, result: Any) -> Any:
        """The response that entered the history, after every capability, compared with the recorded one."""
        k, self.answered = self.answered, None
        entered = next((m for m in reversed(ctx.messages) if isinstance(m, ModelResponse)), None)
        if k is None or entered is None:
            return result
        found = response_difference(self.recording.responses[k], entered)
        if found is not None:
            kind, was, now, call = found
            raise self.stop(
                Divergence(
                    self.step,
                    kind,
                    _SAY[kind]
                    if call is None
                    else f'a capability changed the arguments of the call to {call.tool_name!r}',
                    was,
                    now,
                    call.tool_name if call is not None else None,
                    call.tool_call_id if call is not None else None,
                )
            )
        return result

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
        """`recorded`: the recorded result (or retry), the tool not run; `live`: run it, compare its result.

        Either way the call goes down the handler first, so every capability's `before_tool_execute`
        runs on it; the replayer's own, last, compares what would reach the tool with the recorded
        call (`before_tool_execute`) and, with recorded tools, stops it there (`Answer`).
        """
        step, call_id, name = ctx.run_step, call.tool_call_id, call.tool_name
        if self.live_from is not None and step >= self.live_from:
            return await handler(args)  # a fork's live step: its calls are new
        outcome, error = self.recording.outcome(call_id), self.recording.failed.get(call_id)
        if (outcome is None and error is None) or _ended(outcome) == 'interrupted':
            self.in_doubt = (
                f'step {step}: tool {name!r} ({call_id}) has no recorded end'
                + (' (in doubt)' if call_id in self.recording.in_doubt else '')
                + ': whether it ran is not known, so replay stops here'
            )
            raise Stop(self.in_doubt)
        if self.tools == 'recorded':
            try:
                return await handler(args)  # returns only if a capability answered the call itself
            except Answer:
                pass
            if outcome is None:
                self.ended = f'the recorded call {name!r} ({call_id}) raised: {error}'
                raise Stop(self.ended)
            ended, recorded = _ended(outcome), outcome.content
            message = recorded if isinstance(recorded, str) else as_json(recorded)
            if ended == 'retried':
                raise ModelRetry(message)
            if ended == 'failed':
                raise ToolFailed(message)
            return copy.deepcopy(recorded)
        if outcome is None:
            try:
                again = await handler(args)
            except Stop:
                raise
            except Exception:  # it raises again, as recorded
                self.ended = f'tool {name!r} raised at step {step}, as recorded ({error})'
                raise Stop(self.ended) from None
            raise self.stop(
                Divergence(step, 'tool_result', _SAY['tool_result'], {'error': error}, again, name, call_id)
            )
        ended, recorded = _ended(outcome), outcome.content
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

    async def before_tool_execute(
        self, ctx: RunContext[Any], *, call: ToolCallPart, tool_def: ToolDefinition, args: Any
    ) -> Any:
        """What would reach the tool, after every capability's say, compared with the recorded call.

        The recorded call's arguments are validated by the tool as it is today, so a tool's own
        parsing (types, defaults, validators) is normalisation; what a capability changes after
        the model answered (`before_tool_validate`, `after_tool_validate`, `before_tool_execute`)
        is a `tool_arguments` divergence. With recorded tools the call ends here, unrun.
        """
        if self.live_from is not None and ctx.run_step >= self.live_from:
            return args
        recorded = self.recording.call(call.tool_call_id)
        if recorded is not None:
            expected = validated(ctx, recorded)
            if recorded.tool_name != call.tool_name or arguments_differ(expected, args):
                raise self.stop(
                    Divergence(
                        ctx.run_step,
                        'tool_arguments',
                        _SAY['executed'],
                        to_jsonable_python(expected, fallback=str),
                        to_jsonable_python(args, fallback=str),
                        call.tool_name,
                        call.tool_call_id,
                    )
                )
        if self.tools == 'recorded':
            raise Answer
        return args


def _ended(outcome: ToolReturnPart | RetryPromptPart | None) -> str | None:
    """How a recorded call ended: `success`, `retried`, `failed`, `denied`, `interrupted`; None: no end."""
    if outcome is None:
        return None
    return 'retried' if isinstance(outcome, RetryPromptPart) else outcome.outcome


_SAY = {
    'tool_definitions': 'the tools offered to the model are defined otherwise than recorded',
    'output_type': 'the output type (mode, output tools or schema) differs from the recorded one',
    'settings': 'the model settings differ from the recorded ones',
    'instructions': "the instructions or system prompt differ from the recorded request's",
    'request_content': 'the request differs from the recorded one',
    'tool_name': 'the recording called a tool the agent no longer has',
    'tool_result': 'the tool returned something other than the recorded result (tool drift)',
    'response': "the model's response, after the code's capabilities, differs from the recorded one",
    'executed': 'the call that would reach the tool, after the capabilities, differs from the recorded call',
}
