"""Issue 10's read-side parity with the reference: inspect_recovery and fork_run."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic_ai import Agent, RunContext

from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader, continue_run, fork_run, inspect_recovery
from stepstream.schemas import StepEvent, ToolEffectTransition

from agents import calls_then_answers

pytestmark = pytest.mark.broker


async def test_inspect_recovery_lists_the_unresolved_effects_list_unresolved_lists(
    event_log: EventLog, projector: Projector
) -> None:
    # An annotation with no `started` before it, as an older producer could write one.
    envelope = {'run_id': 'legacy-annotation', 'writer_id': 'w', 'timestamp': datetime.now(UTC)}
    await event_log.append(StepEvent(**envelope, seq=0, kind='run_started'))
    await event_log.append(
        ToolEffectTransition(
            **envelope,
            seq=1,
            tool_call_id='inner',
            tool_name='charge',
            status='annotated',
            idempotency_key='k',
        )
    )
    await event_log.append(StepEvent(**envelope, seq=2, kind='run_completed'))
    await projector.wait_for(await event_log.flush())
    reader = ProjectionReader.of(projector)
    report = await inspect_recovery(reader, run_id='legacy-annotation')
    listed = await reader.list_unresolved_tool_effects('legacy-annotation')
    assert [e.tool_call_id for e in report.unresolved] == [e.tool_call_id for e in listed]


async def test_fork_run_passes_include_interrupted_through(event_log: EventLog, projector: Projector) -> None:
    agent = Agent(
        calls_then_answers('explode', calls=2),
        capabilities=[StepPersistence(log=event_log, run_id='fork-me')],
    )

    @agent.tool
    async def explode(ctx: RunContext[None]) -> str:
        if ctx.tool_call_id == 'call-1':
            raise RuntimeError('disk on fire')
        return 'fine'

    with pytest.raises(RuntimeError):
        await agent.run('go')
    await projector.wait_for(await event_log.flush())
    reader = ProjectionReader.of(projector)
    interrupted = await continue_run(reader, run_id='fork-me', include_interrupted=True)
    assert await fork_run(reader, run_id='fork-me', include_interrupted=True) == interrupted  # type: ignore[call-arg]
    assert await fork_run(reader, run_id='fork-me') == await continue_run(reader, run_id='fork-me')
