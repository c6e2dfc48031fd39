"""The `stepstream` command line against a real broker and projection, as a user runs it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from pydantic_ai import Agent

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import ProjectionReader, Projector, rebuild, verify_paths

from agents import calls_then_answers


def cli_env(settings: Settings, db_path: Path) -> dict[str, str]:
    return {**os.environ, **settings.replace(db_path=str(db_path)).to_env()}


async def cli(settings: Settings, db_path: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        '-m',
        'stepstream.cli',
        *args,
        env=cli_env(settings, db_path),
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


async def test_views_tables_and_json(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    await orchestrate(event_log, 'conv-cli')
    await projector.wait_for(await event_log.flush())
    [boss] = await projector.reader().list_runs(conversation_id='conv-cli')

    code, out, _ = await cli(settings, db_path, 'runs', '--conversation-id', 'conv-cli')
    assert (
        code == 0 and boss.run_id in out and 'completed' in out and out.splitlines()[0].startswith('run_id')
    )
    code, out, _ = await cli(settings, db_path, 'runs', '--json')
    assert code == 0 and {r['agent_name'] for r in json.loads(out)} == {'boss', 'worker'}

    code, out, _ = await cli(settings, db_path, 'tree', boss.run_id)
    assert code == 0 and out.splitlines()[0].startswith(boss.run_id) and '└── worker-' in out
    code, out, _ = await cli(settings, db_path, 'events', boss.run_id, '--json')
    assert code == 0 and json.loads(out)[0]['kind'] == 'run_started'
    code, out, _ = await cli(settings, db_path, 'snapshot', boss.run_id)
    assert code == 0 and 'complete' in out and 'ToolReturnPart' in out
    code, out, _ = await cli(settings, db_path, 'unresolved', '--json')
    assert code == 0 and json.loads(out) == []
    code, out, _ = await cli(settings, db_path, 'topics', 'ensure')
    assert (
        code == 0
        and f'{settings.step_events_topic}, {settings.tool_effects_topic}' in out
        and '3 partitions' in out
    )
    code, out, _ = await cli(settings, db_path, 'status')
    assert code == 0 and 'total lag: 0 records' in out and 'dead-lettered: 0' in out

    code, _, err = await cli(settings, db_path, 'tree', 'no-such-run')
    assert code == 1 and 'no-such-run' in err
    code, _, err = await cli(settings, db_path.parent / 'missing', 'runs')
    assert code == 2 and 'no projection at' in err


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
    equal, difference = verify_paths(db_path, tmp_path / 'fresh')
    assert difference is not None and equal > 0
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
        finally:
            reader.close()
        service.send_signal(signal.SIGTERM)
        remaining = await asyncio.wait_for(service.stdout.read(), 30)
        assert await service.wait() == 0
        assert b'stopping after' in remaining
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
        reader = projector.reader()
        kept = await reader.list_snapshots('keep')
        assert [s.snapshot_seq for s in kept] == [5, 6]
        assert kept[-1].messages == result.all_messages()
        assert await reader.get_snapshot('keep', 1) is None
    # Same log, same option: a rebuild agrees.
    await rebuild(settings, tmp_path / 'kept-rebuilt', max_snapshots_per_run=2)
    assert verify_paths(tmp_path / 'kept', tmp_path / 'kept-rebuilt')[1] is None


def test_rejects_a_bad_retention(settings: Settings, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match='at least 1'):
        Projector(settings, db_path=tmp_path / 'p', max_snapshots_per_run=0)
