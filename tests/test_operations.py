"""Running stepstream like a service: `/metrics`, `/healthz` and `/readyz` of the projector and `serve`.

Each test drives the real thing over HTTP (a `stepstream projector --metrics-port` process, an
in-process member behind its `ProbeServer`, `serve` on uvicorn), parses every scrape with the
Prometheus text parser, and checks each figure against what the test did: records written, a
dead letter sent, a run left in doubt by a SIGKILLed writer, a member held back from its shards
and from applying.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families
from pydantic_ai import Agent

from stepstream import Settings
from stepstream.metrics import CATALOGUE, ProbeServer
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import GroupMember, Projector, ProjectorObserver
from stepstream.readmodel import ProjectionReader
from stepstream.serve import app_for, running
from stepstream.storage import Checkpoints
from stepstream.topics import ensure_topics, log_end_offsets

from agents import answers
from deferred_runs import run_until_waiting
from processes import free_port
from waits import until

pytestmark = pytest.mark.broker

CRASH_CHILD = Path(__file__).with_name('crash_child.py')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(client: httpx.AsyncClient, url: str) -> Samples:
    """Every sample of `url`'s /metrics, by name and labels, through the Prometheus text parser."""
    response = await client.get(f'{url}/metrics')
    assert response.status_code == 200, response.text
    assert response.headers['content-type'].startswith('text/plain')
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample `name` with exactly `labels`, or None."""
    return samples.get((name, frozenset(labels.items())))


def total(samples: Samples, name: str) -> float:
    """The sum of every sample named `name` (over its labels)."""
    return sum(v for (n, _), v in samples.items() if n == name)


def assert_declared(samples: Samples, source: str) -> None:
    """Every stepstream sample is one the catalogue declares (the alerts and dashboard rely on it)."""
    shown = {name for name, _ in samples if name.startswith('stepstream_')}
    declared = {s for m in CATALOGUE.values() if m.source == source for s in m.samples}
    assert shown <= declared, shown - declared


async def run_agents(log: EventLog, count: int, prefix: str) -> None:
    """`count` completed runs of a real agent with the capability."""
    for n in range(count):
        agent = Agent(answers('done'), capabilities=[StepPersistence(log=log, run_id=f'{prefix}-{n}')])
        await agent.run('go')


async def send_garbage(settings: Settings) -> None:
    """A record without a key on the step events topic: the projector dead-letters it (`no_key`)."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await producer.start()
    try:
        await producer.send_and_wait(settings.topics.step_events_topic, b'not a record', partition=0)
    finally:
        await producer.stop()


async def crash_a_writer(settings: Settings, run_id: str, client: httpx.AsyncClient, url: str) -> None:
    """A writer SIGKILLed in the middle of a tool call: once applied, its call is unresolved."""
    env = {**os.environ, **settings.to_env(), 'PYTHONPATH': str(CRASH_CHILD.parent)}
    child = await asyncio.create_subprocess_exec(sys.executable, str(CRASH_CHILD), run_id, env=env)
    try:

        async def started() -> bool:
            assert child.returncode is None, 'the writer exited before its tool call'
            return total(await scrape(client, url), 'stepstream_effects_unresolved') >= 1

        await until(started, 'the tool call in flight to be applied', timeout=90, every=0.2)
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGKILL)
        await child.wait()


@asynccontextmanager
async def projector_process(settings: Settings, db_path: Path, *args: str) -> AsyncIterator[str]:
    """`stepstream projector --metrics-port` as a process of its own; yields its metrics URL."""
    port = free_port()
    env = {**os.environ, **settings.replace(db_path=str(db_path)).to_env()}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        '-m',
        'stepstream.cli',
        'projector',
        '--metrics-port',
        str(port),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    lines: list[str] = []

    async def read() -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            lines.append(raw.decode(errors='replace').rstrip())

    reader = asyncio.create_task(read())
    try:
        await until(
            lambda: any(f':{port}/metrics' in line for line in lines) or process.returncode is not None,
            'the projector to serve its metrics',
            timeout=120,
        )
        assert process.returncode is None, '\n'.join(lines)
        yield f'http://127.0.0.1:{port}'
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 60)
        await reader
        assert code == 0, '\n'.join(lines[-30:])


@pytest.mark.timeout(300)
async def test_a_projector_process_counts_what_the_log_holds(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    settings = settings.replace(stale_after_s=2.0)
    await ensure_topics(settings)
    async with (
        projector_process(settings, tmp_path / 'projection', '--max-lag', '100') as url,
        httpx.AsyncClient(timeout=30) as client,
    ):
        health = await client.get(f'{url}/healthz')
        assert (health.status_code, health.json()['ok']) == (200, True)
        await until(
            lambda: client.get(f'{url}/readyz'),
            'the projector to be ready',
            holds=lambda r: r.status_code == 200,
        )

        await run_agents(event_log, 5, 'ops')
        await run_until_waiting(event_log, 'ops-waiting')  # three calls deferred: none in doubt
        await send_garbage(settings)
        await crash_a_writer(settings, 'ops-crashed', client, url)
        applied = {(settings.topics.step_events_topic, p): 0 for p in range(settings.topics.partitions)} | {
            (settings.topics.tool_effects_topic, p): 0 for p in range(settings.topics.partitions)
        }
        written = sum((await log_end_offsets(settings.kafka, applied)).values())
        seen: list[float] = []

        async def settled() -> Samples:
            nonlocal written
            samples = await scrape(client, url)
            done = total(samples, 'stepstream_projector_records_applied_total') + total(
                samples, 'stepstream_projector_dead_letters_total'
            )
            in_doubt = value(samples, 'stepstream_effects_unresolved', state='unknown_after_crash')
            seen[:] = [done, written, in_doubt]
            if done > written:  # the ends were read short (Tansu's ListOffsets, on a loaded machine)
                written = sum((await log_end_offsets(settings.kafka, applied)).values())
            return samples if done == written and in_doubt == 1 else {}

        samples = await until(
            settled,
            'every record applied and the crashed call in doubt',
            timeout=90,
            describe=lambda: 'applied and dead-lettered {}, written {}, in doubt {}'.format(*seen),
        )

    # Every record the log holds was applied once, but the one without a key, which went to the DLQ.
    assert value(samples, 'stepstream_projector_records_applied_total') == written - 1
    assert value(samples, 'stepstream_projector_dead_letters_total', reason='no_key') == 1
    assert value(samples, 'stepstream_projector_duplicates_ignored_total') == 0
    assert total(samples, 'stepstream_projector_lag_records') == 0
    assert total(samples, 'stepstream_projector_lag_seconds') == 0
    assert value(samples, 'stepstream_projector_batch_apply_seconds_count') >= 1
    assert value(samples, 'stepstream_projector_freshness_seconds_count') >= 1
    # Five runs completed and one waits on its deferred calls; the killed writer's run went stale,
    # its tool call the one in doubt (the deferred calls are in neither state).
    assert value(samples, 'stepstream_runs', status='completed') == 5
    assert value(samples, 'stepstream_runs', status='waiting') == 1
    assert value(samples, 'stepstream_runs', status='stale') == 1
    assert value(samples, 'stepstream_runs', status='running') == 0
    assert value(samples, 'stepstream_effects_unresolved', state='in_flight') == 0
    assert value(samples, 'stepstream_effects_in_doubt_oldest_age_seconds') > 0
    # The waiting run's three deferred calls, one of each kind, wait since it ended.
    for kind in ('approval', 'question', 'external'):
        assert value(samples, 'stepstream_deferred_calls', kind=kind) == 1, kind
    assert value(samples, 'stepstream_deferred_oldest_age_seconds') > 0
    # Alone, the projector was given every partition and holds each shard.
    assert value(samples, 'stepstream_projector_partitions') == settings.topics.partitions
    assert value(samples, 'stepstream_projector_partitions_assigned') == settings.topics.partitions
    assert value(samples, 'stepstream_projector_shards_owned') == settings.topics.partitions
    assert value(samples, 'stepstream_projector_shards_missing') == 0
    assert value(samples, 'stepstream_projector_ready') == 1
    assert value(samples, 'stepstream_projector_parked_records') == 0
    assert 'process_cpu_seconds_total' in {name for name, _ in samples}
    assert_declared(samples, 'projector')


@pytest.mark.timeout(180)
async def test_a_member_is_ready_once_it_holds_its_shards_and_while_it_keeps_up(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    await ensure_topics(settings)
    group = f'{settings.topics.topic_prefix}-ops'
    checkpoints = Checkpoints.from_settings(settings, group=group, interval_s=0.2)
    member = Projector(
        settings,
        db_path=tmp_path / 'projection',
        member=GroupMember(group=group, session_timeout_ms=6000, checkpoints=checkpoints),
    )
    await run_agents(event_log, 1, 'before')
    async with HeldLock(member) as lock:
        await member.start()
        observer = ProjectorObserver(member, ProjectionReader.of(member), max_lag=5)
        server = ProbeServer(observer.registry, observer, asyncio.get_running_loop()).start()
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                # The group's assignment waits on the shards' lock: no shards, not ready.
                response = await client.get(f'{server.url}/readyz')
                assert response.status_code == 503, response.text
                assert 'not in the group' in response.json()['error']
                samples = await scrape(client, server.url)
                assert value(samples, 'stepstream_projector_ready') == 0
                assert value(samples, 'stepstream_projector_shards_owned') == 0
                lock.release()

                ready = await until(
                    lambda: client.get(f'{server.url}/readyz'),
                    'the member to hold its shards',
                    holds=lambda r: r.status_code == 200,
                )
                assert ready.json()['owned'] == list(range(settings.topics.partitions))
                samples = await scrape(client, server.url)
                assert value(samples, 'stepstream_projector_shards_owned') == settings.topics.partitions
                assert value(samples, 'stepstream_projector_ready') == 1
                uploaded = await until(
                    lambda: scrape(client, server.url),
                    'a checkpoint uploaded',
                    holds=lambda s: (
                        (value(s, 'stepstream_projector_checkpoints_total', outcome='uploaded') or 0) >= 1
                    ),
                )
                assert value(uploaded, 'stepstream_projector_checkpoints_total', outcome='failed') == 0

                # Held from applying while 20 runs are written: behind, not ready, lag in records and seconds.
                await lock.acquire()
                await run_agents(event_log, 20, 'while-held')
                lagging = await until(
                    lambda: client.get(f'{server.url}/readyz'),
                    'the member to fall behind',
                    holds=lambda r: r.status_code == 503,
                )
                assert 'records behind' in lagging.json()['error'], lagging.text

                async def behind() -> Samples:
                    samples = await scrape(client, server.url)
                    seconds = total(samples, 'stepstream_projector_lag_seconds')
                    return samples if seconds > 0 else {}

                samples = await until(behind, 'the lag in seconds to show')
                assert total(samples, 'stepstream_projector_lag_records') > 5
                assert value(samples, 'stepstream_projector_ready') == 0
                # No checkpoint is taken while the shards are held: their age only grows.
                held_age = value(samples, 'stepstream_projector_checkpoint_age_seconds')
                assert held_age is not None
                later = await until(
                    lambda: scrape(client, server.url),
                    'the checkpoint age to grow',
                    holds=lambda s: value(s, 'stepstream_projector_checkpoint_age_seconds') > held_age,
                )
                uploads = value(later, 'stepstream_projector_checkpoints_total', outcome='uploaded')
                healthy = await client.get(f'{server.url}/healthz')
                assert healthy.status_code == 200  # behind is not dead: no restart
                lock.release()

                await until(
                    lambda: client.get(f'{server.url}/readyz'),
                    'the member to catch up',
                    holds=lambda r: r.status_code == 200,
                )
                samples = await until(
                    lambda: scrape(client, server.url),
                    'a checkpoint of what was applied since',
                    holds=lambda s: (
                        value(s, 'stepstream_projector_checkpoints_total', outcome='uploaded') > uploads
                    ),
                )
                assert total(samples, 'stepstream_projector_lag_records') == 0
        finally:
            server.stop()
            await member.stop()
            member.close()


class HeldLock:
    """Hold a projector's shards lock (its batches and assignments wait on it); release it by hand."""

    def __init__(self, projector: Projector) -> None:
        self.lock = projector.shards.lock
        self.held = False

    async def __aenter__(self) -> HeldLock:
        await self.acquire()
        return self

    async def acquire(self) -> None:
        await self.lock.acquire()
        self.held = True

    def release(self) -> None:
        self.held = False
        self.lock.release()

    async def __aexit__(self, *exc: object) -> None:
        if self.held:
            self.release()


@pytest.mark.timeout(120)
async def test_serve_is_scraped_and_probed_without_its_token(
    settings: Settings, event_log: EventLog, projector: Projector
) -> None:
    settings = settings.replace(serve_token='s3cret')
    await run_agents(event_log, 2, 'served')
    await projector.wait_for(await event_log.flush())
    app = app_for(settings, reader=ProjectionReader.of(projector))
    async with running(app, port=0) as served, httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(f'{served.url}/api/runs')).status_code == 401
        headers = {'Authorization': 'Bearer s3cret'}
        for _ in range(3):
            assert (await client.get(f'{served.url}/api/runs', headers=headers)).status_code == 200
        assert (await client.get(f'{served.url}/api/runs/served-0', headers=headers)).status_code == 200
        assert (await client.get(f'{served.url}/healthz')).status_code == 200
        ready = await client.get(f'{served.url}/readyz')
        assert ready.status_code == 200, ready.text
        samples = await scrape(client, served.url)

    assert value(samples, 'stepstream_serve_requests_total', route='/api/runs', method='GET', code='200') == 3
    # Refused at the gate, before any route: counted all the same.
    assert value(samples, 'stepstream_serve_requests_total', route='unmatched', method='GET', code='401') == 1
    # A run's page counts under its route's template: no run id reaches a label.
    assert (
        value(
            samples, 'stepstream_serve_requests_total', route='/api/runs/{run_id}', method='GET', code='200'
        )
        == 1
    )
    assert not any('served-0' in v for _, labels in samples for _, v in labels)
    assert value(samples, 'stepstream_serve_request_seconds_count', route='/api/runs') == 3
    assert_declared(samples, 'serve')


@pytest.mark.timeout(120)
async def test_serve_as_a_member_answers_with_its_projectors_metrics_and_probes(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    await ensure_topics(settings)
    await run_agents(event_log, 2, 'member')
    member = Projector(
        settings,
        db_path=tmp_path / 'projection',
        member=GroupMember(group=f'{settings.topics.topic_prefix}-serve', session_timeout_ms=6000),
    )
    async with HeldLock(member) as lock:
        await member.start()
        app = app_for(
            settings,
            reader=ProjectionReader.of(member),
            observer=ProjectorObserver(member, ProjectionReader.of(member), max_lag=100),
        )
        try:
            async with running(app, port=0) as served, httpx.AsyncClient(timeout=30) as client:
                waiting = await client.get(f'{served.url}/readyz')
                assert waiting.status_code == 503, waiting.text
                assert (await client.get(f'{served.url}/healthz')).status_code == 200
                lock.release()
                await until(
                    lambda: client.get(f'{served.url}/readyz'),
                    'the member to hold its shards',
                    holds=lambda r: r.status_code == 200,
                )
                await member.wait_for(await event_log.flush())
                assert (await client.get(f'{served.url}/api/runs')).status_code == 200
                samples = await scrape(client, served.url)
        finally:
            await member.stop()
            member.close()

    assert value(samples, 'stepstream_runs', status='completed') == 2
    assert value(samples, 'stepstream_projector_shards_owned') == settings.topics.partitions
    assert value(samples, 'stepstream_serve_requests_total', route='/api/runs', method='GET', code='200') == 1
    assert value(samples, 'stepstream_serve_requests_total', route='/readyz', method='GET', code='503') >= 1


@pytest.mark.once
@pytest.mark.timeout(120)
async def test_serve_alone_is_not_ready_while_a_shard_is_missing(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    db_path = tmp_path / 'projection'
    async with Projector(settings, db_path=db_path) as projector:
        await run_agents(event_log, 1, 'whole')
        await projector.wait_for(await event_log.flush())
    served_settings = settings.replace(db_path=str(db_path))
    async with running(app_for(served_settings), port=0) as served, httpx.AsyncClient(timeout=30) as client:
        whole = await client.get(f'{served.url}/readyz')
    assert whole.status_code == 200 and whole.json()['missing'] == [], whole.text

    (db_path / 'shard-0002').rename(tmp_path / 'elsewhere')  # moving to another host's member
    async with running(app_for(served_settings), port=0) as served, httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(f'{served.url}/healthz')).status_code == 200
        partial = await client.get(f'{served.url}/readyz')
    assert partial.status_code == 503, partial.text
    assert partial.json()['missing'] == [2] and 'missing' in partial.json()['error']


@pytest.mark.once
@pytest.mark.timeout(120)
async def test_a_metrics_port_that_cannot_be_bound_is_a_usage_error(
    settings: Settings, tmp_path: Path
) -> None:
    await ensure_topics(settings)
    env = {**os.environ, **settings.replace(db_path=str(tmp_path / 'projection')).to_env()}
    for port in ('70000', str(free_port())):
        host = '127.0.0.1' if port == '70000' else 'no-such-host.invalid'
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            '-m',
            'stepstream.cli',
            'projector',
            '--metrics-port',
            port,
            '--metrics-host',
            host,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 90)
        assert process.returncode == 2, (out, err)
        assert f'--metrics-port: cannot listen on {host}:{port}' in err.decode(), err
        assert b'Traceback' not in err
