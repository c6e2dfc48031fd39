"""Decisions on deferred calls through `stepstream serve` on the brokers: list, approve, deny, complete.

Runs that end waiting (tests/deferred_runs.py) are written to the broker, projected and served with
the explorer's other runs (tests/served.py); a decision goes to the log through the service's own
`EventLog`, and the answer comes once the served projection shows it. tests/test_decisions_api.py
holds the same rules in process, on the in-memory log.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from stepstream.embedded import EmbeddedStack
from stepstream.readmodel import ProjectionReader
from stepstream.serve import app_for, running

from deferred_runs import EXPORT_METADATA, REFUND_ARGS, resume, run_until_waiting
from served import Served, served_projection

pytestmark = [pytest.mark.broker, pytest.mark.asyncio(loop_scope='module')]

REFUNDS, BILLING = 'refunds-waiting', 'billing-waiting'


@pytest_asyncio.fixture(scope='module', loop_scope='module')
async def served(stack: EmbeddedStack, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    settings = stack.settings.replace(
        topic_prefix=f'test-{uuid.uuid4().hex[:12]}', partitions=3, operator='oncall-alice'
    )
    async with served_projection(settings, tmp_path_factory.mktemp('decisions') / 'projection') as s:
        await run_until_waiting(s.log, REFUNDS)
        await run_until_waiting(s.log, BILLING, agent_name='billing')
        await s.settle()
        yield s


@pytest_asyncio.fixture(loop_scope='module')
async def api(served: Served) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
        yield client


def calls(page: dict) -> list[tuple[str, str]]:
    return [(c['run_id'], c['tool_call_id']) for c in page['calls']]


async def test_the_calls_that_wait_are_listed_filtered_and_paged(api: httpx.AsyncClient) -> None:
    page = (await api.get('/api/deferred')).json()
    everything = calls(page)
    assert page['next_after'] is None and len(everything) == 6  # served.py's runs wait for nothing
    by_call = {(c['run_id'], c['tool_call_id']): c for c in page['calls']}
    refund = by_call[(REFUNDS, 'call-refund')]
    assert (refund['kind'], refund['tool_name'], refund['agent_name']) == ('approval', 'refund', 'refunds')
    assert refund['conversation_id'] == f'conv-{REFUNDS}' and json.loads(refund['args']) == REFUND_ARGS
    assert refund['waited_s'] > 0 and refund['waiting_since'] is not None
    assert json.loads(by_call[(BILLING, 'call-export')]['deferral_metadata']) == EXPORT_METADATA

    assert calls((await api.get('/api/deferred', params={'newest': 'true'})).json()) == everything[::-1]
    first = (await api.get('/api/deferred', params={'limit': 5})).json()
    rest = (await api.get('/api/deferred', params={'limit': 5, 'after': first['next_after']})).json()
    assert calls(first) + calls(rest) == everything and rest['next_after'] is None
    questions = (await api.get('/api/deferred', params={'kind': 'question', 'agent': 'billing'})).json()
    assert calls(questions) == [(BILLING, 'call-ask')]
    conversation = (await api.get('/api/deferred', params={'conversation': f'conv-{REFUNDS}'})).json()
    assert {run for run, _ in calls(conversation)} == {REFUNDS}
    assert (await api.get('/api/deferred', params={'after': 'nope'})).status_code == 400
    counts = (await api.get('/api/counts')).json()
    assert counts['waiting_calls'] == {'approval': 2, 'external': 2, 'question': 2}


async def test_an_approval_with_changed_arguments_and_a_conflicting_second_decision(
    served: Served, api: httpx.AsyncClient
) -> None:
    url = f'/api/runs/{REFUNDS}/calls/call-refund'
    approved = await api.post(
        f'{url}/approve', json={'args': {'amount': 100, 'reason': 'partial'}, 'note': 'ok'}
    )
    assert approved.status_code == 201, approved.text
    written = approved.json()['written']
    assert (written['resolution'], written['resolved_by'], written['note'], written['applied']) == (
        'approved',
        'oncall-alice',
        'ok',
        True,
    )
    assert json.loads(written['args']) == {'amount': 100, 'reason': 'partial'}
    assert written['writer_id'].startswith('stepstream-serve@')
    assert approved.json()['effect']['status'] == 'resolved'

    second = await api.post(f'{url}/deny', json={'message': 'too much', 'operator': 'bob'})
    assert second.status_code == 409, second.text
    assert second.json()['decision'] == written and 'approved by oncall-alice' in second.json()['detail']
    assert (REFUNDS, 'call-refund') not in calls((await api.get('/api/deferred')).json())

    # The log keeps it: the projection the test's projector applies shows the same decision.
    await served.settle()
    effect = await ProjectionReader.of(served.projector).get_tool_effect(REFUNDS, 'call-refund')
    assert effect is not None and effect.resolution is not None
    assert (effect.resolution.resolution, effect.resolution.resolved_by) == ('approved', 'oncall-alice')


async def test_deny_and_complete(api: httpx.AsyncClient) -> None:
    base = f'/api/runs/{BILLING}/calls'
    denied = await api.post(f'{base}/call-refund/deny', json={'message': 'over the limit', 'operator': 'bob'})
    assert denied.status_code == 201 and denied.json()['written']['error'] == 'over the limit'
    answered = await api.post(f'{base}/call-ask/complete', json={'result': {'card': 'visa'}})
    assert answered.status_code == 201 and json.loads(answered.json()['written']['result']) == {
        'card': 'visa'
    }
    failed = await api.post(
        f'{base}/call-export/complete', json={'error': 'the job crashed', 'note': 'paged'}
    )
    assert failed.status_code == 201 and failed.json()['written']['resolution'] == 'failed'
    assert (await api.get('/api/deferred', params={'agent': 'billing'})).json()['calls'] == []
    run = (await api.get(f'/api/runs/{BILLING}')).json()
    assert run['status'] == 'waiting' and run['resumed_by'] is None  # decided, not resumed yet


async def test_a_resumed_run_and_the_run_it_resumes_link_to_each_other(
    served: Served, api: httpx.AsyncClient
) -> None:
    resumed_id = f'{BILLING}-resumed'
    await resume(served.log, ProjectionReader.of(served.projector), BILLING, resumed_id)
    await served.settle()
    waited = (await api.get(f'/api/runs/{BILLING}')).json()
    assert (waited['status'], waited['resumed_by'], waited['resumes']) == ('resumed', resumed_id, None)
    resumed = (await api.get(f'/api/runs/{resumed_id}')).json()
    assert (resumed['status'], resumed['resumes'], resumed['conversation_id']) == (
        'completed',
        BILLING,
        f'conv-{BILLING}',
    )
    page = (await api.get(f'/runs/{BILLING}')).text
    assert f'<dd class="resumed-by"><a class="run-link" href="/runs/{resumed_id}"' in page
    assert (
        f'<dd class="resumes"><a class="run-link" href="/runs/{BILLING}"'
        in (await api.get(f'/runs/{resumed_id}')).text
    )
    listed = (await api.get('/api/runs', params={'status': 'resumed'})).json()['runs']
    assert [r['run_id'] for r in listed] == [BILLING]
    assert (await api.get('/api/counts')).json()['by_status']['resumed'] == 1


async def test_unknown_calls_and_refused_decisions(served: Served, api: httpx.AsyncClient) -> None:
    assert (
        await api.post('/api/runs/no-such-run/calls/call-ask/complete', json={'result': 1})
    ).status_code == 404
    missing = await api.post(f'/api/runs/{REFUNDS}/calls/no-such-call/approve', json={})
    assert missing.status_code == 404 and 'no-such-call' in missing.json()['detail']
    base = f'/api/runs/{REFUNDS}/calls'
    for path, body in [
        ('call-export/approve', {}),
        ('call-ask/complete', {}),
        ('call-export/deny', {'message': 'no'}),
        ('call-ask/approve', {'args': {'x': 1}}),
    ]:
        answer = await api.post(f'{base}/{path}', json=body)
        assert answer.status_code == 422, (path, answer.text)
    lookup = await api.post(f'{base}/call-lookup/approve', json={})
    assert lookup.status_code == 409 and lookup.json()['decision'] is None
    in_doubt = (await api.get(f'/api/runs/{served.crashed_run}/tool-effects')).json()[0]['tool_call_id']
    crashed = await api.post(f'/api/runs/{served.crashed_run}/calls/{in_doubt}/approve', json={})
    assert crashed.status_code == 409 and 'started' in crashed.json()['detail']  # in doubt: resolve it
    assert (
        len((await api.get('/api/deferred', params={'conversation': f'conv-{REFUNDS}'})).json()['calls']) == 2
    )


async def test_a_token_guards_decisions(served: Served) -> None:
    run_id = 'token-waiting'
    await run_until_waiting(served.log, run_id)
    await served.settle()
    settings = served.settings.replace(serve_token='s3cret-token')
    reader = ProjectionReader.open(served.projector.db_path)
    bearer = {'Authorization': 'Bearer s3cret-token'}
    try:
        async with (
            running(app_for(settings, reader=reader), port=0) as server,
            httpx.AsyncClient(base_url=server.url, timeout=60) as client,
        ):
            assert (await client.get('/api/deferred')).status_code == 401
            url = f'/api/runs/{run_id}/calls/call-refund/approve'
            assert (await client.post(url, json={})).status_code == 401
            wrong = await client.post(url, json={}, headers={'Authorization': 'Bearer nope'})
            assert wrong.status_code == 401
            form = await client.post(f'/runs/{run_id}/calls/call-refund/decide', data={'decision': 'approve'})
            assert form.status_code == 303 and form.headers['location'].startswith('/login')
            assert (await client.get('/deferred')).status_code == 303
            listed = (await client.get('/api/deferred', params={'agent': 'refunds'}, headers=bearer)).json()
            assert (run_id, 'call-refund') in calls(listed)
            ok = await client.post(url, json={'note': 'with the token'}, headers=bearer)
            assert ok.status_code == 201 and ok.json()['written']['note'] == 'with the token'
    finally:
        reader.close()
