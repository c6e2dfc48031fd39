"""The run page's HTML, in process: a call in doubt in the totals and the waterfall, a delegating
call linked to the run it started, siblings apart from the parent and the children, the page that
confirms a resolution, and problems that never name a place on the server.

The in-memory log and projection under the service's app (applied every few milliseconds, as a
projector would); tests/test_explorer.py looks at the same pages in Chromium.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from test_waiting_surfaces import Page, parse

from stepstream.ids import short_id
from stepstream.media import DiskMediaStore
from stepstream.producer import InMemoryLog, StepPersistence, annotate_tool_effect
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import PARENT_CALL_KEY
from stepstream.serve import Source, create_app
from stepstream.serve._public import SERVER_PATH, Withheld

from agents import answers, calls_then_answers
from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast

CRASHED, KILLED = 'publisher-crashed', 'publisher-killed'


async def in_tool_until_stopped(log: InMemoryLog, run_id: str, *, killed: bool = False) -> None:
    """A publisher stopped in the middle of its tool: cancelled (the run ends `cancelled`), or
    killed (`killed`: the log keeps what was written up to the call, as after SIGKILL)."""
    entered = asyncio.Event()
    written = 0
    agent = Agent(calls_then_answers('announce'), capabilities=[StepPersistence(log=log, run_id=run_id)])

    @agent.tool
    async def announce(ctx: RunContext[Any]) -> str:
        nonlocal written
        await annotate_tool_effect(ctx, idempotency_key='announce:#releases', effect_summary='posts to Slack')
        written = len(log.records)
        entered.set()
        await asyncio.sleep(3600)
        return 'never'

    task = asyncio.create_task(agent.run('announce it', conversation_id=f'conv-{run_id}'))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if killed:
        del log.records[written:]


async def delegating_runs(log: InMemoryLog) -> None:
    """An orchestrator whose two `research` calls each start a researcher, then a run beside them."""
    researcher = Agent(
        calls_then_answers('search'), capabilities=[StepPersistence(log=log, agent_name='researcher')]
    )

    @researcher.tool_plain
    def search() -> str:
        return 'found 3 documents'

    orchestrator = Agent(
        calls_then_answers('research', calls=2),
        capabilities=[StepPersistence(log=log, agent_name='orchestrator', run_id='orchestrator-1')],
    )

    @orchestrator.tool_plain
    async def research() -> str:
        return (await researcher.run('look it up', conversation_id='conv-team')).output

    await orchestrator.run('plan the release', conversation_id='conv-team')
    late = Agent(answers(), capabilities=[StepPersistence(log=log, agent_name='latecomer', run_id='late-1')])
    await late.run('hello', conversation_id='conv-team')


@dataclass
class Served:
    api: httpx.AsyncClient
    reader: ProjectionReader


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    log = InMemoryLog()
    await delegating_runs(log)
    await in_tool_until_stopped(log, CRASHED)
    await in_tool_until_stopped(log, KILLED, killed=True)
    projection = MemoryProjection(log)
    await projection.wait_for()

    async def apply() -> None:
        while True:
            await projection.wait_for()
            await asyncio.sleep(0.01)

    applying = asyncio.create_task(apply())
    # Every run without an end reads stale at once: the killed publisher's writer is gone.
    reader = ProjectionReader({0: projection.shard}, partitions=1, stale_after_s=0.001)
    source = Source(log.settings.replace(operator='oncall-alice'), reader, None, log=log)
    transport = httpx.ASGITransport(app=create_app(source))
    try:
        async with httpx.AsyncClient(transport=transport, base_url='http://stepstream.test') as client:
            yield Served(client, reader)
    finally:
        applying.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await applying
        assert projection.dead == []


async def page(served: Served, path: str) -> Page:
    answer = await served.api.get(path)
    assert answer.status_code == 200, answer.text
    return parse(answer.text)


def bar(page: Page, tool_call_id: str) -> tuple[float, float]:
    """Where the call's bar starts and ends, in thousandths of the waterfall's width."""
    [row] = [e for e in page.find('span-tool') if e.attrs.get('data-tool-call-id') == tool_call_id]
    [rect] = row.tags('rect')
    left, width = float(rect.attrs['x']), float(rect.attrs['width'])
    return left, left + width


@pytest.mark.parametrize('run_id', [CRASHED, KILLED])
async def test_a_call_in_doubt_is_counted_and_drawn_open_to_the_end(served: Served, run_id: str) -> None:
    run = await page(served, f'/runs/{run_id}')
    tool = run.one('total-tool').text
    assert '1 call in doubt (started, never ended)' in tool and '0 call(s) that ended' in tool
    [row] = run.find('span-unknown_after_crash')
    assert row.one('span-took').text == 'no end'
    assert [r.classes for r in row.tags('rect')] == [['open-bar', 'in-doubt-bar']]
    assert bar(run, 'call-0')[1] == 1000.0  # to the waterfall's right edge
    assert row.one('in-doubt-note').text.startswith('in doubt: started +')
    label = row.tags('svg')[0].attrs['aria-label']
    assert 'no end: in doubt' in label and '—' not in label
    # The model request before it ended: its bar is closed, and ends before the open one starts.
    [model] = run.find('span-model')
    assert model.tags('rect')[0].classes == []
    left, right = float(model.tags('rect')[0].attrs['x']), bar(run, 'call-0')[0]
    assert left + float(model.tags('rect')[0].attrs['width']) <= right


async def test_a_killed_run_has_no_end_on_its_clock(served: Served) -> None:
    killed = await page(served, f'/runs/{KILLED}')
    assert 'status-stale' in killed.find('badge')[0].classes
    header = killed.one('spans').tags('th')[4].text
    assert header.startswith("on the run's clock (from its start 20") and header.endswith('; no end)')
    assert '(—)' not in header
    # An ended run's clock is its duration.
    cancelled = await page(served, f'/runs/{CRASHED}')
    assert re.fullmatch(r"on the run's clock \([\d.]+ m?s\)", cancelled.one('spans').tags('th')[4].text)


async def test_totals_without_a_call_in_doubt_say_nothing_of_doubt(served: Served) -> None:
    run = await page(served, '/runs/late-1')
    assert run.one('total-tool').text == '0.0 ms in 0 call(s)'
    assert run.find('in-doubt-bar') == [] and run.find('total-in-doubt') == []


async def test_a_delegating_call_links_the_run_it_started(served: Served) -> None:
    children = await served.reader.list_runs(parent_run_id='orchestrator-1')
    assert len(children) == 2
    run = await page(served, '/runs/orchestrator-1')
    calls = {e.attrs['data-tool-call-id']: e for e in run.find('span-tool')}
    for call, child in zip(['call-0', 'call-1'], children, strict=True):
        [delegate] = calls[call].find('delegate')
        assert delegate.links == [f'/runs/{child.run_id}']
        assert delegate.text.startswith(f'started run {short_id(child.run_id)} (researcher)')
    # A run without children links none; a child's own calls do not link its parent.
    assert (await page(served, f'/runs/{children[0].run_id}')).find('delegate') == []


async def test_siblings_are_the_conversation_apart_from_parent_and_children(served: Served) -> None:
    first, second = await served.reader.list_runs(parent_run_id='orchestrator-1')
    child = await page(served, f'/runs/{first.run_id}')
    assert sorted(child.one('siblings').links) == sorted([f'/runs/{second.run_id}', '/runs/late-1'])
    assert child.one('parent').links == ['/runs/orchestrator-1']
    parent = await page(served, '/runs/orchestrator-1')
    assert parent.one('siblings').links == ['/runs/late-1']  # not its own children
    assert sorted(parent.one('children').links) == sorted(f'/runs/{r.run_id}' for r in (first, second))


async def test_a_resolution_is_confirmed_with_what_was_recorded_and_by_whom(served: Served) -> None:
    form = {'resolution': 'did_not_happen', 'note': 'no announcement in #releases', 'by': 'Dana Reyes'}
    answer = await served.api.post(f'/runs/{CRASHED}/effects/call-0/resolve', data=form)
    assert answer.status_code == 200, answer.text
    done = parse(answer.text)
    assert done.tags('h1')[0].text == 'Resolution recorded'
    recorded = done.one('decision-recorded')
    assert recorded.one('resolution').text == 'did not happen'
    assert recorded.one('resolution-note').text == 'no announcement in #releases'
    assert recorded.one('resolved-by').text == 'Dana Reyes'
    assert (
        done.one('recorded-by').text == 'Dana Reyes'
        and 'no name was given' not in done.one('decided-by').text
    )
    assert done.one('resolved-effect').one('badge').text == 'resolved'
    assert done.one('resolved-effect').one('effect-summary').text == 'posts to Slack'
    assert done.find('warning') == []  # the projection shows it
    assert done.one('back-to-run').attrs['href'] == f'/runs/{CRASHED}'

    # Without a name, the service's operator is recorded, and the page says so.
    del form['by']
    answer = await served.api.post(f'/runs/{KILLED}/effects/call-0/resolve', data=form)
    done = parse(answer.text)
    assert done.one('recorded-by').text == 'oncall-alice'
    assert 'no name was given' in done.one('decided-by').text
    # The run's page: nothing left to resolve; the call still has no end, and says it was resolved.
    killed = await page(served, f'/runs/{KILLED}')
    assert killed.find('resolve') == [] and killed.find('total-in-doubt') == []
    assert killed.one('total-resolved').text == '1 call never ended, resolved by an operator'
    [row] = killed.find('span-resolved')
    assert row.one('span-took').text == 'no end' and row.one('bar-note').text.startswith('resolved: started')
    assert bar(killed, 'call-0')[1] == 1000.0 and row.find('in-doubt-bar') == []
    too_long = await served.api.post(
        f'/runs/{CRASHED}/effects/call-0/resolve', data={**form, 'by': 'x' * 201, 'note': 'again'}
    )
    assert too_long.status_code == 422 and 'at most 200 characters' in too_long.text


async def test_the_resolve_form_asks_who_resolves(served: Served) -> None:
    run = await page(served, f'/runs/{CRASHED}')
    [form] = run.find('resolve')
    assert [i.attrs['name'] for i in form.tags('input') if i.attrs.get('name') == 'by'] == ['by']
    assert 'recorded as who resolved' in form.one('by').text


def test_a_problem_names_no_place_on_the_server(tmp_path: Path) -> None:
    media = DiskMediaStore(tmp_path / 'media')
    root = tmp_path / 'stack' / 'projection'
    withheld = Withheld.of('.stepstream/projection', root, media)
    said = withheld.public(
        f"no run 'x' in the projection at {root}; media media+sha256://ab is not in {media.location}; "
        f'shard {root}/shard-2/LOCK: busy; see /var/lib/other/thing, /api/runs/x and http://h:1/a/b'
    )
    assert str(tmp_path) not in said and '/var/lib' not in said
    assert "no run 'x' in the projection at [the projection directory];" in said
    assert 'is not in [the media store];' in said
    assert 'shard [the projection directory]/shard-2/LOCK' in said
    assert f'see {SERVER_PATH},' in said
    assert '/api/runs/x' in said and 'http://h:1/a/b' in said  # the service's own routes, a URL
    assert withheld.public('at .stepstream/projection.') == 'at [the projection directory].'
    assert withheld.public('a ratio 1/2 and a/b/c') == 'a ratio 1/2 and a/b/c'


async def test_parallel_calls_each_link_the_delegate_they_started() -> None:
    """Two calls of one response run together, each starting a researcher: the child names its
    call (`PARENT_CALL_KEY`), so each call links its own child, not both, though their times overlap."""
    log = InMemoryLog()
    both_in = asyncio.Barrier(2)
    researcher = Agent(answers('found'), capabilities=[StepPersistence(log=log, agent_name='researcher')])

    def two_at_once(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if any(isinstance(p, ToolReturnPart) for m in messages for p in m.parts):
            return ModelResponse(parts=[TextPart('done')])
        return ModelResponse(
            parts=[ToolCallPart('research', {'topic': t}, tool_call_id=f'call-{t}') for t in ('a', 'b')]
        )

    orchestrator = Agent(
        FunctionModel(two_at_once),
        capabilities=[StepPersistence(log=log, agent_name='orchestrator', run_id='orchestrator-p')],
    )

    @orchestrator.tool_plain
    async def research(topic: str) -> str:
        await both_in.wait()  # both calls are running when either child starts
        return (await researcher.run(f'look up {topic}')).output

    await orchestrator.run('plan')
    projection = MemoryProjection(log)
    await projection.wait_for()
    reader = ProjectionReader({0: projection.shard}, partitions=1)
    children = {
        r.metadata[PARENT_CALL_KEY]: r.run_id for r in await reader.list_runs(parent_run_id='orchestrator-p')
    }
    assert sorted(children) == ['call-a', 'call-b']
    source = Source(log.settings, reader, None, log=log)
    transport = httpx.ASGITransport(app=create_app(source))
    async with httpx.AsyncClient(transport=transport, base_url='http://stepstream.test') as client:
        answer = await client.get('/runs/orchestrator-p')
    calls = {e.attrs['data-tool-call-id']: e for e in parse(answer.text).find('span-tool')}
    for call, child in children.items():
        [delegate] = calls[call].find('delegate')
        assert delegate.links == [f'/runs/{child}']
        assert 'other' not in delegate.text  # named by the child: no "started while ... ran"


async def test_a_model_request_its_run_stopped_waiting_for_has_no_end() -> None:
    """A run killed while its model thinks: the request never ends, and the page says so rather
    than "not ended yet" (a request of a live run would still end)."""
    log = InMemoryLog()
    entered = asyncio.Event()
    written = 0

    async def thinks(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        nonlocal written
        written = len(log.records)
        entered.set()
        await asyncio.sleep(3600)
        raise AssertionError('never answers')

    agent = Agent(FunctionModel(thinks), capabilities=[StepPersistence(log=log, run_id='thinker-killed')])
    task = asyncio.create_task(agent.run('think'))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    del log.records[written:]  # killed: the log keeps what was written up to the request
    projection = MemoryProjection(log)
    await projection.wait_for()
    reader = ProjectionReader({0: projection.shard}, partitions=1, stale_after_s=0.001)
    transport = httpx.ASGITransport(app=create_app(Source(log.settings, reader, None, log=log)))
    async with httpx.AsyncClient(transport=transport, base_url='http://stepstream.test') as client:
        answer = await client.get('/runs/thinker-killed')
    [request] = parse(answer.text).find('span-model')
    assert 'span-no_answer' in request.attrs['class']
    assert request.one('span-took').text == 'no end'
    assert request.one('bar-note').text.startswith('no answer, its run stopped: started +')
