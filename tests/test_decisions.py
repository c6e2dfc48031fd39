"""Decisions on deferred calls are records on the log: the first one in the log decides, resume reads them.

A run ends waiting on an approval and an outside call; decisions (`decide_deferred_call`) are
appended like any record; the projection lists what waits, keeps every decision in the call's
ledger and lets the first one decide, whatever the batches; `resume_run` turns the decisions into
Pydantic AI's `DeferredToolResults`, and the resumed run completes the conversation. Fast tier: the
in-memory log and projection; the same rules run on the brokers in tests/test_decisions_e2e.py.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_ai import Agent, CallDeferred, DeferredToolRequests
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream.errors import NotWaiting, UsageError
from stepstream.producer import (
    InMemoryLog,
    StepPersistence,
    decide_deferred_call,
    decision_for,
    resolution_for,
)
from stepstream.projector._apply import EFFECTS, EVENTS, Applier, SourceRecord
from stepstream.readmodel import RESUMES_KEY, ProjectionReader, resume_run
from stepstream.schemas import ToolEffectRecord
from stepstream.storage import MemoryShard

from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast

WRITER = 'stepstream-test@here:1'


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


def agent_on(log: InMemoryLog, run_id: str | None = None, **options: Any) -> Agent[None, Any]:
    """The agent whose first run waits on `refund` (an approval) and `export` (an outside call)."""
    agent: Agent[None, Any] = Agent(
        FunctionModel(_model),
        capabilities=[StepPersistence(log=log, agent_name='refunds', run_id=run_id, **options)],
        output_type=[str, DeferredToolRequests],
    )

    @agent.tool_plain(requires_approval=True)
    def refund(amount: int) -> str:
        return f'refunded {amount}'

    @agent.tool_plain
    def export(table: str) -> str:
        raise CallDeferred(metadata={'job': 'export-7'})

    return agent


async def waiting_run(log: InMemoryLog, run_id: str) -> MemoryProjection:
    result = await agent_on(log, run_id).run('refund order 7', conversation_id='conv-7')
    assert isinstance(result.output, DeferredToolRequests)
    projection = MemoryProjection(log)
    await projection.wait_for()
    return projection


async def test_what_waits_is_listed_decided_first_come_and_resumed_in_the_same_conversation() -> None:
    log = InMemoryLog()
    projection = await waiting_run(log, 'w-1')
    reader = ProjectionReader.of(projection)
    waiting = await reader.list_waiting()
    assert [(w.effect.tool_name, w.effect.deferral, w.agent_name, w.conversation_id) for w in waiting] == [
        ('export', 'external', 'refunds', 'conv-7'),  # its body deferred it, before the run ended
        ('refund', 'approval', 'refunds', 'conv-7'),
    ]
    assert [w.effect.tool_name for w in await reader.list_waiting(deferral='external')] == ['export']
    assert [w.effect.tool_name for w in await reader.list_waiting(newest_first=True, limit=1)] == ['refund']
    page = await reader.list_waiting(limit=1)
    assert [w.effect.tool_name for w in await reader.list_waiting(after=page[0].cursor)] == ['refund']
    assert await reader.list_waiting(agent_name='other') == []
    counts = await reader.counts()
    assert counts is not None and counts.waiting_calls == {'approval': 1, 'external': 1, 'question': 0}

    with pytest.raises(NotWaiting, match=r"'call-refund' \(refund\) .* still waits for an approval"):
        await resume_run(reader, 'w-1')
    export, refund = (w.effect for w in waiting)
    await decide_deferred_call(
        log, refund, decision='approved', operator='alice', writer_id=WRITER, args={'amount': 100}, note='ok'
    )
    await decide_deferred_call(
        log, refund, decision='denied', operator='bob', writer_id=WRITER, message='too much'
    )  # later in the log: history, not the decision
    await decide_deferred_call(
        log, export, decision='returned', operator='batch', writer_id=WRITER, result={'rows': 3}
    )
    await projection.wait_for()
    assert await reader.list_waiting() == []
    counts = await reader.counts()
    assert counts is not None and counts.waiting_calls == {'approval': 0, 'external': 0, 'question': 0}
    decided = await reader.get_tool_effect('w-1', 'call-refund')
    assert decided is not None and decided.status == 'resolved' and decided.resolution is not None
    assert (decided.resolution.resolution, decided.resolution.resolved_by, decided.resolution.note) == (
        'approved',
        'alice',
        'ok',
    )
    assert [(r.resolution, r.applied) for r in decided.resolutions] == [('approved', True), ('denied', False)]
    with pytest.raises(NotWaiting, match='decided already \\(approved by alice\\)') as refused:
        decision_for(decided, decision='denied', operator='carol', writer_id=WRITER, message='no')
    assert refused.value.decision == decided.resolution

    resumption = await resume_run(reader, 'w-1')
    assert resumption.conversation_id == 'conv-7' and resumption.metadata == {RESUMES_KEY: 'w-1'}
    result = await agent_on(log, 'r-1', metadata=resumption.metadata).run(**resumption.run_kwargs())
    assert result.output == "refund: refunded 100; export: {'rows': 3}"
    await projection.wait_for()
    waited, resumed = await reader.get_run('w-1'), await reader.get_run('r-1')
    assert waited is not None and (waited.status, waited.resumed_by, waited.resumes) == (
        'resumed',
        'r-1',
        None,
    )
    assert resumed is not None and (resumed.status, resumed.resumes, resumed.conversation_id) == (
        'completed',
        'w-1',
        'conv-7',
    )
    counts = await reader.counts()
    assert counts is not None and (counts.by_status['waiting'], counts.by_status['resumed']) == (0, 1)
    assert [r.run_id for r in await reader.list_runs(status='resumed')] == ['w-1']
    with pytest.raises(NotWaiting, match="'w-1' was resumed already, by run 'r-1'"):
        await resume_run(reader, 'w-1')


async def test_a_denial_and_an_outside_error_reach_the_model() -> None:
    log = InMemoryLog()
    projection = await waiting_run(log, 'w-2')
    reader = ProjectionReader.of(projection)
    export, refund = (w.effect for w in await reader.list_waiting())
    await decide_deferred_call(
        log, refund, decision='denied', operator='alice', writer_id=WRITER, message='no'
    )
    await decide_deferred_call(
        log, export, decision='failed', operator='batch', writer_id=WRITER, message='the job crashed'
    )
    await projection.wait_for()
    resumption = await resume_run(reader, 'w-2')
    denied = resumption.deferred_tool_results.approvals['call-refund']
    assert getattr(denied, 'message', None) == 'no'
    failed = resumption.deferred_tool_results.calls['call-export']
    assert str(failed) == 'the job crashed'


async def test_notes_arguments_and_results_are_redacted_before_they_reach_the_log() -> None:
    log = InMemoryLog()
    projection = await waiting_run(log, 'w-3')
    reader = ProjectionReader.of(projection)
    export, refund = (w.effect for w in await reader.list_waiting())
    secret = 'sk-live-9f8e7d6c5b4a39281706f5e4'
    await decide_deferred_call(
        log,
        refund,
        decision='approved',
        operator='alice',
        writer_id=WRITER,
        args={'amount': 100, 'api_key': secret},
        note=f'approved with api_key={secret}',
    )
    await decide_deferred_call(
        log, export, decision='returned', operator='batch', writer_id=WRITER, result={'password': 'hunter2!'}
    )
    assert not any(secret.encode() in r.value or b'hunter2!' in r.value for r in log.records)
    await projection.wait_for()
    decided = await reader.get_tool_effect('w-3', 'call-refund')
    assert decided is not None and decided.resolution is not None and decided.resolution.args is not None
    assert json.loads(decided.resolution.args)['amount'] == 100 and secret not in decided.resolution.note


def test_a_decision_that_cannot_apply_is_refused_before_it_is_written() -> None:
    log = InMemoryLog()

    async def effects() -> tuple[Any, Any]:
        projection = await waiting_run(log, 'w-4')
        export, refund = (w.effect for w in await ProjectionReader.of(projection).list_waiting())
        return refund, export

    import asyncio

    refund, export = asyncio.run(effects())
    with pytest.raises(ValueError, match='waits for an approval'):
        decision_for(refund, decision='returned', operator='a', writer_id=WRITER, result=1)
    with pytest.raises(ValueError, match='not an approval'):
        decision_for(export, decision='approved', operator='a', writer_id=WRITER)
    with pytest.raises(ValueError, match='not an approval'):  # a denial is an approval's answer
        decision_for(export, decision='denied', operator='a', writer_id=WRITER, message='no')
    with pytest.raises(ValueError, match='says why'):
        decision_for(refund, decision='denied', operator='a', writer_id=WRITER)


DECISIONS = st.lists(
    st.tuples(st.sampled_from(['approved', 'denied']), st.sampled_from(['alice', 'bob', 'carol'])),
    min_size=1,
    max_size=6,
)


@settings(max_examples=15, deadline=None)
@given(decisions=DECISIONS, seed=st.integers(0, 2**32 - 1))
async def test_any_decisions_in_any_batches_give_one_outcome_and_touch_no_other_run(
    decisions: list[tuple[str, str]], seed: int
) -> None:
    """The first decision in the log decides, however the log is cut into batches; the rest is history."""
    log = InMemoryLog()
    projection = await waiting_run(log, 'w-5')
    await waiting_run(log, 'w-6')  # its calls wait, whatever is decided for the other run
    [refund] = [w.effect for w in await ProjectionReader.of(projection).list_waiting(deferral='approval')]
    for decision, operator in decisions:
        message = 'no' if decision == 'denied' else None
        record = decision_for(
            refund,
            decision=decision,  # type: ignore[arg-type]
            operator=operator,
            writer_id=WRITER,
            message=message,
        )
        await log.wait_acked([await log.append(record)])
    settings_ = log.settings
    topics = {settings_.topics.step_events_topic: EVENTS, settings_.topics.tool_effects_topic: EFFECTS}
    sources = [SourceRecord(topics[r.topic], r.partition, r.offset, r.key, r.value) for r in log.records]
    shards = []
    for cut in (None, random.Random(seed)):
        shard, applier = MemoryShard(), Applier(tuple(topics), partitions=settings_.topics.partitions)  # type: ignore[arg-type]
        at = 0
        while at < len(sources):
            size = len(sources) if cut is None else cut.randint(1, 4)
            txn, _ = applier.stage(shard, sources[at : at + size])
            txn.commit()
            at += size
        shards.append(shard)
    assert list(shards[0].items()) == list(shards[1].items())
    reader = ProjectionReader(shards[1])
    decided = await reader.get_tool_effect('w-5', 'call-refund')
    assert decided is not None and decided.resolution is not None
    assert (decided.resolution.resolution, decided.resolution.resolved_by) == decisions[0]
    assert [r.applied for r in decided.resolutions] == [True] + [False] * (len(decisions) - 1)
    assert {(w.effect.run_id, w.effect.tool_name) for w in await reader.list_waiting()} == {
        ('w-5', 'export'),
        ('w-6', 'refund'),
        ('w-6', 'export'),
    }


async def test_a_decision_no_writer_makes_goes_to_the_dlq_with_its_reason() -> None:
    log = InMemoryLog()
    projection = await waiting_run(log, 'w-7')
    [refund] = [w.effect for w in await ProjectionReader.of(projection).list_waiting(deferral='approval')]
    good = decision_for(refund, decision='denied', operator='alice', writer_id=WRITER, message='no')
    for bad in (
        dataclasses.replace(good, error=None),  # a denial that does not say why
        dataclasses.replace(good, resolution='approved', result='{}'),  # a result on an approval
        dataclasses.replace(good, resolution='maybe'),  # type: ignore[arg-type]
        dataclasses.replace(good, note=''),  # an empty note
    ):
        await log.wait_acked([await log.append(bad)])
    await projection.wait_for()
    assert [d.reason for d in projection.dead] == ['invalid'] * 4
    assert [w.effect.tool_name for w in await ProjectionReader.of(projection).list_waiting()] == [
        'export',
        'refund',
    ]


def test_an_operators_resolution_note_is_redacted_too() -> None:
    in_doubt = ToolEffectRecord(
        run_id='r', tool_call_id='c', tool_name='charge', status='started', status_seq=3
    )
    secret = 'sk-live-9f8e7d6c5b4a39281706f5e4'
    record = resolution_for(
        in_doubt,
        resolution='happened',
        note=f'checked with api_key={secret}',
        operator='alice',
        writer_id=WRITER,
    )
    assert record.note is not None and secret not in record.note and record.note.startswith('checked with')


async def test_a_second_resumption_of_one_run_is_refused_and_the_first_stands() -> None:
    """Two processes resume one waiting run: the first mark in the log links it, the other is refused."""
    log = InMemoryLog()
    projection = await waiting_run(log, 'w-3')
    reader = ProjectionReader.of(projection)
    for w in await reader.list_waiting():
        decision = 'approved' if w.effect.deferral == 'approval' else 'returned'
        await decide_deferred_call(
            log, w.effect, decision=decision, operator='alice', writer_id=WRITER, result=1
        )
    await projection.wait_for()
    first, second = await resume_run(reader, 'w-3'), await resume_run(reader, 'w-3')  # both read it waiting
    await agent_on(log, 'r-3a', metadata=first.metadata).run(**first.run_kwargs())
    await agent_on(log, 'r-3b', metadata=second.metadata).run(**second.run_kwargs())
    await projection.wait_for()
    waited = await reader.get_run('w-3')
    assert waited is not None and (waited.status, waited.resumed_by) == ('resumed', 'r-3a')
    refused = [d for d in projection.dead if d.reason == 'not_resumable']
    assert (
        len(refused) == 1 and "resumed by run 'r-3a' first; run 'r-3b' resumed it again" in refused[0].detail
    )


async def test_a_run_that_did_not_end_waiting_is_not_marked_resumed() -> None:
    """A resumption mark for a completed run goes to the DLQ; the run keeps its status."""
    log = InMemoryLog()
    agent: Agent[None, Any] = Agent(
        FunctionModel(lambda m, i: ModelResponse(parts=[TextPart('done')])),
        capabilities=[StepPersistence(log=log, run_id='done-1')],
    )
    await agent.run('hi')
    resumer = Agent(
        FunctionModel(lambda m, i: ModelResponse(parts=[TextPart('again')])),
        capabilities=[StepPersistence(log=log, run_id='r-4', metadata={RESUMES_KEY: 'done-1'})],
    )
    await resumer.run('hi')
    projection = MemoryProjection(log)
    await projection.wait_for()
    reader = ProjectionReader.of(projection)
    done = await reader.get_run('done-1')
    assert done is not None and (done.status, done.resumed_by) == ('completed', None)
    assert [d.reason for d in projection.dead] == ['not_resumable']
    with pytest.raises(UsageError, match='names no other run to resume'):
        await Agent(
            FunctionModel(lambda m, i: ModelResponse(parts=[TextPart('x')])),
            capabilities=[StepPersistence(log=log, run_id='r-5', metadata={RESUMES_KEY: 'r-5'})],
        ).run('hi')
