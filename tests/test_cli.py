"""The `stepstream` command line against a real broker and projection, as a user runs it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic_ai import Agent

from stepstream import Settings
from stepstream.embedded import EmbeddedStack
from stepstream.ids import short_id
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector, rebuild, verify_paths
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import StepEvent
from stepstream.service_log import BrokerLossLog

from agents import calls_then_answers
from brokers import tansu_only
from deferred_runs import run_until_waiting

pytestmark = pytest.mark.broker

STEPSTREAM = str(Path(sys.executable).parent / 'stepstream')
"""The installed command, as a user runs it."""


def cli_env(settings: Settings, db_path: Path) -> dict[str, str]:
    return {**os.environ, **settings.replace(db_path=str(db_path)).to_env()}


async def cli(settings: Settings, db_path: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        STEPSTREAM,
        *args,
        env=cli_env(settings, db_path),
        cwd=db_path.parent,  # no .stepstream stack of the checkout's `make run` in the way
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def orchestrate(log: EventLog, conversation: str) -> None:
    worker = Agent(calls_then_answers('dig'), capabilities=[StepPersistence(log=log, agent_name='worker')])
    boss = Agent(calls_then_answers('delegate'), capabilities=[StepPersistence(log=log, agent_name='boss')])

    @worker.tool_plain
    def dig() -> str:
        return 'found'

    @boss.tool_plain
    async def delegate() -> str:
        return (await worker.run('dig')).output

    await boss.run('go', conversation_id=conversation)


async def test_runs_come_a_page_at_a_time_newest_first_or_all_as_json_lines(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    for i in range(3):
        await orchestrate(event_log, f'conv-page-{i}')  # a boss and its worker each: 6 runs
    await projector.wait_for(await event_log.flush())
    everyone = await ProjectionReader.of(projector).list_runs(newest_first=True)
    newest = [r.run_id for r in everyone]
    assert len(newest) == 6

    code, out, _ = await cli(settings, db_path, 'runs', '--limit', '4', '--json')
    assert code == 0 and [r['run_id'] for r in json.loads(out)] == newest[:4]
    code, out, _ = await cli(settings, db_path, 'runs', '--limit', '4')
    assert code == 0 and out.rstrip().endswith(f'`stepstream runs --after {newest[3]}` (same filters)')
    assert [line.split()[0] for line in out.splitlines()[2:6]] == [short_id(r) for r in newest[:4]]
    code, out, _ = await cli(settings, db_path, 'runs', '--limit', '4', '--wide')  # every id in full
    assert code == 0 and [line.split()[0] for line in out.splitlines()[2:6]] == newest[:4]
    code, out, _ = await cli(settings, db_path, 'runs', '--limit', '4', '--after', newest[3], '--json')
    assert code == 0 and [r['run_id'] for r in json.loads(out)] == newest[4:]
    code, out, _ = await cli(settings, db_path, 'runs', '--limit', '4', '--after', newest[3])
    assert code == 0 and '... more' not in out  # the last page
    code, out, _ = await cli(settings, db_path, 'runs', '--oldest-first', '--json')
    assert code == 0 and [r['run_id'] for r in json.loads(out)] == newest[::-1]

    code, out, _ = await cli(settings, db_path, 'runs', '--all')
    lines = out.splitlines()
    assert code == 0 and [json.loads(line)['run_id'] for line in lines] == newest
    code, _, err = await cli(settings, db_path, 'runs', '--after', 'no-such-run')
    assert code == 1 and "after='no-such-run' is not a run of this listing" in err
    code, _, err = await cli(settings, db_path, 'runs', '--limit', '0')
    assert code == 2 and 'at least 1' in err


async def test_views_tables_and_json(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    await orchestrate(event_log, 'conv-cli')
    await projector.wait_for(await event_log.flush())
    [boss] = await ProjectionReader.of(projector).list_runs(conversation_id='conv-cli')

    code, out, _ = await cli(settings, db_path, 'runs', '--conversation-id', 'conv-cli')
    assert (
        code == 0
        and short_id(boss.run_id) in out
        and 'completed' in out
        and out.splitlines()[0].startswith('run_id')
    )
    code, out, _ = await cli(settings, db_path, 'runs', '--json')
    assert code == 0 and {r['agent_name'] for r in json.loads(out)} == {'boss', 'worker'}
    assert db_path.stat().st_mode & 0o777 == 0o700  # runs and tool inputs: the owner's only

    code, out, _ = await cli(settings, db_path, 'tree', boss.run_id)
    assert code == 0 and out.splitlines()[0].startswith(short_id(boss.run_id)) and '└── worker-' in out
    code, out, _ = await cli(settings, db_path, 'tree', boss.run_id, '--wide')
    assert code == 0 and out.splitlines()[0].startswith(f'{boss.run_id}  [boss, completed]')
    code, out, _ = await cli(settings, db_path, 'events', boss.run_id, '--json')
    assert code == 0 and json.loads(out)[0]['kind'] == 'run_started'
    code, out, _ = await cli(settings, db_path, 'snapshot', boss.run_id)
    assert code == 0 and 'complete' in out and 'UserPromptPart' not in out  # the messages, as text
    assert '    user: go' in out and '    tool call delegate (call-0): {}' in out
    assert '    tool return delegate (call-0): answered after 1 tool calls' in out
    assert out.rstrip().endswith('text: answered after 1 tool calls')
    code, out, _ = await cli(settings, db_path, 'effects', boss.run_id, '--json')
    [delegated] = json.loads(out)
    assert code == 0 and delegated['tool_name'] == 'delegate' and delegated['status'] == 'completed'
    code, out, _ = await cli(settings, db_path, 'unresolved', '--json')
    assert code == 0 and json.loads(out) == []
    code, out, _ = await cli(settings, db_path, 'topics', 'ensure')
    assert (
        code == 0
        and f'{settings.topics.step_events_topic}, {settings.topics.tool_effects_topic}' in out
        and '3 partitions' in out
    )
    code, out, _ = await cli(settings, db_path, 'status')
    assert code == 0 and 'total lag: 0 records' in out and 'dead-lettered: 0' in out

    code, out, _ = await cli(settings, db_path, 'status', '--json')
    status = json.loads(out)
    assert code == 0 and status['total_lag'] == 0 and status['dead_lettered'] == 0
    assert {(p['topic'], p['partition']) for p in status['partitions']} == {
        (t, p)
        for t in (settings.topics.step_events_topic, settings.topics.tool_effects_topic)
        for p in range(3)
    }
    assert all(p['end'] == p['applied'] for p in status['partitions'])

    # A view imports what it needs and no more: not Pydantic AI (half a second), not pyarrow.
    probe = await asyncio.create_subprocess_exec(
        sys.executable,
        '-c',
        'import sys; from stepstream.cli import main; code = main(["runs", "--json"]); '
        'print(code, sorted(m for m in ("pydantic_ai", "pyarrow", "fastapi") if m in sys.modules))',
        env=cli_env(settings, db_path),
        cwd=db_path.parent,
        stdout=asyncio.subprocess.PIPE,
    )
    printed = (await probe.communicate())[0].decode().splitlines()
    assert printed[-1] == '0 []' and any(boss.run_id in line for line in printed)

    views = ('tree', 'events', 'snapshot', 'effects', 'unresolved')
    answers = await asyncio.gather(*(cli(settings, db_path, v, 'no-such-run', '--json') for v in views))
    for view, (code, out, err) in zip(views, answers, strict=True):
        assert (code, out) == (1, ''), view
        assert "no run 'no-such-run' in the projection at" in err, view
    code, _, err = await cli(settings, db_path.parent / 'missing', 'runs')
    assert code == 2 and 'no projection at' in err


async def test_cancelled_and_stale_runs_in_every_view(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    entered = asyncio.Event()
    agent = Agent(calls_then_answers('slow'), capabilities=[StepPersistence(log=event_log, run_id='cx')])

    @agent.tool_plain
    async def slow() -> str:
        entered.set()  # its `started` is acknowledged: the body runs after it
        await asyncio.sleep(3600)
        return 'never'

    task = asyncio.create_task(agent.run('go'))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await orchestrate(event_log, 'conv-stale')
    # A process that died mid-run: its run_started, and nothing after it.
    await event_log.append(_started('ghost', settings))
    await projector.wait_for(await event_log.flush())

    code, out, _ = await cli(settings, db_path, 'runs', '--status', 'cancelled', '--json')
    [cancelled] = json.loads(out)
    assert cancelled['run_id'] == 'cx' and 'CancelledError' in cancelled['error']
    # The table and the JSON say the same of the open effect, and of its run.
    code, out, _ = await cli(settings, db_path, 'unresolved', 'cx')
    assert code == 0 and 'cancelled' in out and 'unknown_after_crash' in out
    code, out, _ = await cli(settings, db_path, 'unresolved', 'cx', '--json')
    [effect] = json.loads(out)
    assert effect['status'] == 'unknown_after_crash' and effect['run_status'] == 'cancelled'

    # The operator resolves it; the run's ledger shows the call resolved, and by whom and why.
    code, _, err = await cli(
        settings, db_path, 'resolve', 'cx', 'call-0', '--did-not-happen', '--note', 'the outbox is empty'
    )
    assert code == 0, err
    reader = ProjectionReader.of(projector)
    while (found := await reader.get_tool_effect('cx', 'call-0')) is None or found.status != 'resolved':
        await asyncio.sleep(0.05)  # the projector (this test's) applies what the CLI appended
    code, out, _ = await cli(settings, db_path, 'effects', 'cx')
    assert code == 0 and 'resolved' in out.splitlines()[2] and 'slow' in out.splitlines()[2]
    assert 'call-0: resolved did not happen by ' in out and out.rstrip().endswith(': the outbox is empty')
    code, out, _ = await cli(settings, db_path, 'effects', 'cx', '--json')
    [ledger] = json.loads(out)
    assert ledger['status'] == 'resolved' and ledger['resolutions'][0]['note'] == 'the outbox is empty'

    # Stale is read, not stored: the same projection, read with two thresholds.
    code, out, _ = await cli(settings, db_path, 'runs', '--status', 'running', '--json')
    assert [r['run_id'] for r in json.loads(out)] == ['ghost']
    code, out, _ = await cli(settings, db_path, 'runs', '--status', 'stale', '--stale-after-s', '0', '--json')
    assert [r['run_id'] for r in json.loads(out)] == ['ghost']
    code, out, _ = await cli(settings, db_path, 'tree', 'ghost', '--stale-after-s', '0')
    assert out.strip() == 'ghost  [-, stale]'


async def test_a_waiting_run_and_its_deferred_calls_in_every_view(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    await run_until_waiting(event_log, 'wx')
    await projector.wait_for(await event_log.flush())

    code, out, err = await cli(settings, db_path, 'runs', '--status', 'waiting', '--json')
    assert code == 0, err
    assert [(r['run_id'], r['status']) for r in json.loads(out)] == [('wx', 'waiting')]
    code, out, _ = await cli(settings, db_path, 'status')
    counts = 'running 0, stale 0, waiting 1, resumed 0, completed 0, failed 0, cancelled 0'
    assert code == 0 and f'runs: 1 ({counts})' in out
    assert 'tool calls in doubt: 0' in out

    # The ledger says what each deferred call waits for, with its arguments; none is in doubt.
    code, out, _ = await cli(settings, db_path, 'effects', 'wx')
    rows = {line.split()[0]: line.split()[2:4] for line in out.splitlines()[2:6]}
    assert rows.pop('call-lookup')[0] == 'completed'
    assert rows == {
        'call-refund': ['deferred', '(approval)'],
        'call-ask': ['deferred', '(question)'],
        'call-export': ['deferred', '(external)'],
    }
    assert 'call-export: waits for an outside system\'s result; arguments {"table":"orders"}' in out
    for view in (['unresolved'], ['unresolved', 'wx']):
        code, out, _ = await cli(settings, db_path, *view, '--json')
        assert (code, json.loads(out)) == (0, []), view


def _started(run_id: str, settings: Settings) -> StepEvent:
    return StepEvent(
        run_id=run_id,
        seq=0,
        writer_id='w-ghost',
        timestamp=datetime.now(UTC),
        agent_name=None,
        conversation_id='conv-stale',
        parent_run_id=None,
        kind='run_started',
    )


async def test_output_to_a_closed_pipe_ends_quietly(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    await orchestrate(event_log, 'conv-pipe')
    await projector.wait_for(await event_log.flush())
    read, write = os.pipe()
    os.close(read)  # `stepstream runs --json | head -0`: nobody reads
    process = await asyncio.create_subprocess_exec(
        STEPSTREAM,
        'runs',
        '--json',
        env=cli_env(settings, db_path),
        cwd=db_path.parent,
        stdout=write,
        stderr=asyncio.subprocess.PIPE,
    )
    os.close(write)
    _, err = await process.communicate()
    assert process.returncode == 141 and err == b''


async def test_flags_override_the_environment(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    await orchestrate(event_log, 'conv-flags')
    await projector.wait_for(await event_log.flush())
    code, out, _ = await cli(
        settings, db_path.parent / 'elsewhere', 'runs', '--db-path', str(db_path), '--json'
    )
    assert code == 0 and len(json.loads(out)) == 2


async def test_rebuild_and_verify(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path, tmp_path: Path
) -> None:
    for i in range(3):
        await orchestrate(event_log, f'conv-rebuild-{i}')
    await projector.wait_for(await event_log.flush())

    code, out, err = await cli(settings, db_path, 'rebuild', '--into', str(tmp_path / 'fresh'))
    assert code == 0, err
    assert 'rebuilt' in out and '100%' in err
    code, out, _ = await cli(settings, db_path, 'verify', str(db_path), str(tmp_path / 'fresh'))
    assert code == 0 and 'identical' in out

    code, _, err = await cli(settings, db_path, 'rebuild', '--into', str(tmp_path / 'fresh'))
    assert code == 2 and 'not empty' in err

    # A projection that missed the last run differs, and verify says where.
    await orchestrate(event_log, 'conv-late')
    await projector.wait_for(await event_log.flush())
    _, difference = verify_paths(db_path, tmp_path / 'fresh')
    # Only the late runs differ (which key comes first depends on their partition and start).
    [late] = await ProjectionReader.of(projector).list_runs(conversation_id='conv-late')
    late_runs = await ProjectionReader.of(projector).run_tree(late.run_id)
    late_ids = [r.run_id for r in late_runs] + [r.conversation_id for r in late_runs if r.conversation_id]
    # ...or their conversations' shares (decision 0062), keyed by conversation.
    assert difference is not None and any(name in difference.key for name in late_ids), difference
    code, out, _ = await cli(settings, db_path, 'verify', str(db_path), str(tmp_path / 'fresh'))
    assert code == 1 and 'first difference at' in out


async def test_projector_service_stops_gracefully_and_serves_other_processes(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    db_path = tmp_path / 'service'
    service = await asyncio.create_subprocess_exec(
        sys.executable,
        '-m',
        'stepstream.cli',
        'projector',
        env=cli_env(settings, db_path),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert service.stdout is not None
        line = await asyncio.wait_for(service.stdout.readline(), 60)
        assert b'projector:' in line
        await orchestrate(event_log, 'conv-service')
        await event_log.flush()
        reader = ProjectionReader.open(db_path)  # a secondary instance beside the running service
        try:
            for _ in range(200):
                runs = await reader.list_runs(conversation_id='conv-service')
                if runs and runs[0].status == 'completed':
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError('the reader never saw the run the service applied')
            assert len(await reader.list_runs(parent_run_id=runs[0].run_id)) == 1
            # Status names the process applying each shard (the lock's holder), here the service.
            status = await reader.status()
            assert status.writers == dict.fromkeys(status.shards, service.pid) and len(status.shards) == 3
            assert any(status.last_batch_at[p] is not None for p in status.shards)  # where runs went
        finally:
            reader.close()
        code, out, _ = await cli(settings, db_path, 'status')
        assert code == 0 and out.splitlines()[2].split()[5:7] == ['pid', str(service.pid)]
        service.send_signal(signal.SIGTERM)
        remaining = await asyncio.wait_for(service.stdout.read(), 30)
        assert await service.wait() == 0
        assert b'stopping after' in remaining
        # With the service gone, nothing applies the shards, and status says so.
        code, out, _ = await cli(settings, db_path, 'status', '--json')
        assert code == 0 and set(json.loads(out)['writers'].values()) == {None}
        code, out, _ = await cli(settings, db_path, 'status')
        assert 'no projector applies partition(s) [0, 1, 2]' in out
    finally:
        if service.returncode is None:
            service.kill()
            await service.wait()


async def test_max_snapshots_per_run_keeps_newest_and_newest_complete(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    agent = Agent(
        calls_then_answers('step', calls=6), capabilities=[StepPersistence(log=event_log, run_id='keep')]
    )

    @agent.tool_plain
    def step() -> str:
        return 's'

    result = await agent.run('go')
    position = await event_log.flush()
    async with Projector(settings, db_path=tmp_path / 'kept', max_snapshots_per_run=2) as projector:
        await projector.wait_for(position)
        reader = ProjectionReader.of(projector)
        kept = await reader.list_snapshots('keep')
        assert [s.snapshot_seq for s in kept] == [5, 6]
        assert kept[-1].messages == result.all_messages()
        assert await reader.get_snapshot('keep', 1) is None
    # Same log, same option: a rebuild agrees.
    await rebuild(settings, tmp_path / 'kept-rebuilt', max_snapshots_per_run=2)
    assert verify_paths(tmp_path / 'kept', tmp_path / 'kept-rebuilt')[1] is None


def test_rejects_a_bad_retention(settings: Settings, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match='max_snapshots_per_run must be a positive int or None, got 0'):
        Projector(settings, db_path=tmp_path / 'p', max_snapshots_per_run=0)


def test_a_client_warning_is_a_lost_broker_only_when_the_broker_does_not_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger='stepstream.service')
    loss = BrokerLossLog('kafka-1:9092')

    def client(message: str, name: str = 'aiokafka.consumer.group_coordinator') -> bool:
        record = logging.LogRecord(name, logging.WARNING, __file__, 1, message, None, None)
        return loss.filter(record)

    def said() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if r.name == 'stepstream.service']
        caplog.clear()
        return lines

    assert client('not the client', name='stepstream.projector')  # other loggers pass
    # A rebalance: the broker answers, so the client's own words are passed on, once.
    assert not client('Heartbeat failed for group g because it is rebalancing')
    assert not client('Heartbeat failed for group g because it is rebalancing')
    assert loss.pending and not loss.lost and said() == []
    loss.checked(True)
    assert said() == [
        'Kafka client: Heartbeat failed for group g because it is rebalancing (1 more client messages folded)'
    ]
    assert not loss.pending
    # The broker is gone: one line, then quiet until it answers again.
    assert not client('Unable connect to node with id 1')
    loss.checked(False)
    assert not client('Unable connect to node with id 1')
    loss.checked(False)
    assert loss.lost and said() == [
        'lost Kafka at kafka-1:9092 (Unable connect to node with id 1); retrying, and quiet until it is back'
    ]
    assert 'away for' in (loss.summary() or '')
    loss.checked(True)
    [back] = said()
    assert back.startswith('Kafka at kafka-1:9092 answers again after') and '1 client messages' in back
    assert not loss.pending and loss.summary() is None


@tansu_only('the service is the same client on both brokers; one pass stops a broker of its own')
async def test_projector_service_logs_a_lost_broker_once_and_stops_cleanly(tmp_path: Path) -> None:
    async with EmbeddedStack(tmp_path / 'stack', partitions=1) as stack:
        settings = stack.settings
        db_path = tmp_path / 'service'
        service = await asyncio.create_subprocess_exec(
            STEPSTREAM,
            'projector',
            env=cli_env(settings, db_path),
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert service.stdout is not None and service.stderr is not None
            assert b'projector:' in await asyncio.wait_for(service.stdout.readline(), 60)
            await asyncio.to_thread(stack.stop_broker)
            lost = await asyncio.wait_for(service.stderr.readline(), 60)
            assert b'lost Kafka at' in lost
            await asyncio.to_thread(stack.start_broker)
            back = await asyncio.wait_for(service.stderr.readline(), 60)
            assert b'answers again after' in back and b'client messages were folded' in back
            await asyncio.to_thread(stack.stop_broker)
            assert b'lost Kafka at' in await asyncio.wait_for(service.stderr.readline(), 60)
            service.send_signal(signal.SIGTERM)  # while the broker is away
            out = await asyncio.wait_for(service.stdout.read(), 60)
            err = await service.stderr.read()
            assert await service.wait() == 0, err.decode()
            assert b'stopping after 0 records' in out and b'away for' in out
            assert err == b'', err.decode()  # no traceback, no unclosed client, no retry noise
        finally:
            if service.returncode is None:
                service.kill()
                await service.wait()
