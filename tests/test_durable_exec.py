"""StepPersistence under DBOS (SQLite system database), in real processes.

The child process (dbos_child.py) runs the persisted agent of durable_agent.py inside a DBOS
workflow. The tests SIGKILL it inside a tool, or inside a durable write after part of its records
reached the broker, and let a new process recover the workflow; or let it finish, also with a
1 MB image and 200 KB tool outputs. Then they read the projection (durable.py says what must hold).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from stepstream import Settings
from stepstream.producer import EventLog
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.topics import ensure_topics

from durable import (
    assert_audited,
    assert_clean_big_run,
    assert_tool_kill_recovered,
    assert_write_kill_recovered,
    kill_at,
    signed,
)

pytestmark = pytest.mark.engines

pytest.importorskip('dbos')

CHILD = Path(__file__).with_name('dbos_child.py')


async def child(settings: Settings, tmp_path: Path, mode: str, *flags: str) -> asyncio.subprocess.Process:
    env = {**os.environ, **settings.to_env(), 'PYTHONPATH': str(CHILD.parent)}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(CHILD),
        mode,
        'wf-1',
        str(tmp_path / 'dbos.sqlite'),
        str(tmp_path / 'effects.txt'),
        *flags,
        env=env,
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def finish(process: asyncio.subprocess.Process) -> str:
    out, err = await process.communicate()
    assert process.returncode == 0, f'child exited with {process.returncode}: {err.decode()[-3000:]}'
    return out.decode()


def effects(tmp_path: Path) -> list[str]:
    return (tmp_path / 'effects.txt').read_text().split()


async def test_dbos_recovers_a_run_killed_inside_a_tool_as_one_run(
    settings: Settings, tmp_path: Path, event_log: EventLog, projector: Projector
) -> None:
    await ensure_topics(settings)
    await kill_at(await child(settings, tmp_path, 'start', '--hang'), b'in-tool call-1\n')

    await projector.catch_up()
    reader = ProjectionReader.of(projector)
    [interrupted] = await reader.list_runs(conversation_id='wf-1')
    assert interrupted.status == 'running'
    unresolved = await reader.list_unresolved_tool_effects(interrupted.run_id)
    assert [e.tool_call_id for e in unresolved] == ['call-1']

    output = await finish(await child(settings, tmp_path, 'recover'))
    assert 'output answered after 2 tool calls' in output
    await projector.catch_up()
    await assert_tool_kill_recovered(reader, projector, event_log, 'wf-1', effects(tmp_path))
    [run] = await reader.list_runs(conversation_id='wf-1')
    assert run.run_id == interrupted.run_id
    assert projector.duplicates_ignored == 0  # a completed write is journaled, never sent again


async def test_dbos_recovers_a_run_killed_inside_its_durable_write(
    settings: Settings, tmp_path: Path, event_log: EventLog, projector: Projector
) -> None:
    settings = signed(settings)
    await ensure_topics(settings)
    await kill_at(await child(settings, tmp_path, 'start', '--hang-write'), b'in-write\n')
    await projector.catch_up()
    [interrupted] = await ProjectionReader.of(projector).list_runs(conversation_id='wf-1')
    assert interrupted.status == 'running'

    output = await finish(await child(settings, tmp_path, 'recover'))
    assert 'output answered after 2 tool calls' in output
    await projector.catch_up()
    await assert_write_kill_recovered(
        ProjectionReader.of(projector), projector, event_log, 'wf-1', effects(tmp_path)
    )
    await assert_audited(settings, 'wf-1')


async def test_dbos_run_without_a_crash_has_the_plain_trail_and_large_media_intact(
    settings: Settings, tmp_path: Path, event_log: EventLog, projector: Projector
) -> None:
    await ensure_topics(settings)
    output = await finish(await child(settings, tmp_path, 'start', '--big'))
    assert 'output answered after 2 tool calls' in output
    await projector.catch_up()
    run = await assert_clean_big_run(ProjectionReader.of(projector), projector, event_log, 'wf-1')
    assert run.run_id.startswith('worker-wf-1')


async def test_deprecated_dbos_agent_is_refused_with_what_to_use(settings: Settings, tmp_path: Path) -> None:
    await ensure_topics(settings)
    process = await child(settings, tmp_path, 'start', '--deprecated')
    _, err = await process.communicate()
    assert process.returncode != 0
    assert 'the deprecated `DBOSAgent` wrapper does not provide one' in err.decode()
    assert 'capabilities=[StepPersistence(...), DBOSDurability()]' in err.decode()
