"""A run paused for a person and an outside system, decided and resumed by other processes, on the broker.

The rules of tests/test_decisions.py on a real `EventLog`, `Projector` and RocksDB: the run that
pauses, the processes that decide (each its own log and its own reader of the projection on disk)
and the one that resumes share nothing but the log and the projection.
"""

from __future__ import annotations

import json

import pytest
from pydantic_ai import Agent, CallDeferred, DeferredToolRequests
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream import Settings
from stepstream.errors import NotWaiting
from stepstream.producer import EventLog, StepPersistence, decide_deferred_call, resolver_id
from stepstream.projector import Projector
from stepstream.readmodel import RESUMES_KEY, ProjectionReader, resume_run

pytestmark = pytest.mark.broker

WRITER = resolver_id('test')


def _model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    returns = [p for m in messages for p in getattr(m, 'parts', ()) if isinstance(p, ToolReturnPart)]
    if returns:
        return ModelResponse(parts=[TextPart('; '.join(f'{r.tool_name}: {r.content}' for r in returns))])
    return ModelResponse(
        parts=[
            ToolCallPart('refund', {'amount': 120}, tool_call_id='call-refund'),
            ToolCallPart('export', {'table': 'orders'}, tool_call_id='call-export'),
        ]
    )


def agent_on(log: EventLog, ran: list[str], **options: object) -> Agent[None, str | DeferredToolRequests]:
    """Refunds wait for an approval, exports for an outside system."""
    agent: Agent[None, str | DeferredToolRequests] = Agent(
        FunctionModel(_model),
        capabilities=[StepPersistence(log=log, agent_name='refunds', **options)],  # type: ignore[arg-type]
        output_type=[str, DeferredToolRequests],
    )

    @agent.tool_plain(requires_approval=True)
    def refund(amount: int) -> str:
        ran.append(f'refund {amount}')
        return f'refunded {amount}'

    @agent.tool_plain
    def export(table: str) -> str:
        raise CallDeferred(metadata={'job': 'export-7'})

    return agent


async def test_paused_decided_and_resumed_by_other_processes(
    settings: Settings, event_log: EventLog, projector: Projector
) -> None:
    ran: list[str] = []
    paused = await agent_on(event_log, ran).run('refund order 7', conversation_id='conv-hitl')
    assert isinstance(paused.output, DeferredToolRequests) and ran == []
    await projector.wait_for(await event_log.flush())

    # Two deciders, each its own process's log and reader: the first approval in the log stands.
    async with (
        EventLog(settings, create_topics=False) as alice_log,
        ProjectionReader.open(projector.db_path) as seen,
    ):
        waiting = {w.effect.tool_name: w for w in await seen.list_waiting()}
        assert {(n, w.effect.deferral, w.conversation_id) for n, w in waiting.items()} == {
            ('refund', 'approval', 'conv-hitl'),
            ('export', 'external', 'conv-hitl'),
        }
        refund, export = waiting['refund'].effect, waiting['export'].effect
        await decide_deferred_call(
            alice_log,
            refund,
            decision='approved',
            operator='alice',
            writer_id=WRITER,
            args={'amount': 100},
            note='within the limit',
        )
        async with EventLog(settings, create_topics=False) as bob_log:
            await decide_deferred_call(
                bob_log,
                refund,
                decision='denied',
                operator='bob',
                writer_id=resolver_id('test'),
                message='no',
            )
            await decide_deferred_call(
                bob_log,
                export,
                decision='returned',
                operator='batch',
                writer_id=resolver_id('test'),
                result=[3],
            )
            await projector.wait_for(await bob_log.flush())
        decided = await seen.get_tool_effect(refund.run_id, 'call-refund')
        assert decided is not None and decided.resolution is not None
        assert [(r.resolution, r.resolved_by, r.applied) for r in decided.resolutions] == [
            ('approved', 'alice', True),
            ('denied', 'bob', False),
        ]
        assert json.loads(decided.resolution.args or '{}') == {'amount': 100}
        assert await seen.list_waiting() == []
        counts = await seen.counts()
        assert counts is not None and sum(counts.waiting_calls.values()) == 0
        with pytest.raises(NotWaiting, match='decided already'):
            await decide_deferred_call(
                alice_log, decided, decision='denied', operator='carol', writer_id='w', message='late'
            )

    # A third process resumes from the projection on disk, in the same conversation.
    async with ProjectionReader.open(projector.db_path) as reader:
        resumption = await resume_run(reader, refund.run_id)
    async with EventLog(settings, create_topics=False) as resumer_log:
        agent = agent_on(resumer_log, ran, metadata=resumption.metadata)
        resumed = await agent.run(**resumption.run_kwargs())
        assert resumed.output == 'refund: refunded 100; export: [3]' and ran == ['refund 100']
        await projector.wait_for(await resumer_log.flush())
    runs = await ProjectionReader.of(projector).list_runs(conversation_id='conv-hitl')
    assert [(r.status, r.resumes, r.metadata.get(RESUMES_KEY)) for r in runs] == [
        ('resumed', None, None),
        ('completed', refund.run_id, refund.run_id),
    ]
    assert (
        runs[0].resumed_by == runs[1].run_id
    )  # the mark the resumed run appended, in the waiting run's shard
