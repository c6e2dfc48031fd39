"""The ways of running that were recorded as crashes, end to end on the broker (issue 47).

`tests/test_ways_of_running.py` generates every way and mixture on the in-memory log; these run
the ones the log's own path could lose on a real `EventLog`, Projector and RocksDB: a run its
caller abandoned (`iter`, `run_stream`) ends `cancelled` with its reason and a call cut short in
doubt, and a run that ends waiting leaves a snapshot that a second reader resumes from.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from pydantic_ai import Agent, CallDeferred, DeferredToolRequests, DeferredToolResults, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel

from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader, continue_run

pytestmark = pytest.mark.broker


def _tools_then_answer(*calls: tuple[str, str]) -> FunctionModel:
    """First turn: the given calls (name, id) in parallel; then an answer in several chunks."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(parts=[ToolCallPart(name, {'n': 1}, tool_call_id=i) for name, i in calls])
        return ModelResponse(parts=[TextPart('all done now')])

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str | DeltaToolCalls]:
        response = respond(messages, info)
        if isinstance(response.parts[0], TextPart):
            for chunk in ('all ', 'done ', 'now'):
                yield chunk
            return
        yield {
            k: DeltaToolCall(p.tool_name, json.dumps(p.args), tool_call_id=p.tool_call_id)
            for k, p in enumerate(response.parts)
            if isinstance(p, ToolCallPart)
        }

    return FunctionModel(respond, stream_function=stream)


async def test_abandoned_runs_end_cancelled_saying_the_caller_left(
    event_log: EventLog, projector: Projector
) -> None:
    agent = Agent(
        _tools_then_answer(('lookup', 'call-1')),
        capabilities=[StepPersistence(log=event_log, agent_name='left')],
    )

    @agent.tool_plain
    async def lookup(n: int) -> str:
        return f'found {n}'

    async with agent.iter('go', conversation_id='iter-left') as run:
        async for node in run:
            if Agent.is_call_tools_node(node):
                break  # the model asked for a tool; the caller walks away before it runs
    async with agent.run_stream('go', conversation_id='stream-left') as streamed:
        async for _ in streamed.stream_text(delta=True):
            break  # one chunk of three
    await projector.wait_for(await event_log.flush())
    reader = ProjectionReader.of(projector)
    for conversation in ('iter-left', 'stream-left'):
        [left] = await reader.list_runs(conversation_id=conversation)
        assert left.status == 'cancelled', conversation
        assert left.error is not None and 'the caller left the run' in left.error
        assert [e.kind for e in await reader.list_events(left.run_id)][-1] == 'run_cancelled'
        assert await reader.latest_snapshot(left.run_id, include_interrupted=True) is not None
    [streamed_run] = await reader.list_runs(conversation_id='stream-left')
    effect = await reader.get_tool_effect(streamed_run.run_id, 'call-1')
    assert effect is not None and effect.status == 'completed'  # its tool ran before the answer streamed
    assert await reader.list_unresolved_tool_effects() == []


async def test_a_cancelled_call_is_in_doubt_and_its_run_cancelled(
    event_log: EventLog, projector: Projector
) -> None:
    agent = Agent(
        _tools_then_answer(('charge', 'call-1')),
        capabilities=[StepPersistence(log=event_log, agent_name='cut')],
    )
    charging = asyncio.Event()

    @agent.tool_plain
    async def charge(n: int) -> str:
        charging.set()
        await asyncio.Event().wait()  # the payment provider never answers
        return 'charged'

    task = asyncio.create_task(agent.run('go', conversation_id='cut-short'))
    await charging.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await projector.wait_for(await event_log.flush())
    reader = ProjectionReader.of(projector)
    [run] = await reader.list_runs(conversation_id='cut-short')
    assert run.status == 'cancelled' and run.error is not None and 'cancelled before it ended' in run.error
    [doubt] = await reader.list_unresolved_tool_effects()
    assert (doubt.tool_call_id, doubt.doubt) == ('call-1', 'unknown_after_crash')


async def test_a_waiting_run_resumes_from_the_log_in_another_reader(
    event_log: EventLog, projector: Projector
) -> None:
    agent: Agent[None, str | DeferredToolRequests] = Agent(
        _tools_then_answer(('refund', 'call-1'), ('export', 'call-2')),
        output_type=[str, DeferredToolRequests],
        capabilities=[StepPersistence(log=event_log, agent_name='pause')],
    )
    ran: list[str] = []

    @agent.tool_plain(requires_approval=True)
    async def refund(n: int) -> str:
        ran.append('refund')
        return f'refunded {n}'

    @agent.tool
    async def export(ctx: RunContext[None], n: int) -> str:
        if ctx.tool_call_approved:
            return 'exported'
        raise CallDeferred(metadata={'job': 'export-1'})

    paused = await agent.run('refund and export', conversation_id='pause')
    assert isinstance(paused.output, DeferredToolRequests)
    await projector.wait_for(await event_log.flush())

    # Another process: a reader of the projection on disk, nothing of the first run in memory.
    async with ProjectionReader.open(projector.db_path) as reader:
        [waiting] = await reader.list_runs(conversation_id='pause')
        assert waiting.status == 'waiting'
        effects = {e.tool_call_id: e for e in await reader.list_tool_effects(waiting.run_id)}
        assert {(c, e.status, e.deferral) for c, e in effects.items()} == {
            ('call-1', 'deferred', 'approval'),
            ('call-2', 'deferred', 'external'),
        }
        assert json.loads(effects['call-2'].deferral_metadata or '{}') == {'job': 'export-1'}
        assert await reader.list_unresolved_tool_effects() == []
        history = await continue_run(reader, run_id=waiting.run_id, include_interrupted=True)
    assert history == paused.all_messages()

    results = DeferredToolResults(approvals={'call-1': True}, calls={'call-2': 'exported outside'})
    resumed = await agent.run(message_history=history, deferred_tool_results=results, conversation_id='pause')
    assert resumed.output == 'all done now' and ran == ['refund']
    await projector.wait_for(await event_log.flush())
    reader = ProjectionReader.of(projector)
    assert [r.status for r in await reader.list_runs(conversation_id='pause')] == ['waiting', 'completed']
