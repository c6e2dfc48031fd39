"""Conversations across a group (decision 0062): a conversation's runs, and so its shares, are in
several members' shards; any member lists, searches, pages and reads the conversations exactly as a
service over every shard does (compared answer for answer with one over a projector that owns them all),
and says which member does not answer rather than give a partial list."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
from pydantic_ai import Agent
from test_serve_group import Member, three_members

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence, mark_conversation
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.serve import Source, create_app
from stepstream.topics import murmur2_partition

from agents import answers
from waits import until

pytestmark = pytest.mark.broker

PROMPTS = ('apple pie recipe', 'banana bread', 'apple crumble', 'cherry tart', 'plum jam', 'apple juice')


async def test_any_member_lists_conversations_as_a_reader_of_every_shard(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    runs: dict[str, list[str]] = {}
    for turn in range(3):  # three runs a conversation, interleaved: shares in several members
        for i, prompt in enumerate(PROMPTS):
            conversation = f'conv-{i}'
            run_id = f'{conversation}-{uuid.uuid4().hex[:12]}'
            persistence = StepPersistence(log=event_log, agent_name='chat', run_id=run_id)
            await Agent(answers(f'{prompt} {turn}'), capabilities=[persistence]).run(
                f'{prompt} round {turn}', conversation_id=conversation
            )
            runs.setdefault(conversation, []).append(run_id)
    # A title on one run, words in the prompt of another: a search needs both members' words.
    await mark_conversation(
        event_log, run_id=runs['conv-1'][2], conversation_id='conv-1', title='Yellow fruit'
    )
    await mark_conversation(event_log, run_id=runs['conv-4'][1], conversation_id='conv-4', archived=True)
    await mark_conversation(event_log, run_id=runs['conv-4'][2], conversation_id='conv-4', archived=False)
    # Archived by a mark keyed by an earlier run than the newest: often in another member's shard, so a
    # filtered page places it at that shard's newest activity (`Conversation.placed`), its cursor too.
    await mark_conversation(event_log, run_id=runs['conv-5'][0], conversation_id='conv-5', archived=True)
    await mark_conversation(event_log, run_id=runs['conv-2'][1], conversation_id='conv-2', archived=True)
    end = await event_log.flush()

    async with (
        Projector(settings, db_path=tmp_path / 'everything') as everything,
        three_members(settings, tmp_path) as members,
        httpx.AsyncClient(timeout=60) as http,
    ):
        owner = {p: m for m in members for p in m.projector.partitions}
        await everything.wait_for(end)
        await until(
            lambda: all(
                owner[tp.partition].projector.applied.get(tp, 0) >= offset for tp, offset in end.items()
            ),
            'every member to catch up',
        )
        spread = {c: {owner[murmur2_partition(r.encode(), 3)].url for r in ids} for c, ids in runs.items()}
        assert any(len(urls) > 1 for urls in spread.values()), 'every conversation in one member: run ids?'
        whole = Source(settings, ProjectionReader.of(everything), None)
        transport = httpx.ASGITransport(app=create_app(whole))
        async with httpx.AsyncClient(transport=transport, base_url='http://whole.test') as reference:
            for m in members:
                await _answers_as_the_whole(http, m, reference)
            # One member answers from its own shards alone when asked by another (never a second hop).
            a = members[0]
            alone = await http.get(f'{a.url}/api/conversations', headers={'x-stepstream-forwarded': '1'})
            mine = {c for c, urls in spread.items() if a.url in urls}
            assert {c['conversation_id'] for c in alone.json()['conversations']} == mine
            # A bad cursor is a bad parameter here too, asked of a member (never "not here": a 404).
            bad = await http.get(f'{a.url}/api/conversations', params={'after': 'nonsense'})
            assert bad.status_code == 400 and bad.json()['detail'].startswith("after='nonsense'")
            bad_runs = await http.get(f'{a.url}/api/runs', params={'after': 'no-such-run'})
            assert bad_runs.status_code == 400, bad_runs.text
            assert "after='no-such-run' is not a run of this listing" in bad_runs.json()['detail']


async def _answers_as_the_whole(http: httpx.AsyncClient, m: Member, reference: httpx.AsyncClient) -> None:
    async def both(path: str, **params: object) -> tuple[httpx.Response, httpx.Response]:
        mine = await http.get(f'{m.url}{path}', params=params)
        theirs = await reference.get(path, params=params)
        assert mine.status_code == theirs.status_code == 200, (path, params, mine.text, theirs.text)
        return mine, theirs

    everything, expected = await both('/api/conversations', limit=1000)
    assert everything.json() == expected.json()
    listed = expected.json()['conversations']
    assert len(listed) == len(PROMPTS)
    assert {c['conversation_id']: c['runs'] for c in listed} == {f'conv-{i}': 3 for i in range(len(PROMPTS))}
    assert next(c for c in listed if c['conversation_id'] == 'conv-1')['title'] == 'Yellow fruit'
    assert [c['conversation_id'] for c in listed if c['archived']] == ['conv-5', 'conv-2']
    for filters in ({}, {'archived': 'true'}, {'archived': 'false'}, {'q': 'apple'}, {'q': 'yellow round'}):
        after = None
        while True:  # pages of two (one filtered): each the whole service's page, cursor and all
            params = {'limit': 2 if not filters else 1, **filters, **({'after': after} if after else {})}
            mine, theirs = await both('/api/conversations', **params)
            assert mine.json() == theirs.json(), params
            if (after := theirs.json()['next_after']) is None:
                break
    searched, _ = await both('/api/conversations', q='yellow round')
    assert [c['conversation_id'] for c in searched.json()['conversations']] == ['conv-1']
    apples, _ = await both('/api/conversations', q='apple')
    assert [c['conversation_id'] for c in apples.json()['conversations']] == ['conv-0', 'conv-2', 'conv-5']
    for c in listed:
        mine, theirs = await both(f'/api/conversations/{c["conversation_id"]}')
        assert mine.json() == theirs.json() == c
    missing = await http.get(f'{m.url}/api/conversations/nowhere')
    assert missing.status_code == 404 and 'nowhere' in missing.json()['detail']
    for params in ({}, {'archived': 1}, {'q': 'apple'}):  # the explorer's page
        page, whole_page = await both('/conversations', **params)
        assert _ids(page.text) == _ids(whole_page.text) and _ids(page.text)
    archived, _ = await both('/api/conversations', archived='true')
    assert sorted(c['conversation_id'] for c in archived.json()['conversations']) == ['conv-2', 'conv-5']
    views = (
        {'json': 'true'},
        {'json': 'true', 'search': 'apple'},
        {'limit': '2'},
        {'archived': 'true', 'limit': '1'},
    )
    for params in views:  # the CLI's view
        text, whole_text = await both('/api/console/conversations', **params)
        assert text.text == whole_text.text


def _ids(html: str) -> list[str]:
    return [part.split('"', 1)[0] for part in html.split('data-conversation-id="')[1:]]
