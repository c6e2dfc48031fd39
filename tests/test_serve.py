"""`stepstream serve`: the JSON API over a projection of real agent runs, its auth, and its schema."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from pydantic_ai.messages import ModelMessagesTypeAdapter

from stepstream import Settings
from stepstream.cli import main
from stepstream.embedded import EmbeddedStack
from stepstream.projector import rebuild
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import RUN_STATUSES
from stepstream.serve import app_for, running

from served import IMAGE, Served, served_projection

in_module_loop = pytest.mark.asyncio(loop_scope='module')
"""The tests share one served projection, so they run in the module's event loop."""


@pytest_asyncio.fixture(scope='module', loop_scope='module')
async def served(stack: EmbeddedStack, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    settings = stack.settings.replace(
        topic_prefix=f'test-{uuid.uuid4().hex[:12]}', partitions=3, media_threshold_bytes=2048
    )
    async with served_projection(settings, tmp_path_factory.mktemp('serve') / 'projection') as s:
        yield s


@pytest_asyncio.fixture(loop_scope='module')
async def api(served: Served) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
        yield client


@pytest.mark.broker
@in_module_loop
async def test_runs_filter_page_and_order(served: Served, api: httpx.AsyncClient) -> None:
    everything = (await api.get('/api/runs', params={'order': 'started', 'limit': 1000})).json()
    assert everything['next_after'] is None
    by_default = (await api.get('/api/runs', params={'limit': 1000})).json()['runs']
    assert [r['run_id'] for r in by_default] == [r['run_id'] for r in everything['runs']][
        ::-1
    ]  # as the explorer
    ids = [r['run_id'] for r in everything['runs']]
    assert {served.orchestrator_run, *served.delegate_runs, served.image_run, served.crashed_run} <= set(ids)
    # The order the fixture ran them in: the orchestrator (its delegates inside it), the viewer,
    # then the publisher.
    place = {run_id: at for at, run_id in enumerate(ids)}
    delegates = [place[d] for d in served.delegate_runs]
    assert place[served.orchestrator_run] < min(delegates)
    assert max(delegates) < place[served.image_run] < place[served.crashed_run]

    newest = (await api.get('/api/runs', params={'order': '-started', 'limit': 2})).json()
    assert [r['run_id'] for r in newest['runs']] == ids[::-1][:2]
    rest = await api.get(
        '/api/runs', params={'order': '-started', 'limit': 1000, 'after': newest['next_after']}
    )
    assert [r['run_id'] for r in newest['runs'] + rest.json()['runs']] == ids[::-1]

    conversation = (
        await api.get('/api/runs', params={'order': 'started', 'conversation_id': 'conv-serve'})
    ).json()['runs']
    assert [r['agent_name'] for r in conversation] == ['orchestrator', 'researcher', 'researcher']
    children = (
        await api.get('/api/runs', params={'order': 'started', 'parent_run_id': served.orchestrator_run})
    ).json()['runs']
    assert [r['run_id'] for r in children] == served.delegate_runs
    cancelled = (await api.get('/api/runs', params={'status': 'cancelled'})).json()['runs']
    assert [r['run_id'] for r in cancelled] == [served.crashed_run]
    viewer = (await api.get('/api/runs', params={'agent_name': 'viewer'})).json()['runs']
    assert [r['run_id'] for r in viewer] == [served.image_run]

    unknown_cursor = await api.get('/api/runs', params={'after': 'no-such-run'})
    assert unknown_cursor.status_code == 400 and 'no-such-run' in unknown_cursor.json()['detail']


@pytest.mark.broker
@in_module_loop
async def test_one_run_its_events_effects_and_lineage(served: Served, api: httpx.AsyncClient) -> None:
    run = (await api.get(f'/api/runs/{served.crashed_run}')).json()
    assert run['status'] == 'cancelled' and 'CancelledError' in run['error']
    events = (await api.get(f'/api/runs/{served.crashed_run}/events')).json()
    projected = await ProjectionReader.of(served.projector).list_events(served.crashed_run)
    assert [e['seq'] for e in events] == [e.seq for e in projected]  # every event, in the projection's order
    assert events[0]['kind'] == 'run_started' and 'tool_call_started' in [e['kind'] for e in events]
    [effect] = (await api.get(f'/api/runs/{served.crashed_run}/tool-effects')).json()
    assert effect['unknown_after_crash'] and effect['status'] == 'started'
    assert (effect['idempotency_key'], effect['effect_summary']) == ('announce:#releases', 'posts to Slack')

    page = (await api.get(f'/runs/{served.crashed_run}')).text
    assert f'stepstream replay {served.crashed_run} --agent MODULE:ATTR' in page  # how to replay it
    lineage = (await api.get(f'/api/runs/{served.delegate_runs[1]}/lineage')).json()
    assert lineage['root']['run_id'] == served.orchestrator_run
    assert [(n['depth'], n['run']['run_id']) for n in lineage['tree']] == [
        (0, served.orchestrator_run),
        *((1, d) for d in served.delegate_runs),
    ]
    for path in (
        '',
        '/events',
        '/tool-effects',
        '/snapshots',
        '/snapshots/latest',
        '/lineage',
        '/snapshots/0',
    ):
        missing = await api.get(f'/api/runs/no-such-run{path}')
        assert missing.status_code == 404, path
        assert 'no-such-run' in missing.json()['detail']


@pytest.mark.broker
@in_module_loop
async def test_snapshots_are_pydantic_ai_json_with_media_as_checked_links(
    served: Served, api: httpx.AsyncClient
) -> None:
    page = (await api.get(f'/api/runs/{served.orchestrator_run}/snapshots', params={'limit': 1})).json()
    assert [s['snapshot_seq'] for s in page['snapshots']] == [0] and page['next_after'] == 0
    rest = (await api.get(f'/api/runs/{served.orchestrator_run}/snapshots', params={'after': 0})).json()
    counts = [s['message_count'] for s in page['snapshots'] + rest['snapshots']]
    assert counts == sorted(counts) and len(counts) >= 3

    latest = (await api.get(f'/api/runs/{served.image_run}/snapshots/latest')).json()
    messages = ModelMessagesTypeAdapter.validate_python(latest['messages'])
    prompt = messages[0].parts[-1].content  # type: ignore[union-attr]
    assert prompt[0] == 'what is in this image?'
    image = prompt[1]
    assert image.kind == 'image-url' and image.media_type == 'image/png'
    sha = hashlib.sha256(IMAGE).hexdigest()
    assert image.url == f'/api/media/{sha}?media_type=image/png'
    fetched = await api.get(image.url)
    assert fetched.status_code == 200 and fetched.content == IMAGE
    assert (
        fetched.headers['content-type'] == 'image/png'
        and fetched.headers['x-content-type-options'] == 'nosniff'
    )

    # Anything but images, audio and video is a download, never a page of this origin.
    as_html = await api.get(f'/api/media/{sha}', params={'media_type': 'text/html'})
    assert as_html.headers['content-type'] == 'application/octet-stream'
    assert as_html.headers['content-disposition'].startswith('attachment')
    assert (await api.get(f'/api/media/{"0" * 64}')).status_code == 404
    assert (await api.get('/api/media/not-a-hash')).status_code == 422


@pytest.mark.broker
@in_module_loop
async def test_unresolved_conflicts_dlq_and_status(served: Served, api: httpx.AsyncClient) -> None:
    unresolved = (await api.get('/api/unresolved')).json()
    assert [(e['run_id'], e['tool_name']) for e in unresolved] == [(served.crashed_run, 'send_announcement')]
    assert (await api.get('/api/conflicts')).json() == []

    dlq = (await api.get('/api/dlq')).json()
    assert dlq['error'] is None and dlq['total'] == 1
    [letter] = dlq['entries']
    assert (letter['reason'], letter['key'], letter['source_topic']) == (
        'not_a_record',
        'poison-run',
        served.settings.topics.step_events_topic,
    )

    await served.settle()
    status = (await api.get('/api/status')).json()
    assert status['state'] == 'live' and status['broker_error'] is None
    assert status['dead_lettered_by_reason'] == {'not_a_record': 1}
    topics = {(p['topic'], p['partition']) for p in status['partitions']}
    assert topics == {
        (t, p)
        for t in (served.settings.topics.step_events_topic, served.settings.topics.tool_effects_topic)
        for p in range(3)
    }
    assert all(p['lag'] == 0 and p['end'] == p['applied'] for p in status['partitions'])
    assert status['total_lag'] == 0 and status['shards'] == [0, 1, 2] and status['missing_shards'] == []
    runs = (await api.get('/api/runs', params={'limit': 1000})).json()['runs']
    by_status = {s: sum(r['status'] == s for r in runs) for s in RUN_STATUSES}
    assert status['runs']['by_status'] == by_status and status['runs']['unresolved_effects'] == 1
    assert (await api.get('/api/counts')).json() == status['runs']  # a single service: its own counts


@pytest.mark.broker
@in_module_loop
@pytest.mark.filterwarnings('ignore::hypothesis.errors.HypothesisDeprecationWarning')
async def test_every_response_matches_the_openapi_schema(served: Served, api: httpx.AsyncClient) -> None:
    """Schemathesis generates requests from the schema and checks every answer against it."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    # A page's `after` is any text to the schema; one that names no place in its list is a 400
    # (`BadCursor`, documented on those operations), so a schema-valid request may get one.
    accepted = ['2xx', '3xx', '400', '401', '403', '404', '409', '429', '5xx']
    config = schemathesis.Config.from_dict(
        {'checks': {'positive_data_acceptance': {'expected-statuses': accepted}}}
    )
    schema = schemathesis.openapi.from_dict((await api.get('/openapi.json')).json(), config=config)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        '/api/runs',
        '/api/runs/{run_id}/snapshots/{snapshot_seq}',
        '/api/media/{sha256}',
        '/api/status',
        '/api/dlq',
    }

    def check_all() -> list[str]:
        failures = []
        for operation in operations:
            if operation.path in ('/api/dlq', '/api/status'):
                continue  # each call asks the broker: checked once above, not fuzzed

            @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(case=operation.as_strategy())
            def check(case: schemathesis.Case) -> None:
                case.call_and_validate(base_url=served.url)

            try:
                check()
            except Exception as exc:  # every operation's failure, then fail once
                failures.append(f'{operation.method.upper()} {operation.path}: {exc}')
        return failures

    failures = await asyncio.to_thread(check_all)  # the server answers from this test's event loop
    assert not failures, '\n\n'.join(failures)


@pytest.mark.broker
@in_module_loop
async def test_a_token_guards_the_api_and_the_explorer(served: Served, tmp_path: Path) -> None:
    settings = served.settings.replace(serve_token='s3cret-token')
    assert 's3cret-token' not in repr(settings)
    reader = ProjectionReader.open(served.projector.db_path)
    try:
        async with (
            running(app_for(settings, reader=reader), port=0) as server,
            httpx.AsyncClient(base_url=server.url) as client,
        ):
            refused = await client.get('/api/runs')
            assert refused.status_code == 401 and refused.headers['www-authenticate'] == 'Bearer'
            assert (await client.get('/openapi.json')).status_code == 401
            wrong = await client.get('/api/runs', headers={'Authorization': 'Bearer nope'})
            assert wrong.status_code == 401
            ok = await client.get('/api/runs', headers={'Authorization': 'Bearer s3cret-token'})
            assert ok.status_code == 200 and ok.json()['runs']
            page = await client.get('/unresolved')
            assert page.status_code == 303 and page.headers['location'] == '/login?next=/unresolved'
            failed = await client.post('/login', data={'token': 'nope', 'next': '/unresolved'})
            assert failed.status_code == 401 and 'not the token' in failed.text
            signed = await client.post(
                '/login', data={'token': 's3cret-token', 'next': '//elsewhere.example'}
            )
            assert signed.status_code == 303 and signed.headers['location'] == '/'
            assert 'send_announcement' in (await client.get('/unresolved')).text  # the cookie
    finally:
        reader.close()


@pytest.mark.fast
def test_serving_beyond_loopback_needs_a_token(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv('STEPSTREAM_SERVE_TOKEN', raising=False)
    assert main(['serve', '--host', '0.0.0.0']) == 2
    assert 'STEPSTREAM_SERVE_TOKEN' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(['serve', '--serve-token', 'x'])  # a secret is never a flag
    assert Settings.from_env({'STEPSTREAM_SERVE_TOKEN': 't'}).serve.serve_token is not None


@pytest.mark.broker
@in_module_loop
async def test_the_serve_command_serves_a_projection_directory(served: Served) -> None:
    env = {**os.environ, **served.settings.to_env(), 'STEPSTREAM_DB_PATH': str(served.projector.db_path)}
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        '-m',
        'stepstream.cli',
        'serve',
        '--port',
        '0',
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        line = (await asyncio.wait_for(child.stdout.readline(), 60)).decode()
        url = re.search(r'explorer at (http://127\.0\.0\.1:\d+)/', line)
        assert url is not None, line
        async with httpx.AsyncClient(base_url=url.group(1)) as client:
            run = (await client.get(f'/api/runs/{served.crashed_run}')).json()
            assert run['status'] == 'cancelled'
            assert 'publisher-crash' in (await client.get('/unresolved')).text
        child.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(child.wait(), 30) == 0
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


@pytest.mark.broker
@in_module_loop
async def test_resolving_an_unknown_effect_is_an_audited_write(
    served: Served, api: httpx.AsyncClient, tmp_path: Path
) -> None:
    run_id = await served.add_crashed_run('publisher-resolve-api')
    [effect] = (await api.get(f'/api/runs/{run_id}/tool-effects')).json()
    assert effect['unknown_after_crash'] and effect['resolutions'] == []
    url = f'/api/runs/{run_id}/tool-effects/{effect["tool_call_id"]}/resolution'
    form = f'/runs/{run_id}/effects/{effect["tool_call_id"]}/resolve'
    for elsewhere in ({'Sec-Fetch-Site': 'cross-site'}, {'Origin': 'http://evil.example'}):
        forged = await api.post(form, data={'resolution': 'happened', 'note': 'x'}, headers=elsewhere)
        assert forged.status_code == 403  # another site's page cannot make a browser resolve
    assert (await api.get(f'/api/runs/{run_id}/tool-effects')).json()[0]['unknown_after_crash']

    answer = await api.post(
        url, json={'resolution': 'happened', 'note': 'the post is in #releases', 'operator': 'bob'}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body['applied'] and body['written']['applied']
    assert (body['written']['resolved_by'], body['written']['note']) == ('bob', 'the post is in #releases')
    assert body['written']['writer_id'].startswith('stepstream-serve@')
    assert body['written']['resolves_seq'] < effect['last_seq']  # the `started`, not the annotation after it
    resolved = (await api.get(f'/api/runs/{run_id}/tool-effects')).json()[0]
    assert (resolved['status'], resolved['unknown_after_crash']) == ('resolved', False)
    assert resolved['resolution']['resolution'] == 'happened'
    assert run_id not in {e['run_id'] for e in (await api.get('/api/unresolved')).json()}
    assert served.crashed_run in {e['run_id'] for e in (await api.get('/api/unresolved')).json()}

    again = await api.post(url, json={'resolution': 'did_not_happen', 'note': 'second thoughts'})
    assert again.status_code == 409 and 'resolved, not unknown_after_crash' in again.json()['detail']
    missing = await api.post(f'/api/runs/{run_id}/tool-effects/no-such-call/resolution', json=body['written'])
    assert missing.status_code == 404 and 'no-such-call' in missing.json()['detail']
    blank = await api.post(url, json={'resolution': 'happened'})
    assert blank.status_code == 422

    # The log keeps the record: a rebuild from offset zero shows the same resolution and history.
    await served.settle()
    live = await ProjectionReader.of(served.projector).get_tool_effect(run_id, effect['tool_call_id'])
    await rebuild(served.settings, tmp_path / 'rebuilt')
    rebuilt_reader = ProjectionReader.open(tmp_path / 'rebuilt')
    try:
        rebuilt = await rebuilt_reader.get_tool_effect(run_id, effect['tool_call_id'])
    finally:
        rebuilt_reader.close()
    assert live is not None and live.resolution is not None and live.resolution.resolved_by == 'bob'
    assert rebuilt == live and len(live.resolutions) == 1


@pytest.mark.broker
@in_module_loop
async def test_a_token_guards_resolutions(served: Served) -> None:
    run_id = await served.add_crashed_run('publisher-resolve-token')
    settings = served.settings.replace(serve_token='s3cret-token')
    reader = ProjectionReader.open(served.projector.db_path)
    try:
        async with (
            running(app_for(settings, reader=reader), port=0) as server,
            httpx.AsyncClient(base_url=server.url) as client,
        ):
            [effect] = (
                await client.get(
                    f'/api/runs/{run_id}/tool-effects', headers={'Authorization': 'Bearer s3cret-token'}
                )
            ).json()
            url = f'/api/runs/{run_id}/tool-effects/{effect["tool_call_id"]}/resolution'
            body = {'resolution': 'did_not_happen', 'note': 'nothing in #releases'}
            refused = await client.post(url, json=body)
            assert refused.status_code == 401
            form = await client.post(
                f'/runs/{run_id}/effects/{effect["tool_call_id"]}/resolve',
                data={'resolution': 'happened', 'note': 'x'},
            )
            assert form.status_code == 303 and form.headers['location'].startswith('/login')
            assert (await reader.get_tool_effect(run_id, effect['tool_call_id'])).unknown_after_crash  # type: ignore[union-attr]
            ok = await client.post(url, json=body, headers={'Authorization': 'Bearer s3cret-token'})
            assert ok.status_code == 200 and ok.json()['effect']['status'] == 'resolved'
    finally:
        reader.close()


@pytest.mark.broker
@in_module_loop
async def test_the_resolve_command(served: Served) -> None:
    run_id = await served.add_crashed_run('publisher-resolve-cli')
    call = (await ProjectionReader.of(served.projector).list_tool_effects(run_id))[0].tool_call_id
    env = {
        **os.environ,
        **served.settings.to_env(),
        'STEPSTREAM_DB_PATH': str(served.projector.db_path),
        'STEPSTREAM_OPERATOR': 'carol',
    }

    async def resolve(*args: str) -> tuple[int, str, str]:
        child = await asyncio.create_subprocess_exec(
            sys.executable, '-m', 'stepstream.cli', 'resolve', *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(child.communicate(), 120)
        assert child.returncode is not None
        return child.returncode, out.decode(), err.decode()

    assert (await resolve(run_id, call, '--happened'))[0] == 2  # no note: a usage error
    assert (await resolve(run_id, call, '--happened', '--did-not-happen', '--note', 'x'))[0] == 2
    code, _, err = await resolve('no-such-run', call, '--happened', '--note', 'x')
    assert code == 1 and "no run 'no-such-run'" in err
    code, _, err = await resolve(run_id, 'no-such-call', '--happened', '--note', 'x')
    assert code == 1 and "no tool call 'no-such-call'" in err
    code, out, _ = await resolve(run_id, call, '--did-not-happen', '--note', 'no post in #releases')
    assert code == 0 and 'as did_not_happen by carol' in out, out

    effect = await served.read_until(  # written by the CLI's own producer: wait until it is applied
        lambda reader: reader.get_tool_effect(run_id, call),
        lambda e: e is not None and e.status == 'resolved',
    )
    assert effect is not None and effect.resolution is not None
    assert (effect.resolution.resolved_by, effect.resolution.note) == ('carol', 'no post in #releases')
    assert effect.resolution.writer_id.startswith('stepstream-cli@')
    code, _, err = await resolve(run_id, call, '--happened', '--note', 'again')
    assert code == 1 and 'is resolved, not unknown_after_crash' in err


@pytest.mark.broker
@in_module_loop
async def test_a_problem_never_names_a_place_on_the_server(
    served: Served, api: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A run the projection does not hold: the page, the problem and the console's say so without
    the projection's directory, which the service logs instead."""
    where = str(served.projector.db_path)
    with caplog.at_level('WARNING', logger='stepstream.serve'):
        page = await api.get('/runs/no-such-run')
        problem = await api.get('/api/runs/no-such-run/events')
        console = await api.get('/api/console/tree/no-such-run')
    said = [page.text, problem.json()['detail'], console.json()['detail']]
    assert [a.status_code for a in (page, problem, console)] == [404, 404, 404]
    for text in said:
        assert 'no-such-run' in text and 'in the projection at [the projection directory]' in text
        assert where not in text and '/tmp/' not in text
    assert any(where in r.getMessage() for r in caplog.records)  # the operator still learns where
