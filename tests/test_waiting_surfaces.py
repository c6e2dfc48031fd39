"""A run that ends waiting, and its deferred calls, as every read surface shows them.

One projection (the in-memory log and projection) holds a run that ended waiting on three
deferred calls (an approval, a question, an outside system), a completed run, and a run cancelled
in the middle of its tool (a call `unknown_after_crash`, so the unresolved listings are not empty
and what they leave out is left out by rule). The API, the console views and the explorer are
read over that projection in process (`create_app` over a `Source`); the CLI and `/metrics`
processes are tests/test_cli.py's and tests/test_operations.py's.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from pydantic_ai import Agent

from stepstream import schemas
from stepstream.cli import _views as cli_views
from stepstream.metrics import CATALOGUE
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.readmodel import ProjectionReader
from stepstream.serve import Source, create_app

from agents import answers, calls_then_answers
from deferred_runs import DEFERRALS, EXPORT_METADATA, REFUND_ARGS, run_until_waiting
from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
WAITING, DONE, CRASHED = 'waits-1', 'done-1', 'crashed-1'


async def crash_in_tool(log: InMemoryLog, run_id: str) -> None:
    """A run cancelled in the middle of its tool: its call stays `started`, in doubt once applied."""
    entered = asyncio.Event()
    agent = Agent(calls_then_answers('send'), capabilities=[StepPersistence(log=log, run_id=run_id)])

    @agent.tool_plain
    async def send() -> str:
        entered.set()
        await asyncio.sleep(3600)
        return 'never'

    task = asyncio.create_task(agent.run('go'))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@dataclass
class Projected:
    """The log the runs were written to, and a reader of their projection."""

    log: InMemoryLog
    reader: ProjectionReader


@pytest_asyncio.fixture
async def projected() -> Projected:
    log = InMemoryLog()
    projection = MemoryProjection(log)
    await run_until_waiting(log, WAITING)
    await Agent(answers(), capabilities=[StepPersistence(log=log, run_id=DONE)]).run('hello')
    await crash_in_tool(log, CRASHED)
    await projection.wait_for()
    assert projection.dead == []
    return Projected(log, projection.reader())


@pytest_asyncio.fixture
async def api(projected: Projected) -> AsyncIterator[httpx.AsyncClient]:
    source = Source(projected.log.settings, projected.reader, None, log=projected.log)
    transport = httpx.ASGITransport(app=create_app(source))
    async with httpx.AsyncClient(transport=transport, base_url='http://stepstream.test') as client:
        yield client


def test_every_copy_of_the_statuses_is_the_schemas() -> None:
    """The CLI's copies (kept to start fast), the metric's help, its docs and the badges' styles."""
    assert cli_views.RUN_STATUSES == schemas.RUN_STATUSES
    assert cli_views.CHAIN_STATUSES == schemas.CHAIN_STATUSES
    assert 'waiting' in schemas.RUN_STATUSES
    docs = next(
        line for line in (ROOT / 'docs/operations.md').read_text().splitlines() if '`stepstream_runs`' in line
    )
    css = (ROOT / 'serve/static/explorer.css').read_text()
    for status in schemas.RUN_STATUSES:
        assert f'`{status}`' in docs, status
        assert status in CATALOGUE['stepstream_runs'].help, status
        assert re.search(rf'\.status-{status}\b[^{{]*\{{', css), f'no badge style for {status}'


async def test_the_api_lists_and_counts_a_waiting_run(api: httpx.AsyncClient) -> None:
    page = (await api.get('/api/runs', params={'status': 'waiting'})).json()
    assert [(r['run_id'], r['status']) for r in page['runs']] == [(WAITING, 'waiting')]
    counts = (await api.get('/api/counts')).json()
    assert counts['by_status'] == dict.fromkeys(schemas.RUN_STATUSES, 0) | {
        'waiting': 1,
        'completed': 1,
        'cancelled': 1,
    }
    assert counts['unresolved_effects'] == 1  # the crashed run's call; no deferred one
    status = (await api.get('/api/status')).json()
    assert status['runs']['by_status']['waiting'] == 1

    # The view the CLI asks the service for takes the status too, and prints the run as waiting.
    text = (await api.get('/api/console/runs', params={'status': 'waiting'})).text
    assert [line.split()[:3] for line in text.splitlines()[2:]] == [[WAITING, 'refunds', 'waiting']]
    tree = (await api.get(f'/api/console/tree/{WAITING}')).text
    assert tree == f'{WAITING}  [refunds, waiting]'


async def test_a_deferred_call_reads_deferred_with_what_it_waits_for(api: httpx.AsyncClient) -> None:
    effects = (await api.get(f'/api/runs/{WAITING}/tool-effects')).json()
    by_tool = {e['tool_name']: e for e in effects}
    assert {tool: e['status'] for tool, e in by_tool.items()} == dict.fromkeys(DEFERRALS, 'deferred') | {
        'lookup': 'completed'
    }
    for tool, deferral in DEFERRALS.items():
        e = by_tool[tool]
        assert (e['deferral'], e['in_flight'], e['unknown_after_crash']) == (deferral, False, False), tool
    assert json.loads(by_tool['refund']['args']) == REFUND_ARGS
    assert json.loads(by_tool['export']['deferral_metadata']) == EXPORT_METADATA
    assert by_tool['refund']['deferral_metadata'] is None
    assert (by_tool['lookup']['deferral'], by_tool['lookup']['args']) == (None, None)

    # `stepstream effects RUN`: the kind in the status, then what each call waits for.
    text = (await api.get(f'/api/console/effects/{WAITING}', params={'wide': 'true'})).text  # lines whole
    rows = {line.split()[0]: line for line in text.splitlines()[2:6]}
    assert 'deferred (approval)' in rows['call-refund'] and 'deferred (external)' in rows['call-export']
    assert 'deferred (question)' in rows['call-ask'] and 'completed' in rows['call-lookup']
    waits = text.splitlines()[6:]
    assert waits == [
        'call-refund: waits for a person to approve or deny it (it has not run); arguments '
        + json.dumps(REFUND_ARGS, separators=(',', ':')),
        'call-ask: waits for an answer to what it asks; arguments {"question":"which card?"}',
        'call-export: waits for an outside system\'s result; arguments {"table":"orders"}; '
        'metadata {"job":"export-7"}',
    ]
    as_json = json.loads((await api.get(f'/api/console/effects/{WAITING}', params={'json': 'true'})).text)
    assert [(e['status'], e['deferral']) for e in as_json][:3] == [
        ('deferred', 'approval'),
        ('deferred', 'question'),
        ('deferred', 'external'),
    ]


async def test_a_deferred_call_is_never_unresolved_nor_resolved(
    api: httpx.AsyncClient, projected: Projected
) -> None:
    reader = projected.reader
    unresolved = (await api.get('/api/unresolved')).json()
    assert [(e['run_id'], e['tool_name']) for e in unresolved] == [(CRASHED, 'send')]
    assert await reader.list_unresolved_tool_effects(WAITING) == []
    summary = await reader.unresolved_summary()  # what the in-doubt gauges read
    assert (summary.in_flight, summary.in_doubt) == (0, 1)

    sweep = (await api.get('/api/console/unresolved')).text
    assert CRASHED in sweep and WAITING not in sweep
    one = (await api.get(f'/api/console/unresolved/{WAITING}', params={'json': 'true'})).text
    assert json.loads(one) == []

    # An operator cannot resolve a call that waits, not even with force: it is not in doubt.
    for force in (False, True):
        answer = await api.post(
            f'/api/runs/{WAITING}/tool-effects/call-export/resolution',
            json={'resolution': 'did_not_happen', 'note': 'checked', 'force': force},
        )
        assert answer.status_code == 409 and 'is deferred, not unknown_after_crash' in answer.text


async def test_the_runs_page_filters_and_counts_waiting_runs(api: httpx.AsyncClient) -> None:
    page = parse((await api.get('/')).text)
    counts = page.one('counts')
    assert 'waiting 1' in counts.text and '/?status=waiting' in counts.links
    assert 'waiting' in [o.attrs['value'] for o in page.tags('option')]
    waiting = parse((await api.get('/', params={'status': 'waiting'})).text)
    assert [b.text for b in waiting.find('badge')] == ['waiting']
    assert [r.attrs['data-run-id'] for r in waiting.find('run-row')] == [WAITING]
    assert 'status-waiting' in waiting.one('badge').classes


async def test_the_run_page_shows_each_deferred_call_and_no_resolve_form(api: httpx.AsyncClient) -> None:
    page = parse((await api.get(f'/runs/{WAITING}')).text)
    assert page.find('status-waiting')[0].text == 'waiting'
    assert 'nothing to resolve' in page.one('deferred').text and 'resume_run' in page.one('deferred').text
    calls = {e.attrs['data-tool-call-id']: e for e in page.find('deferred-effect')}
    assert {c: e.attrs['data-deferral'] for c, e in calls.items()} == {
        'call-refund': 'approval',
        'call-ask': 'question',
        'call-export': 'external',
    }
    refund = calls['call-refund']
    assert 'deferred: approval' in refund.text and 'waits for a person to approve or deny it' in refund.text
    assert json.loads(refund.one('deferred-args').text) == REFUND_ARGS  # markup shown as text
    assert '<b>charged twice</b>' not in page.html and '&lt;b&gt;charged twice' in page.html
    assert json.loads(calls['call-export'].one('deferred-metadata').text) == EXPORT_METADATA
    assert calls['call-ask'].find('deferred-metadata') == []
    assert page.find('unknown-effect') == [] and page.find('in-flight-effect') == []
    assert page.find('resolve') == []

    # The waterfall ends each deferred bar as deferred, the approval's too (it never started).
    spans = {e.attrs['data-tool-call-id']: e.classes for e in page.find('span-tool')}
    assert {c for c, classes in spans.items() if 'span-deferred' in classes} == set(calls)
    assert 'span-completed' in spans['call-lookup']

    # The same page of a crashed run does offer the form: the check above can fail.
    crashed = parse((await api.get(f'/runs/{CRASHED}')).text)
    assert len(crashed.find('resolve')) == 1 and crashed.find('deferred-effect') == []


async def test_the_unresolved_page_leaves_deferred_calls_out(api: httpx.AsyncClient) -> None:
    page = parse((await api.get('/unresolved')).text)
    rows = [r.attrs['data-run-id'] for r in page.tags('tr') if 'data-run-id' in r.attrs]
    assert rows == [CRASHED]
    assert 'deferred' in page.one('effect-deferred').text  # the page says where those went


async def test_the_parquet_rows_of_a_waiting_run_and_its_deferred_calls(projected: Projected) -> None:
    from stepstream.analytics._tables import RUNS, TOOL_EFFECTS, arrow_schema

    reader = projected.reader
    run = await reader.require_run(WAITING)
    assert RUNS.row.model_validate({**RUNS.make(run), 'export_seq': 1}).model_dump()['status'] == 'waiting'
    rows = [TOOL_EFFECTS.make((e, run)) for e in await reader.list_tool_effects(WAITING)]
    for row in rows:
        TOOL_EFFECTS.row.model_validate({**row, 'export_seq': 1})
    shown = {
        r['tool_name']: (r['status'], r['deferral'], r['unknown_after_crash'], r['run_status']) for r in rows
    }
    assert shown == {
        'refund': ('deferred', 'approval', False, 'waiting'),
        'ask_customer': ('deferred', 'question', False, 'waiting'),
        'export': ('deferred', 'external', False, 'waiting'),
        'lookup': ('completed', None, False, 'waiting'),
    }
    export = next(r for r in rows if r['tool_name'] == 'export')
    assert (json.loads(export['args']), json.loads(export['deferral_metadata'])) == (
        {'table': 'orders'},
        EXPORT_METADATA,
    )
    columns = arrow_schema(TOOL_EFFECTS.row)
    for name in ('deferral', 'args', 'deferral_metadata'):
        assert str(columns.field(name).type) == 'string', name


# -- reading the served HTML -------------------------------------------------------------------


@dataclass
class Element:
    """An element of a page: its tag, attributes, the text within it and the links under it."""

    tag: str
    attrs: dict[str, str]
    text: str = ''
    links: list[str] = field(default_factory=list)
    children: list[Element] = field(default_factory=list)

    @property
    def classes(self) -> list[str]:
        return self.attrs.get('class', '').split()

    def walk(self) -> list[Element]:
        return [self, *(e for child in self.children for e in child.walk())]

    def find(self, cls: str) -> list[Element]:
        """Every element under this one with the class `cls`."""
        return [e for e in self.walk()[1:] if cls in e.classes]

    def tags(self, tag: str) -> list[Element]:
        return [e for e in self.walk()[1:] if e.tag == tag]

    def one(self, cls: str) -> Element:
        [found] = self.find(cls)
        return found


@dataclass
class Page(Element):
    html: str = ''


VOID = {'area', 'base', 'br', 'col', 'embed', 'hr', 'img', 'input', 'link', 'meta', 'source', 'wbr'}


class _Tree(HTMLParser):
    def __init__(self, page: Page) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[Element] = [page]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or '' for k, v in attrs})
        self.stack[-1].children.append(element)
        if tag == 'a' and 'href' in element.attrs:
            for open_element in self.stack:
                open_element.links.append(element.attrs['href'])
        if tag not in VOID:
            self.stack.append(element)

    def handle_endtag(self, tag: str) -> None:
        if any(e.tag == tag for e in self.stack[1:]):
            while self.stack.pop().tag != tag:
                pass

    def handle_data(self, data: str) -> None:
        for element in self.stack:
            element.text += data


def parse(html: str) -> Page:
    """The page as a tree of elements (text stripped of surrounding blanks as it is read)."""
    page = Page('document', {}, html=html)
    _Tree(page).feed(html)
    for element in page.walk():
        element.text = element.text.strip()
    return page
