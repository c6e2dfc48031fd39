"""Forking a recorded run at a step: the recording up to it, a live model from it on, a new run written.

Two models compared from identical state: the fork re-executes the agent against the recording
(each request checked, as a replay does) until step K, where the model the caller names answers
instead, and the tools run. Its own `StepPersistence` writes the new run, whose metadata names the
run it was forked from and the step (`FORKED_FROM`, `FORKED_AT_STEP`); every other
`StepPersistence` stays muted, as in a replay.
"""

from __future__ import annotations

from typing import Any

from pydantic_ai import Agent

from stepstream.ids import to_run_id
from stepstream.producer import FORKED_AT_STEP, FORKED_FROM, StepLog, StepPersistence
from stepstream.replay._replayer import Replayer
from stepstream.replay._report import ReplayReport, ToolMode
from stepstream.replay._run import decide, execute, recording_or_report


async def fork_run_from_step(
    agent: Agent[Any, Any],
    run_id: str,
    *,
    reader: Any,
    from_step: int,
    model: Any,
    log: StepLog,
    tools: ToolMode = 'recorded',
    deps: Any = None,
) -> ReplayReport:
    """Replay `run_id` up to step `from_step`, then let `model` answer; the new run is written to `log`.

    The report is `forked` with `forked_run_id` when the code matched the recording up to the fork
    (a divergence before it is reported as in a replay, and the new run ends failed there).
    `model` is anything `Agent.run(model=...)` takes. Steps before `from_step` get their tools'
    results per `tools`; from it on, the tools run.
    """
    if from_step < 1:
        raise ValueError(f'from_step is a step of the run (1 or more), not {from_step}')
    recording = await recording_or_report(reader, run_id, tools)
    if isinstance(recording, ReplayReport):
        return recording
    if from_step > len(recording.requests):
        raise ValueError(
            f'run {run_id!r} has {len(recording.requests)} step(s): it cannot be forked at {from_step}'
        )
    agent_name = recording.run.agent_name or 'fork'
    persistence = StepPersistence(
        log=log, agent_name=agent_name, metadata={FORKED_FROM: run_id, FORKED_AT_STEP: str(from_step)}
    )
    replayer = Replayer(recording, tools, reader=reader, live_from=from_step)
    report = ReplayReport(run_id, 'matched', tools=tools)
    result = await execute(agent, recording, replayer, model, [persistence], deps)
    decide(report, replayer)
    if result is not None and report.outcome == 'matched':
        report.outcome, report.forked_run_id = 'forked', to_run_id(f'{agent_name}-{result.run_id}')
        report.detail = f'forked at step {from_step} into {report.forked_run_id}'
    return report
