"""A run's timeline: its events, and each resolution and decision on its calls at its time.

`timeline` is one function for the CLI's `events RUN` and the explorer's run page; `effects RUN`
says each ledger entry the same way (`answer_text`). Over the in-memory log and projection: a run
that ends waiting, decided twice (the first stands, the second is history), and a cancelled run
whose call in doubt an operator resolves.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream.console import Answer, ViewArgs, other_topic_seqs, seq_note, show, timeline
from stepstream.producer import InMemoryLog, StepPersistence, decision_for, resolve_tool_effect
from stepstream.serve import Source, create_app
from stepstream.settings import Settings

from deferred_runs import run_until_waiting
from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Ev:
    seq: int
    timestamp: datetime


@dataclass(frozen=True)
class Entry:
    resolution: str
    resolved_at: datetime
    resolves_seq: int
    resolved_by: str = 'op'
    note: str = ''
    args: str | None = None
    result: str | None = None
    error: str | None = None
    applied: bool = True


@dataclass(frozen=True)
class Call:
    tool_call_id: str
    tool_name: str
    resolutions: list[Entry]


@given(
    st.lists(st.integers(0, 50), min_size=0, max_size=12, unique=True).map(sorted),
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=6),
)
def test_every_event_and_answer_is_placed_once_after_what_it_answers(
    seqs: list[int], answers: list[tuple[int, int]]
) -> None:
    events = [Ev(seq, T0 + timedelta(seconds=seq)) for seq in seqs]
    calls = [
        Call(f'c{i}', 'tool', [Entry('approved', T0 + timedelta(seconds=at), answers_seq)])
        for i, (answers_seq, at) in enumerate(answers)
    ]
    line = timeline(events, calls)
    assert [e for e in line if isinstance(e, Ev)] == events
    placed = [e for e in line if isinstance(e, Answer)]
    assert sorted(a.tool_call_id for a in placed) == sorted(c.tool_call_id for c in calls)
    for index, entry in enumerate(line):
        if isinstance(entry, Answer):
            before = {e.seq for e in line[:index] if isinstance(e, Ev)}
            # after the transition it answers and every event written no later than it (one clock here)
            assert all(e.seq in before for e in events if e.seq <= entry.answer.resolves_seq)
            assert all(e.seq in before for e in events if e.timestamp <= entry.timestamp)
            assert all(e.timestamp > entry.timestamp for e in line[index:] if isinstance(e, Ev))


@given(st.sets(st.integers(0, 40)), st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3)), max_size=4))
def test_the_seqs_a_timeline_skips_are_neither_its_events_nor_its_gaps(
    shown: set[int], gaps: list[tuple[int, int]]
) -> None:
    last = max(shown, default=-1)
    lost = [(first, first + length) for first, length in gaps]
    answer = Answer('c', 'tool', Entry('approved', T0, 0))  # takes no seq
    skipped = other_topic_seqs([*(Ev(s, T0) for s in sorted(shown)), answer], last, lost)
    gap_seqs = {s for first, end in lost for s in range(first, end + 1)}
    assert skipped == sorted(set(range(last + 1)) - shown - gap_seqs)
    assert (seq_note(skipped, 'see X') == '') == (not skipped)


def test_answers_at_one_place_keep_the_order_they_were_written() -> None:
    events = [Ev(0, T0), Ev(5, T0 + timedelta(seconds=5))]
    first = Entry('approved', T0 + timedelta(seconds=9), 3)
    second = Entry('denied', T0 + timedelta(seconds=10), 3, applied=False)
    line = timeline(events, [Call('c', 'refund', [first, second])])
    assert [getattr(e, 'seq', None) for e in line] == [0, 5, None, None]
    assert [e.answer for e in line if isinstance(e, Answer)] == [first, second]
    assert [e.kind for e in line if isinstance(e, Answer)] == ['decision', 'decision']
    early = timeline(events, [Call('c', 'refund', [Entry('did_not_happen', T0 + timedelta(seconds=2), 1)])])
    assert [getattr(e, 'seq', 'answer') for e in early] == [0, 'answer', 5]
    assert isinstance(early[1], Answer) and early[1].kind == 'resolution'


def _publish(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[ToolCallPart('publish', {'post': 1}, tool_call_id='call-publish')])


async def _cancelled_in_its_tool(log: InMemoryLog, run_id: str) -> None:
    """A run cancelled inside its tool: the call's effect is in doubt (unknown_after_crash)."""
    agent = Agent(FunctionModel(_publish), capabilities=[StepPersistence(log=log, run_id=run_id)])
    entered = asyncio.Event()

    @agent.tool_plain
    async def publish(post: int) -> str:
        entered.set()
        await asyncio.Event().wait()
        return 'never'

    task = asyncio.create_task(agent.run('publish'))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_events_view_the_ledger_and_the_run_page_show_each_decision_and_resolution() -> None:
    log = InMemoryLog()
    projection = MemoryProjection(log)
    await run_until_waiting(log, 'tl-w')
    await _cancelled_in_its_tool(log, 'tl-c')
    await projection.wait_for()
    reader, settings = projection.reader(), Settings()
    refund = await reader.get_tool_effect('tl-w', 'call-refund')
    doubt = await reader.get_tool_effect('tl-c', 'call-publish')
    assert refund is not None and doubt is not None and doubt.unknown_after_crash

    writer = 'stepstream-cli@here:1'
    first = decision_for(
        refund, decision='approved', operator='alice', writer_id=writer, note='fine', args={'amount': 100}
    )
    second = decision_for(refund, decision='denied', operator='bob', writer_id=writer, message='too late')
    await log.wait_acked([await log.append(first), await log.append(second)])
    await resolve_tool_effect(
        log, doubt, resolution='did_not_happen', note='not on the blog', operator='carol', writer_id=writer
    )
    await projection.wait_for()

    # `events RUN`: the step events, then both decisions at their time, what each says.
    text = await show('events', ViewArgs(run_id='tl-w', wide=True), reader, settings)  # each detail whole
    *_, approved, denied, note = text.splitlines()
    assert note == (  # seq skips the tool-effects topic's records, and says so
        "seq counts the run's records on both topics: the numbers not listed (3, 5, 7, 9, 11, 13, 15) are "
        "its tool calls' records on the tool-effects topic; `stepstream effects tl-w` shows those calls"
    )
    for line in (approved, denied):  # no seq, no step: a decision takes none of the run's
        assert line.split()[0] == '-' and line.split()[3:5] == ['-', 'decision']
    assert approved.endswith('refund call-refund: approved by alice: fine; arguments {"amount":100}')
    assert denied.endswith(
        'refund call-refund: denied by bob (history only: it does not decide the status); error too late'
    )
    events = json.loads(await show('events', ViewArgs(run_id='tl-w', json=True), reader, settings))
    assert all(isinstance(e['seq'], int) for e in events)  # the JSON stays the step events
    *_, resolved, note = (
        await show('events', ViewArgs(run_id='tl-c', wide=True), reader, settings)
    ).splitlines()
    assert "the number not listed (3) is a tool call's record on the tool-effects topic" in note
    assert resolved.split()[3:5] == ['-', 'resolution']
    assert resolved.endswith('publish call-publish: did not happen by carol: not on the blog')

    # `effects RUN`: the decided call says what it waited for, then each decision in log order.
    ledger = await show('effects', ViewArgs(run_id='tl-w', wide=True), reader, settings)
    row = next(line for line in ledger.splitlines() if line.startswith('call-refund '))
    assert row.split()[2:4] == ['resolved', '(approval)']
    assert 'call-refund: waited for a person to approve or deny it (it has not run); arguments ' in ledger
    approval, denial = (line for line in ledger.splitlines() if line.startswith('call-refund: resolved'))
    assert approval.startswith('call-refund: resolved approved by alice at ')
    assert approval.endswith(': fine; arguments {"amount":100}')
    assert denial.startswith('call-refund: resolved denied by bob at ')
    assert denial.endswith('(history only: it does not decide the status); error too late')
    [effect] = [
        e
        for e in json.loads(await show('effects', ViewArgs(run_id='tl-w', json=True), reader, settings))
        if e['tool_call_id'] == 'call-refund'
    ]
    assert [(r['resolution'], r['resolved_by'], r['applied']) for r in effect['resolutions']] == [
        ('approved', 'alice', True),
        ('denied', 'bob', False),
    ]
    assert (
        effect['resolution']['args'] == '{"amount":100}' and effect['resolutions'][1]['error'] == 'too late'
    )

    # The explorer's run page: the same entries in its timeline, each saying whether it stands.
    from test_waiting_surfaces import parse

    source = Source(log.settings, reader, None, log=log)
    transport = httpx.ASGITransport(app=create_app(source))
    async with httpx.AsyncClient(transport=transport, base_url='http://stepstream.test') as client:
        page = parse((await client.get('/runs/tl-w')).text)
        doubtful = parse((await client.get('/runs/tl-c')).text)
    rows = page.one('timeline').find('answer')
    assert [r.attrs['data-tool-call-id'] for r in rows] == ['call-refund', 'call-refund']
    assert [r.one('resolved-by').text for r in rows] == ['alice', 'bob']
    assert rows[0].one('decision-args').text == '{"amount":100}' and rows[0].find('answer-stands')
    assert rows[1].one('decision-error').text == 'too late' and rows[1].find('answer-history')
    assert page.one('timeline').find('event')  # the step events are still there, before them
    assert page.one('seq-note').text.startswith(
        "seq counts the run's records on both topics: the numbers not listed (3, 5, 7, 9, 11, 13, 15)"
    )
    assert page.one('seq-note').text.endswith('the Tool effects table below shows those calls')
    [resolution] = doubtful.one('timeline').find('answer-resolution')
    assert 'did not happen' in resolution.text and resolution.one('resolution-note').text == 'not on the blog'
