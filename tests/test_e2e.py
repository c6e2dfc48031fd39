"""The whole path on real components: Agent -> EventLog -> Tansu -> Projector -> RocksDB -> reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic_ai import Agent, RunContext

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader, continue_run

from agents import answers, calls_then_answers

pytestmark = pytest.mark.broker


async def test_orchestrator_and_delegate_round_trip(event_log: EventLog, projector: Projector) -> None:
    delegate = Agent(
        answers('the delegate found X'), capabilities=[StepPersistence(log=event_log, agent_name='delegate')]
    )
    orchestrator = Agent(
        calls_then_answers('ask_delegate', args={'question': 'find X'}),
        capabilities=[StepPersistence(log=event_log, agent_name='orchestrator')],
    )

    @orchestrator.tool
    async def ask_delegate(ctx: RunContext[None], question: str) -> str:
        result = await delegate.run(question)
        return result.output

    result = await orchestrator.run('find X', conversation_id='conv-1')
    await projector.wait_for(await event_log.flush())
    reader = ProjectionReader.of(projector)

    [orch_run] = await reader.list_runs(conversation_id='conv-1')
    assert orch_run.agent_name == 'orchestrator'
    assert orch_run.status == 'completed'
    assert orch_run.gaps == []
    [child] = await reader.list_runs(parent_run_id=orch_run.run_id)
    assert child.agent_name == 'delegate'
    assert child.parent_run_id == orch_run.run_id
    assert child.status == 'completed'

    events = await reader.list_events(orch_run.run_id)
    kinds = [e.kind for e in events]
    assert kinds[0] == 'run_started' and kinds[-1] == 'run_completed'
    assert (
        kinds.index('tool_call_started') < kinds.index('tool_call_completed') < kinds.index('snapshot_saved')
    )
    # Every seq up to the last holds one record (`gaps == []` above), and the call's transitions
    # hold some of them: fewer step events than records.
    assert len(events) < orch_run.event_count == orch_run.last_seq + 1
    assert {e.tool_name for e in events if e.kind.startswith('tool_call')} == {'ask_delegate'}

    snapshot = await reader.latest_snapshot(orch_run.run_id)
    assert snapshot is not None and snapshot.state == 'complete'
    assert snapshot.messages == result.all_messages()
    effect = await reader.get_tool_effect(orch_run.run_id, 'call-0')
    assert effect is not None and effect.status == 'completed' and effect.tool_name == 'ask_delegate'
    assert await reader.list_unresolved_tool_effects() == []

    history = await continue_run(reader, run_id=orch_run.run_id)
    follow_up = await orchestrator.run('follow up', message_history=history, conversation_id='conv-1')
    assert follow_up.all_messages()[: len(history)] == history
    await projector.wait_for(await event_log.flush())
    runs = await reader.list_runs(conversation_id='conv-1')
    assert len(runs) == 2 and runs[0].run_id == orch_run.run_id
    assert runs[1].status == 'completed'


async def test_projector_resumes_from_stored_offsets(
    settings: Settings, event_log: EventLog, db_path: Path
) -> None:
    agent = Agent(
        calls_then_answers('noop', calls=2), capabilities=[StepPersistence(log=event_log, agent_name='a')]
    )

    @agent.tool_plain
    def noop() -> str:
        return 'done'

    await agent.run('first')
    async with Projector(settings, db_path=db_path) as projector:
        await projector.wait_for(await event_log.flush())
        [first] = await ProjectionReader.of(projector).list_runs()
        assert projector.records_applied == first.event_count

    await agent.run('second')
    async with Projector(settings, db_path=db_path) as projector:
        await projector.wait_for(await event_log.flush())
        runs = await ProjectionReader.of(projector).list_runs()
        # Only the second run's records were consumed again: nothing applied twice.
        assert projector.records_applied == runs[1].event_count
        assert projector.duplicates_ignored == 0
        assert (await ProjectionReader.of(projector).get_run(first.run_id)) == first

    reader = ProjectionReader.open(db_path)
    try:
        assert [r.run_id for r in await reader.list_runs()] == [r.run_id for r in runs]
    finally:
        reader.close()
