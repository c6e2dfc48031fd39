"""Deferred calls across a group of members: any member lists what waits in the whole group, and a
decision asked of any member is written by the owner of its run, its 409 passed back whole."""

from __future__ import annotations

import httpx
import pytest
from test_serve_group import three_members

from stepstream import Settings
from stepstream.producer import EventLog
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.topics import murmur2_partition

from deferred_runs import run_until_waiting
from waits import until

pytestmark = pytest.mark.broker

RUNS = [f'waits-{i}' for i in range(6)]


async def test_any_member_lists_and_decides_for_the_whole_group(
    settings: Settings, event_log: EventLog, tmp_path
) -> None:
    for run_id in RUNS:
        await run_until_waiting(event_log, run_id)
    end = await event_log.flush()
    async with (
        Projector(settings, db_path=tmp_path / 'everything') as everything,
        three_members(settings, tmp_path) as members,
        httpx.AsyncClient(timeout=60) as http,
    ):
        a = members[0]
        owner = {p: m for m in members for p in m.projector.partitions}
        await everything.wait_for(end)
        await until(
            lambda: all(
                owner[tp.partition].projector.applied.get(tp, 0) >= offset for tp, offset in end.items()
            ),
            'every member to catch up',
        )
        expected = [
            (w.effect.run_id, w.effect.tool_call_id)
            for w in await ProjectionReader.of(everything).list_waiting()
        ]
        assert len(expected) == 3 * len(RUNS)
        for m in members:
            page = (await http.get(f'{m.url}/api/deferred', params={'limit': 1000})).json()
            assert [(w['run_id'], w['tool_call_id']) for w in page['calls']] == expected
            newest = (await http.get(f'{m.url}/api/deferred', params={'newest': 'true'})).json()
            assert [(w['run_id'], w['tool_call_id']) for w in newest['calls']] == expected[::-1]
            paged: list[tuple[str, str]] = []
            after = None
            while True:  # pages of four, each cursor a call some other member may hold
                params = {'limit': 4, **({'after': after} if after else {})}
                answer = (await http.get(f'{m.url}/api/deferred', params=params)).json()
                paged += [(w['run_id'], w['tool_call_id']) for w in answer['calls']]
                after = answer['next_after']
                if after is None:
                    break
            assert paged == expected
            counts = (await http.get(f'{m.url}/api/counts')).json()
            assert counts['waiting_calls'] == {'approval': 6, 'external': 6, 'question': 6}

        # A decision asked of a member that does not own the run: the owner writes it.
        run_id = next(r for r in RUNS if owner[murmur2_partition(r.encode(), 3)] is not a)
        approved = await http.post(
            f'{a.url}/api/runs/{run_id}/calls/call-refund/approve',
            json={'args': {'amount': 5}, 'operator': 'dana'},
        )
        assert approved.status_code == 201, approved.text
        assert approved.json()['written']['resolved_by'] == 'dana' and approved.json()['applied']
        other = next(
            m for m in members if m is not a and m is not owner[murmur2_partition(run_id.encode(), 3)]
        )
        denied = await http.post(
            f'{other.url}/api/runs/{run_id}/calls/call-refund/deny', json={'message': 'no'}
        )
        assert denied.status_code == 409, denied.text
        assert denied.json()['decision']['resolved_by'] == 'dana'
        refused = await http.post(f'{other.url}/api/runs/{run_id}/calls/call-export/approve', json={})
        assert refused.status_code == 422, refused.text
        missing = await http.post(f'{other.url}/api/runs/{run_id}/calls/nope/approve', json={})
        assert missing.status_code == 404
        for m in members:
            left = (await http.get(f'{m.url}/api/deferred', params={'kind': 'approval'})).json()['calls']
            assert (run_id, 'call-refund') not in {(w['run_id'], w['tool_call_id']) for w in left}
            assert len(left) == 5
