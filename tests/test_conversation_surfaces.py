"""Conversations as the API, the explorer and `continue_conversation` show them (decision 0062).

Real agent runs (FunctionModel) write to the in-memory log and are applied to an in-memory
projection: two finished runs in one conversation, one in another, and a third conversation whose
run is still in its tool (live) while it is read. The CLI reads a projection directory: its test
is tests/test_conversations_e2e.py's, over a broker.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import pytest_asyncio
from pydantic_ai import Agent

from stepstream.console import ViewArgs, show
from stepstream.errors import ConversationLive
from stepstream.producer import InMemoryLog, StepPersistence, mark_conversation
from stepstream.projector import Membership
from stepstream.readmodel import ProjectionReader, continue_conversation, continue_run
from stepstream.serve import Source, create_app
from stepstream.serve._group import Peers

from agents import answers, calls_then_answers
from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast


@dataclass
class Projected:
    log: InMemoryLog
    reader: ProjectionReader
    release: asyncio.Event
    live: asyncio.Task[object]
    projection: MemoryProjection


@pytest_asyncio.fixture
async def projected() -> AsyncIterator[Projected]:
    log = InMemoryLog()
    projection = MemoryProjection(log)
    for run_id, conversation in (('a-1', 'conv-a'), ('b-1', 'conv-b'), ('a-2', 'conv-a')):
        agent = Agent(answers(f'answer {run_id}'), capabilities=[StepPersistence(log=log, run_id=run_id)])
        await agent.run(f'question {run_id}', conversation_id=conversation)
    entered, release = asyncio.Event(), asyncio.Event()
    agent = Agent(calls_then_answers('wait'), capabilities=[StepPersistence(log=log, run_id='c-1')])

    @agent.tool_plain
    async def wait() -> str:
        entered.set()
        await release.wait()
        return 'released'

    live = asyncio.create_task(agent.run('go', conversation_id='conv-c'))
    await entered.wait()
    await projection.wait_for()
    assert projection.dead == []
    yield Projected(log, projection.reader(), release, live, projection)
    release.set()
    await live


@pytest_asyncio.fixture
async def api(projected: Projected) -> AsyncIterator[httpx.AsyncClient]:
    source = Source(projected.log.settings, projected.reader, None, log=projected.log)
    transport = httpx.ASGITransport(app=create_app(source))
    async with httpx.AsyncClient(transport=transport, base_url='http://stepstream.test') as client:
        yield client


async def test_the_api_lists_conversations_newest_activity_first_in_pages(api: httpx.AsyncClient) -> None:
    everything = (await api.get('/api/conversations')).json()
    assert [c['conversation_id'] for c in everything['conversations']] == ['conv-c', 'conv-a', 'conv-b']
    assert everything['next_after'] is None
    live, a, b = everything['conversations']
    assert (live['runs'], live['latest_run_id'], live['last_status'], live['live']) == (
        1,
        'c-1',
        'running',
        True,
    )
    assert (a['runs'], a['latest_run_id'], a['last_status'], a['live']) == (2, 'a-2', 'completed', False)
    assert b['runs'] == 1
    # Titled by the first prompt of the earliest run; the live run saved no snapshot yet: none.
    assert (a['title'], b['title'], live['title']) == ('question a-1', 'question b-1', None)
    assert a['usage']['model_requests'] == 2
    run = (await api.get('/api/runs/a-1')).json()
    other = (await api.get('/api/runs/a-2')).json()
    assert a['writer'] == other['registration_id'] is not None
    assert a['usage']['input_tokens'] == run['usage']['input_tokens'] + other['usage']['input_tokens']
    paged, after = [], None
    while True:
        page = (
            await api.get('/api/conversations', params={'limit': 1, **({'after': after} if after else {})})
        ).json()
        paged += page['conversations']
        if (after := page['next_after']) is None:
            break
    assert paged == everything['conversations']
    assert (await api.get('/api/conversations/conv-a')).json() == a
    missing = await api.get('/api/conversations/nowhere')
    assert missing.status_code == 404 and 'nowhere' in missing.json()['detail']


async def test_a_bad_after_is_a_bad_parameter_on_every_paged_read(api: httpx.AsyncClient) -> None:
    # 400 naming `after`, never 404: a group's members read a 404 as "the run is not here".
    for path, after in (
        ('/api/runs', 'no-such-run'),
        ('/api/conversations', 'nonsense'),
        ('/api/deferred', 'not-a-cursor'),
        ('/api/console/runs', 'no-such-run'),
        ('/api/console/conversations', 'nonsense'),
        ('/api/console/deferred', 'not-a-cursor'),
    ):
        answer = await api.get(path, params={'after': after})
        assert answer.status_code == 400, (path, answer.text)
        assert answer.json()['detail'].startswith(f'after={after!r} is not '), path
    # A run that is there, but not in this listing: the same.
    outside = await api.get('/api/runs', params={'conversation_id': 'conv-b', 'after': 'a-1'})
    assert outside.status_code == 400 and "after='a-1' is not a run of this listing" in outside.text
    inside = await api.get(
        '/api/runs', params={'conversation_id': 'conv-a', 'after': 'a-1', 'order': 'started'}
    )
    assert [r['run_id'] for r in inside.json()['runs']] == ['a-2']
    for page in ('/', '/conversations', '/deferred'):  # the explorer's pages of these lists
        assert (await api.get(page, params={'after': 'nonsense'})).status_code == 400, page
    assert (await api.get('/api/runs/no-such-run')).status_code == 404  # a run's reads still 404


async def test_the_explorer_lists_conversations_from_the_top_bar(api: httpx.AsyncClient) -> None:
    home = (await api.get('/')).text
    assert 'href="/conversations"' in home
    page = (await api.get('/conversations')).text
    for conversation in ('conv-a', 'conv-b', 'conv-c'):
        assert f'data-conversation-id="{conversation}"' in page
    assert 'data-conversation-id="conv-c" data-live="true"' in page
    assert 'data-conversation-id="conv-a" data-live="false"' in page
    assert page.index('conv-c') < page.index('conv-a') < page.index('conv-b')


async def test_continuing_a_live_conversation_is_refused_unless_allowed(projected: Projected) -> None:
    reader = projected.reader
    with pytest.raises(ConversationLive, match="'c-1'") as refused:
        await continue_conversation(reader, 'conv-c')
    run = await reader.require_run('c-1')
    assert refused.value.writer == run.registration_id
    assert run.registration_id is not None and repr(run.registration_id) in str(refused.value)
    # Allowed, it is the latest run's history (the live run saved no snapshot yet, in its first tool).
    with pytest.raises(LookupError, match="no snapshot for run_id 'c-1'"):
        await continue_conversation(reader, 'conv-c', allow_live=True, include_interrupted=True)
    finished = await continue_conversation(reader, 'conv-a')
    assert finished == await continue_run(reader, run_id='a-2')
    assert 'answer a-2' in str(finished)


async def test_the_console_view_is_what_the_cli_prints_here_and_through_the_service(
    projected: Projected, api: httpx.AsyncClient
) -> None:
    settings = projected.log.settings
    found = json.loads(await show('conversations', ViewArgs(json=True), projected.reader, settings))
    assert [c['conversation_id'] for c in found] == ['conv-c', 'conv-a', 'conv-b']
    assert [c['live'] for c in found] == [True, False, False]
    assert found[1]['runs'] == 2 and found[1]['latest_run_id'] == 'a-2'
    first = await show('conversations', ViewArgs(limit=1), projected.reader, settings)
    assert 'conv-c' in first and 'live' in first and 'conv-a' not in first
    following = json.loads(
        await show('conversations', ViewArgs(json=True, after=found[0]['cursor']), projected.reader, settings)
    )
    assert following == found[1:]
    served = await api.get('/api/console/conversations', params={'limit': 1})
    assert served.status_code == 200 and served.text == first


async def test_a_title_and_an_archive_mark_on_the_log_show_everywhere(
    projected: Projected, api: httpx.AsyncClient
) -> None:
    log = projected.log
    await mark_conversation(log, run_id='a-2', conversation_id='conv-a', title='  Orders \n of May ')
    await mark_conversation(log, run_id='b-1', conversation_id='conv-b', archived=True)
    await projected.projection.wait_for()
    assert projected.projection.dead == []
    a = (await api.get('/api/conversations/conv-a')).json()
    assert (a['title'], a['archived']) == ('Orders of May', False)
    archived = (await api.get('/api/conversations', params={'archived': 'true'})).json()['conversations']
    assert [c['conversation_id'] for c in archived] == ['conv-b']
    others = (await api.get('/api/conversations', params={'archived': 'false'})).json()['conversations']
    assert [c['conversation_id'] for c in others] == ['conv-c', 'conv-a']
    page = (await api.get('/conversations')).text
    assert 'data-conversation-id="conv-b"' not in page and 'Orders of May' in page
    assert 'data-conversation-id="conv-b"' in (await api.get('/conversations?archived=1')).text
    shown = json.loads(
        await show('conversations', ViewArgs(json=True, archived='true'), projected.reader, log.settings)
    )
    assert [(c['conversation_id'], c['archived']) for c in shown] == [('conv-b', True)]
    # Naming and archiving are no activity: the order stands.
    every = (await api.get('/api/conversations')).json()['conversations']
    assert [c['conversation_id'] for c in every] == ['conv-c', 'conv-a', 'conv-b']
    await mark_conversation(log, run_id='b-1', conversation_id='conv-b', archived=False)
    await projected.projection.wait_for()
    assert not (await api.get('/api/conversations/conv-b')).json()['archived']


async def test_a_search_finds_conversations_by_every_word_of_titles_and_first_prompts(
    projected: Projected, api: httpx.AsyncClient
) -> None:
    reader = projected.reader

    async def found(words: str, **query: object) -> list[str]:
        return [c.conversation_id for c in await reader.search_conversations(words, **query)]  # type: ignore[arg-type]

    assert await found('QUESTION') == ['conv-a', 'conv-b']  # by id; any case
    assert await found('question a') == ['conv-a']  # every word, each of its runs' prompts
    assert await found('question 2') == ['conv-a']  # 'question a-2': a word of the second run's
    assert await found('question c') == [] and await found('') == [] and await found('...') == []
    first = await reader.search_conversations('question', limit=1)
    assert [
        c.conversation_id for c in await reader.search_conversations('question', after=first[0].cursor)
    ] == ['conv-b']
    await mark_conversation(projected.log, run_id='b-1', conversation_id='conv-b', title='Refund for order 7')
    await projected.projection.wait_for()
    assert await found('refund 7') == ['conv-b'] and await found('refund question') == ['conv-b']
    answer = (await api.get('/api/conversations', params={'q': 'order refund'})).json()
    assert [c['conversation_id'] for c in answer['conversations']] == ['conv-b']
    assert 'data-conversation-id="conv-b"' in (await api.get('/conversations', params={'q': 'refund'})).text
    assert (
        'data-conversation-id="conv-a"' not in (await api.get('/conversations', params={'q': 'refund'})).text
    )
    shown = json.loads(
        await show('conversations', ViewArgs(json=True, search='question'), reader, projected.log.settings)
    )
    assert [c['conversation_id'] for c in shown] == ['conv-a', 'conv-b']


async def test_a_group_member_names_the_member_that_does_not_answer(projected: Projected) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(('127.0.0.1', 0))
        gone = f'http://127.0.0.1:{probe.getsockname()[1]}'
    membership = Membership(
        endpoint='http://here.test', routes={0: 'http://here.test', 1: gone}, own=frozenset({0}), partitions=2
    )
    peers = Peers(membership, token=None, timeout_s=5)
    source = Source(projected.log.settings, projected.reader, None, log=projected.log, peers=peers)
    transport = httpx.ASGITransport(app=create_app(source))
    async with httpx.AsyncClient(transport=transport, base_url='http://here.test') as member:
        for path, params in (
            ('/api/conversations', {}),
            ('/api/conversations', {'q': 'question'}),
            ('/api/conversations/conv-a', {}),
            ('/api/console/conversations', {}),
            ('/conversations', {}),
        ):
            answer = await member.get(path, params=params)
            assert answer.status_code == 503, (path, answer.text)
            assert f'the group member at {gone} did not answer' in answer.text, path
        # Asked by another member, it answers from its own shards: never a second hop.
        alone = await member.get('/api/conversations', headers={'x-stepstream-forwarded': '1'})
        assert [c['conversation_id'] for c in alone.json()['conversations']] == ['conv-c', 'conv-a', 'conv-b']
