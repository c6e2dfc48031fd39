"""Running an agent under the replay: from the recording's start, its own persistence muted, and the report.

`replay_run` runs the agent's own code once more with a `Replayer` among its capabilities; no
model is called and, by default, no tool runs. The first difference stops the run and is the
report's divergence; a run that ends is checked against the recording's end (`_check_end`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream.producer import replaying
from stepstream.replay._compare import normalised
from stepstream.replay._recording import NotReplayable, Recording, load_recording
from stepstream.replay._replayer import Replayer, Stop
from stepstream.replay._report import NOT_RECORDED, Divergence, Outcome, ReplayReport, ToolMode


class _Muted:
    """While a replay starts: the replayed run's own `StepPersistence` writes nothing."""

    async def capability_for(self, agent_name: str | None) -> Any | None:
        return AbstractCapability()


MUTED = _Muted()


def _never(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    raise AssertionError('a replay serves every model request from the recording; no model is called')


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
    if isinstance(exc, Stop):
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
