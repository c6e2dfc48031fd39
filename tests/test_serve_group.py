"""Group members answer for each other: three `stepstream serve --group` members, each with its
own directory (as on three hosts), found through the consumer group; any of them answers any
query as one service over every shard would (checked against a projector that owns them all)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from test_cli import orchestrate

from stepstream import Settings
from stepstream.producer import EventLog
from stepstream.projector import GroupMember, Membership, Projector
from stepstream.readmodel import ProjectionReader
from stepstream.serve import app_for, listen, running, url_of
from stepstream.topics import murmur2_partition

from served import crash_in_tool
from waits import until

pytestmark = pytest.mark.broker


@dataclass
class Member:
    url: str
    projector: Projector
    membership: Membership


@contextlib.asynccontextmanager
async def member(settings: Settings, group: str, db_path: Path) -> AsyncIterator[Member]:
    """What `stepstream serve --group` runs: a projector member and its service, in this loop."""
    sock = listen('127.0.0.1', 0)
    membership = Membership(endpoint=url_of(sock))
    projector = Projector(
        settings,
        db_path=db_path,
        member=GroupMember(group=group, membership=membership, session_timeout_ms=6000),
    )
    async with (
        projector,
        running(
            app_for(settings, reader=ProjectionReader.of(projector), membership=membership), sock=sock
        ) as served,
    ):
        yield Member(served.url, projector, membership)


@contextlib.asynccontextmanager
async def three_members(settings: Settings, tmp_path: Path) -> AsyncIterator[list[Member]]:
    """Three members of one group, once each owns one partition and knows the others."""
    group = f'{settings.topics.topic_prefix}.serve'
    async with (
        member(settings, group, tmp_path / 'a') as a,
        member(settings, group, tmp_path / 'b') as b,
        member(settings, group, tmp_path / 'c') as c,
    ):
        members = [a, b, c]
        urls = {m.url for m in members}
        await until(
            lambda: all(
                len(m.projector.partitions) == 1 and set(m.membership.routes.values()) == urls
                for m in members
            ),
            'three members to own one partition each and know each other through the group',
        )
        yield members


def runs_json(runs: list) -> list[tuple[str, str | None, str]]:
    return [(r['run_id'], r['parent_run_id'], r['status']) for r in runs]


async def test_any_member_answers_for_the_whole_group(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    for i in range(5):
        await orchestrate(event_log, f'group-{i}')
    for i in range(4):
        await crash_in_tool(event_log, f'crash-{i}', conversation_id=f'conv-crash-{i}')
    end = await event_log.flush()

    async with (
        Projector(settings, db_path=tmp_path / 'everything') as everything,
        three_members(settings, tmp_path) as members,
        httpx.AsyncClient(timeout=30) as http,
    ):
        a, b, c = members
        owner = {p: m for m in members for p in m.projector.partitions}
        assert all(m.membership.routes == {p: owner[p].url for p in range(3)} for m in members)
        await everything.wait_for(end)
        await until(
            lambda: all(
                owner[tp.partition].projector.applied.get(tp, 0) >= offset for tp, offset in end.items()
            ),
            'every member to catch up',
        )
        reference = ProjectionReader.of(everything)
        oldest_first = [r.run_id for r in await reference.list_runs()]
        newest_first = oldest_first[::-1]
        assert len(oldest_first) == 14

        for m in members:  # lists merged from every member, in the order of the runs index
            page = (await http.get(f'{m.url}/api/runs', params={'order': 'started', 'limit': 1000})).json()
            assert [r['run_id'] for r in page['runs']] == oldest_first and page['next_after'] is None
            unresolved = (await http.get(f'{m.url}/api/unresolved')).json()
            expected = await reference.list_unresolved_tool_effects()
            assert [(e['run_id'], e['tool_call_id']) for e in unresolved] == [
                (e.run_id, e.tool_call_id) for e in expected
            ]
            assert len(unresolved) == 4
            paged: list[dict] = []  # a page of one at a time, each after the last: the same sweep
            while True:
                cursor = (
                    {}
                    if not paged
                    else {
                        'after_started': paged[-1]['started_at'],
                        'after_run_id': paged[-1]['run_id'],
                        'after_tool_call_id': paged[-1]['tool_call_id'],
                    }
                )
                page = (await http.get(f'{m.url}/api/unresolved', params={'limit': 1, **cursor})).json()
                if not page:
                    break
                paged += page
            assert paged == unresolved
            assert (await http.get(f'{m.url}/api/conflicts')).json() == []
            counts = (await http.get(f'{m.url}/api/counts')).json()  # every member's tallies, summed
            whole = await reference.counts()
            assert whole is not None and whole.unresolved_effects == 4
            assert counts == {
                'by_status': whole.by_status,
                'by_agent': whole.by_agent,
                'unresolved_effects': whole.unresolved_effects,
                'broken_chains': whole.broken_chains,
                'waiting_calls': whole.waiting_calls,
            }
            assert sum(counts['by_status'].values()) == 14 and counts['broken_chains'] == 0

        # Pages of two, newest first: each cursor is a run some other member may hold.
        seen: list[str] = []
        after = None
        while True:
            params = {'order': '-started', 'limit': 2, **({'after': after} if after else {})}
            page = (await http.get(f'{b.url}/api/runs', params=params)).json()
            seen += [r['run_id'] for r in page['runs']]
            after = page['next_after']
            if after is None:
                break
        assert seen == newest_first
        filtered = (
            await http.get(f'{c.url}/api/runs', params={'order': 'started', 'agent_name': 'worker'})
        ).json()['runs']
        assert [r['run_id'] for r in filtered] == [
            r.run_id for r in await reference.list_runs(agent_name='worker')
        ]

        # A run's reads, asked of a member that does not own it, are the owner's answer.
        for run_id in oldest_first:
            home = owner[murmur2_partition(run_id.encode(), 3)]
            asked = next(m for m in members if m is not home)
            run = (await http.get(f'{asked.url}/api/runs/{run_id}')).json()
            expected_run = await reference.get_run(run_id)
            assert expected_run is not None and run['status'] == expected_run.status
            events = (await http.get(f'{asked.url}/api/runs/{run_id}/events')).json()
            assert [e['seq'] for e in events] == [e.seq for e in await reference.list_events(run_id)]
            latest = await http.get(f'{asked.url}/api/runs/{run_id}/snapshots/latest')
            assert latest.status_code == 200 and latest.json()['messages']
            # The marker: a forwarded request is answered from the receiver's shards, never sent on.
            marked = await http.get(f'{asked.url}/api/runs/{run_id}', headers={'x-stepstream-forwarded': '1'})
            assert marked.status_code == 503 and 'not readable' in marked.json()['detail']
            page = await http.get(f'{asked.url}/runs/{run_id}')  # the explorer's run page too
            assert page.status_code == 200 and run_id in page.text
        missing = await http.get(f'{a.url}/api/runs/no-such-run')
        assert missing.status_code == 404 and 'no-such-run' in missing.json()['detail']

        # Lineage across members: a boss and its worker held by two members, asked of the third.
        # Run ids are random, so each conversation lands its pair apart with probability 2/3: write
        # more (after the checks above, which count the first 14 runs) until one does.
        for i in range(40):
            if i >= 5:
                await orchestrate(event_log, f'group-{i}')
                more = await event_log.flush()
                await everything.wait_for(more)
                await until(
                    lambda more=more: all(
                        owner[tp.partition].projector.applied.get(tp, 0) >= offset
                        for tp, offset in more.items()
                    ),
                    'every member to catch up with the extra conversation',
                )
            [boss] = await reference.list_runs(conversation_id=f'group-{i}', agent_name='boss')
            [worker] = await reference.list_runs(parent_run_id=boss.run_id)
            holders = {owner[murmur2_partition(r.encode(), 3)].url for r in (boss.run_id, worker.run_id)}
            if len(holders) == 2:
                break
        else:
            pytest.fail('40 conversations and no boss and worker in two partitions: run ids are not random')
        third = next(m for m in members if m.url not in holders)
        lineage = (await http.get(f'{third.url}/api/runs/{worker.run_id}/lineage')).json()
        assert lineage['root']['run_id'] == boss.run_id
        assert [(n['depth'], n['run']['run_id']) for n in lineage['tree']] == [
            (0, boss.run_id),
            (1, worker.run_id),
        ]

        # A resolution through any member is written once, by the owner's service.
        crash = next(
            r
            for r in ('crash-0', 'crash-1', 'crash-2', 'crash-3')
            if owner[murmur2_partition(r.encode(), 3)] is not a
        )
        [effect] = (await http.get(f'{a.url}/api/runs/{crash}/tool-effects')).json()
        resolved = await http.post(
            f'{a.url}/api/runs/{crash}/tool-effects/{effect["tool_call_id"]}/resolution',
            json={'resolution': 'happened', 'note': 'seen in #releases', 'operator': 'dana'},
        )
        assert resolved.status_code == 200, resolved.text
        assert resolved.json()['applied'] and resolved.json()['effect']['status'] == 'resolved'
        for m in members:
            after_sweep = (await http.get(f'{m.url}/api/unresolved')).json()
            assert crash not in {e['run_id'] for e in after_sweep} and len(after_sweep) == 3


async def test_a_member_that_left_is_answered_for_by_the_others(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    for i in range(3):
        await orchestrate(event_log, f'leave-{i}')
    end = await event_log.flush()
    group = f'{settings.topics.topic_prefix}.leave'
    async with (
        member(settings, group, tmp_path / 'a') as a,
        httpx.AsyncClient(timeout=30) as http,
    ):
        async with member(settings, group, tmp_path / 'b') as b:
            await until(
                lambda: len(a.membership.routes) == 3 and set(a.membership.routes.values()) == {a.url, b.url},
                'two members to split the partitions',
            )
            await until(
                lambda: all(
                    (a.projector.applied.get(tp, 0) >= o) or (b.projector.applied.get(tp, 0) >= o)
                    for tp, o in end.items()
                ),
                'both members to catch up',
            )
            both = (await http.get(f'{a.url}/api/runs')).json()['runs']
            assert len(both) == 6
        # b left the group: a is assigned every partition and answers alone.
        await until(
            lambda: set(a.membership.routes.values()) == {a.url} and a.projector.partitions == [0, 1, 2],
            'a to own everything',
        )
        await a.projector.wait_for(end)
        alone = (await http.get(f'{a.url}/api/runs')).json()['runs']
        assert runs_json(alone) == runs_json(both)


async def test_the_serve_command_joins_a_group(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    """`stepstream serve --group` in its own process, next to a member in this one: each answers for both."""
    for i in range(3):
        await orchestrate(event_log, f'cli-{i}')
    await event_log.flush()
    group = f'{settings.topics.topic_prefix}.cli'
    env = {**os.environ, **settings.to_env(), 'STEPSTREAM_DB_PATH': str(tmp_path / 'child')}
    child = await asyncio.create_subprocess_exec(
        sys.executable, '-m', 'stepstream.cli', 'serve', '--group', group, '--port', '0',
        '--checkpoint-interval', '0', '--session-timeout', '6',
        env=env, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = (await asyncio.wait_for(child.stdout.readline(), 60)).decode()
        found = re.search(r'explorer at (http://127\.0\.0\.1:\d+)/ \(member of ', line)
        assert found is not None, line
        child_url = found.group(1)
        async with member(settings, group, tmp_path / 'here') as here, httpx.AsyncClient(timeout=30) as http:
            await until(
                lambda: (
                    set(here.membership.routes.values()) == {here.url, child_url}
                    and len(here.membership.routes) == 3
                ),
                'the two members to know each other',
            )
            expected = 6

            async def listed(url: str) -> int:
                answer = await http.get(f'{url}/api/runs')
                return len(answer.json()['runs']) if answer.status_code == 200 else -1

            # The child catches up in its own time: ask until its part of the list is complete.
            for url in (here.url, child_url):
                deadline = asyncio.get_running_loop().time() + 60
                while await listed(url) != expected:
                    assert asyncio.get_running_loop().time() < deadline, f'{url} never listed {expected} runs'
                    await asyncio.sleep(0.1)
        child.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(child.wait(), 30) == 0
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
