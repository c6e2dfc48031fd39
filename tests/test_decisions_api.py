"""Decisions on deferred calls over HTTP, in process: `/api/deferred` and approve, deny, complete.

The in-memory log and projection (applied every few milliseconds, as a projector would, or not
at all, for the 202 of a decision written but not shown yet) under the service's app; the same
routes run on Tansu in tests/test_serve_decisions.py, the pages in Chromium in
tests/test_explorer.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from stepstream.producer import InMemoryLog
from stepstream.serve import Source, create_app

from deferred_runs import EXPORT_METADATA, REFUND_ARGS, run_until_waiting
from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast

FIRST, SECOND = 'waits-a', 'waits-b'


@pytest_asyncio.fixture
async def api() -> AsyncIterator[httpx.AsyncClient]:
    log = InMemoryLog()
    projection = MemoryProjection(log)
    await run_until_waiting(log, FIRST)
    await run_until_waiting(log, SECOND, agent_name='billing')
    await projection.wait_for()

    async def apply() -> None:
        while True:
            await projection.wait_for()
            await asyncio.sleep(0.01)

    applying = asyncio.create_task(apply())
    settings = log.settings.replace(operator='oncall-alice')
    source = Source(settings, projection.reader(), None, log=log)
    transport = httpx.ASGITransport(app=create_app(source))
    try:
        async with httpx.AsyncClient(transport=transport, base_url='http://stepstream.test') as client:
            yield client
    finally:
        applying.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await applying
        assert projection.dead == []


async def test_a_decision_written_but_not_yet_applied_answers_202_and_stands_once_applied() -> None:
    log = InMemoryLog()
    projection = MemoryProjection(log)
    await run_until_waiting(log, 'waits-c')
    await projection.wait_for()
    # Nothing applies the log while the service waits (a projector stopped): it waits its timeout,
    # then answers that it wrote the decision, which the projection does not show yet.
    settings = log.settings.replace(operator='oncall-alice', ack_timeout_s=0.2)
    source = Source(settings, projection.reader(), None, log=log)
    transport = httpx.ASGITransport(app=create_app(source))
    async with httpx.AsyncClient(transport=transport, base_url='http://stepstream.test') as client:
        written = len(log.records)
        answer = await client.post('/api/runs/waits-c/calls/call-refund/approve', json={'note': 'ok'})
        assert answer.status_code == 202, answer.text
        body = answer.json()
        assert body['applied'] is False and body['written']['applied'] is False
        assert (body['written']['resolution'], body['written']['resolved_by'], body['written']['note']) == (
            'approved',
            'oncall-alice',
            'ok',
        )
        assert body['effect']['status'] == 'deferred'  # as the projection still shows it
        assert len(log.records) == written + 1  # but it is on the log
        page = await client.post(
            '/runs/waits-c/calls/call-ask/decide',
            data={'decision': 'complete', 'outcome': 'text', 'value': 'v'},
        )
        assert page.status_code == 200 and 'does not show it yet' in page.text

        await projection.wait_for()  # the projector catches up: the decision stands
        effects = {e['tool_call_id']: e for e in (await client.get('/api/runs/waits-c/tool-effects')).json()}
        assert effects['call-refund']['status'] == 'resolved'
        assert effects['call-refund']['resolution'] == {**body['written'], 'applied': True}
        assert effects['call-ask']['resolution']['result'] == '"v"'
    assert projection.dead == []


def calls(page: dict) -> list[tuple[str, str]]:
    return [(c['run_id'], c['tool_call_id']) for c in page['calls']]


async def test_what_waits_is_listed_filtered_and_paged(api: httpx.AsyncClient) -> None:
    page = (await api.get('/api/deferred')).json()
    assert page['next_after'] is None and len(page['calls']) == 6
    refund = next(c for c in page['calls'] if (c['run_id'], c['tool_name']) == (FIRST, 'refund'))
    assert (refund['kind'], refund['agent_name'], refund['conversation_id']) == (
        'approval',
        'refunds',
        f'conv-{FIRST}',
    )
    assert json.loads(refund['args']) == REFUND_ARGS and refund['deferral_metadata'] is None
    assert refund['waited_s'] >= 0 and refund['effect']['status'] == 'deferred'
    assert refund['waiting_since'] == refund['effect']['ended_at']
    export = next(c for c in page['calls'] if (c['run_id'], c['tool_name']) == (FIRST, 'export'))
    assert json.loads(export['deferral_metadata']) == EXPORT_METADATA and export['kind'] == 'external'

    everything = calls(page)
    newest = (await api.get('/api/deferred', params={'newest': 'true'})).json()
    assert calls(newest) == everything[::-1]
    first = (await api.get('/api/deferred', params={'limit': 4})).json()
    rest = (await api.get('/api/deferred', params={'limit': 4, 'after': first['next_after']})).json()
    assert calls(first) + calls(rest) == everything and rest['next_after'] is None

    approvals = (await api.get('/api/deferred', params={'kind': 'approval'})).json()
    assert calls(approvals) == [(FIRST, 'call-refund'), (SECOND, 'call-refund')]
    billing = (await api.get('/api/deferred', params={'agent': 'billing', 'kind': 'question'})).json()
    assert calls(billing) == [(SECOND, 'call-ask')]
    conversation = (await api.get('/api/deferred', params={'conversation': f'conv-{FIRST}'})).json()
    assert {run for run, _ in calls(conversation)} == {FIRST}

    bad = await api.get('/api/deferred', params={'after': 'not-a-cursor'})
    assert bad.status_code == 400 and 'not a place in the list of waiting calls' in bad.json()['detail']
    for bad in ({'kind': 'nothing'}, {'limit': 0}, {'limit': 1001}):
        assert (await api.get('/api/deferred', params=bad)).status_code == 422, bad


async def test_an_approval_with_changed_arguments_stands_and_a_second_decision_is_refused(
    api: httpx.AsyncClient,
) -> None:
    url = f'/api/runs/{FIRST}/calls/call-refund'
    approved = await api.post(f'{url}/approve', json={'args': {'amount': 100}, 'note': 'partial refund'})
    assert approved.status_code == 201, approved.text
    body = approved.json()
    assert body['applied'] and body['written']['applied']
    written = body['written']
    assert (written['resolution'], written['resolved_by'], written['note']) == (
        'approved',
        'oncall-alice',
        'partial refund',
    )
    assert json.loads(written['args']) == {'amount': 100}
    assert written['writer_id'].startswith('stepstream-serve@')
    assert body['effect']['status'] == 'resolved' and body['effect']['resolution'] == written

    second = await api.post(f'{url}/deny', json={'message': 'no', 'operator': 'bob'})
    assert second.status_code == 409, second.text
    conflict = second.json()
    assert (
        conflict['decision'] == written and 'decided already (approved by oncall-alice)' in conflict['detail']
    )
    listed = calls((await api.get('/api/deferred')).json())
    assert (FIRST, 'call-refund') not in listed and (SECOND, 'call-refund') in listed
    effect = next(
        e
        for e in (await api.get(f'/api/runs/{FIRST}/tool-effects')).json()
        if e['tool_call_id'] == 'call-refund'
    )
    assert [r['resolution'] for r in effect['resolutions']] == [
        'approved'
    ]  # the refused one was never written


async def test_deny_and_complete_with_a_result_or_an_error(api: httpx.AsyncClient) -> None:
    base = f'/api/runs/{SECOND}/calls'
    denied = await api.post(f'{base}/call-refund/deny', json={'message': 'over the limit', 'operator': 'bob'})
    assert denied.status_code == 201, denied.text
    assert (denied.json()['written']['error'], denied.json()['written']['resolved_by']) == (
        'over the limit',
        'bob',
    )
    answered = await api.post(f'{base}/call-ask/complete', json={'result': 'the visa card', 'note': 'asked'})
    assert answered.status_code == 201 and json.loads(answered.json()['written']['result']) == 'the visa card'
    failed = await api.post(f'{base}/call-export/complete', json={'error': 'the job crashed'})
    assert failed.status_code == 201 and failed.json()['written']['resolution'] == 'failed'
    assert (await api.get('/api/deferred', params={'agent': 'billing'})).json()['calls'] == []
    again = await api.post(f'{base}/call-export/complete', json={'result': None})  # null is a result
    assert again.status_code == 409 and again.json()['decision']['resolution'] == 'failed'


async def test_unknown_refused_and_not_waiting(api: httpx.AsyncClient) -> None:
    base = f'/api/runs/{FIRST}/calls'
    assert (await api.post('/api/runs/no-such-run/calls/call-refund/approve', json={})).status_code == 404
    missing = await api.post(f'{base}/no-such-call/approve', json={})
    assert missing.status_code == 404 and 'no-such-call' in missing.json()['detail']
    lookup = await api.post(f'{base}/call-lookup/approve', json={})
    assert (
        lookup.status_code == 409
        and lookup.json()['decision'] is None
        and 'completed' in lookup.json()['detail']
    )
    for path, body in [
        ('call-export/approve', {}),  # an outside call is not approved
        ('call-export/deny', {'message': 'no'}),  # nor denied
        ('call-refund/complete', {'result': 1}),  # an approval is not completed
        ('call-ask/complete', {}),  # neither a result nor an error
        ('call-ask/complete', {'result': 1, 'error': 'x'}),
        ('call-refund/deny', {}),  # a denial says why
        ('call-refund/approve', {'args': [1, 2]}),  # arguments are an object
        ('call-refund/approve', {'note': ''}),
    ]:
        answer = await api.post(f'{base}/{path}', json=body)
        assert answer.status_code == 422, (path, body, answer.text)
    assert (
        len((await api.get('/api/deferred', params={'conversation': f'conv-{FIRST}'})).json()['calls']) == 3
    )


# -- the explorer's pages ------------------------------------------------------------------------


async def test_the_waiting_page_lists_and_a_form_decides(api: httpx.AsyncClient) -> None:
    from test_waiting_surfaces import parse

    runs = parse((await api.get('/')).text)
    assert (
        '/deferred?kind=approval' in runs.one('counts').links
        and 'waiting for approval' in runs.one('counts').text
    )
    page = parse((await api.get('/deferred', params={'kind': 'approval'})).text)
    rows = page.find('waiting-row')
    assert [(r.attrs['data-run-id'], r.attrs['data-tool-call-id']) for r in rows] == [
        (FIRST, 'call-refund'),
        (SECOND, 'call-refund'),
    ]
    assert json.loads(rows[0].one('waiting-args').text) == REFUND_ARGS
    assert '<b>charged twice</b>' not in page.html and '&lt;b&gt;charged twice' in page.html
    assert (
        len(rows[0].find('approve')) == 1
        and len(rows[0].find('deny')) == 1
        and rows[0].find('complete') == []
    )
    everything = parse((await api.get('/deferred')).text)
    export = next(r for r in everything.find('waiting-row') if r.attrs['data-kind'] == 'external')
    assert (
        json.loads(export.one('waiting-metadata').text) == EXPORT_METADATA
        and len(export.find('complete')) == 1
    )

    run_page = parse((await api.get(f'/runs/{FIRST}')).text)
    assert {e.attrs['data-tool-call-id'] for e in run_page.find('decide-forms')} == {
        'call-refund',
        'call-ask',
        'call-export',
    }
    form = f'/runs/{FIRST}/calls/call-refund/decide'
    forged = await api.post(
        form, data={'decision': 'deny', 'message': 'x'}, headers={'Sec-Fetch-Site': 'cross-site'}
    )
    assert forged.status_code == 403
    bad = await api.post(form, data={'decision': 'approve', 'args': '[1'})
    assert bad.status_code == 422 and 'not JSON' in bad.text
    done = await api.post(
        form, data={'decision': 'approve', 'args': '{"amount": 1, "reason": "<i>x</i>"}', 'note': ''}
    )
    assert done.status_code == 200, done.text
    recorded = parse(done.text).one('decision-recorded')
    assert 'approved' in recorded.text and 'oncall-alice' in recorded.text and '<i>x</i>' not in done.text
    # No name in the form: the service's operator is recorded, and the page says so.
    by = parse(done.text).one('decided-by')
    assert by.one('recorded-by').text == 'oncall-alice' and 'no name was given' in by.text
    again = await api.post(form, data={'decision': 'deny', 'message': 'no'})
    assert again.status_code == 409 and 'approved' in parse(again.text).one('decision-standing').text
    after = parse((await api.get('/deferred', params={'kind': 'approval'})).text)
    assert [r.attrs['data-run-id'] for r in after.find('waiting-row')] == [SECOND]
    # Each form takes the name of who decides (the token names nobody); empty, the service's operator.
    inputs = [
        i for form in run_page.find('decide') for i in form.tags('input') if i.attrs.get('name') == 'by'
    ]
    assert len(inputs) == 4 and {i.attrs['placeholder'] for i in inputs} == {'oncall-alice'}
    ask = f'/runs/{FIRST}/calls/call-ask/decide'
    too_long = await api.post(
        ask, data={'decision': 'complete', 'outcome': 'text', 'value': 'v', 'by': 'x' * 201}
    )
    assert too_long.status_code == 422 and 'at most 200 characters' in too_long.text
    answered = await api.post(
        ask, data={'decision': 'complete', 'outcome': 'text', 'value': 'visa', 'by': ' dana '}
    )
    assert answered.status_code == 200 and '"visa"' in parse(answered.text).one('decision-recorded').text
    named = parse(answered.text).one('decided-by')
    assert named.one('recorded-by').text == 'dana' and 'no name was given' not in named.text
    effect = (await api.get(f'/api/runs/{FIRST}/tool-effects')).json()
    assert next(e for e in effect if e['tool_call_id'] == 'call-ask')['resolution']['resolved_by'] == 'dana'
