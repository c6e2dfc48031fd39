"""StepPersistence under Prefect: a Prefect server (SQLite) the tests start, flow runs in real processes.

The child (prefect_child.py) runs the persisted agent of durable_agent.py as a flow run; model
requests, tool calls, media offload and stepstream's seals and writes are tasks whose results
Prefect caches by their inputs. The tests SIGKILL the child inside a tool, or inside a durable
write after part of its records reached the broker, and run the same flow run again in a new
process; or let it finish, also with a 1 MB image and 200 KB tool outputs. Then they read the
projection (durable.py says what must hold).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from collections.abc import Iterator
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
from engines import prefect_server

pytestmark = pytest.mark.engines

if importlib.util.find_spec('prefect') is None:  # not imported here: prefect configures logging on import
    pytest.skip('prefect is not installed (the dev extra)', allow_module_level=True)

CHILD = Path(__file__).with_name('prefect_child.py')


@pytest.fixture(scope='module')
def prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One Prefect server for the module's tests; yields the environment its clients need."""
    with prefect_server(tmp_path_factory.mktemp('prefect')) as env:
        yield env


def conversation(tmp_path: Path) -> str:
    return f'flow-{tmp_path.name}'


async def child(
    settings: Settings, prefect: dict[str, str], tmp_path: Path, mode: str, *flags: str
) -> asyncio.subprocess.Process:
    env = {
        **os.environ,
        **settings.to_env(),
        **prefect,
        'PYTHONPATH': str(CHILD.parent),
        'STEPSTREAM_TEST_EFFECTS': str(tmp_path / 'effects.txt'),
    }
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(CHILD),
        mode,
        str(tmp_path / 'flow-run-id'),
        conversation(tmp_path),
        *flags,
        env=env,
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def finish(process: asyncio.subprocess.Process, timeout: float = 180) -> str:
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        out, err = await process.communicate()
        raise AssertionError(f'the flow run did not end in {timeout}s: {err.decode()[-6000:]}') from None
    assert process.returncode == 0, f'child exited with {process.returncode}: {err.decode()[-6000:]}'
    return out.decode()


def effects(tmp_path: Path) -> list[str]:
    return (tmp_path / 'effects.txt').read_text().split()


async def test_prefect_recovers_a_flow_run_killed_inside_a_tool_as_one_run(
    settings: Settings, prefect: dict[str, str], tmp_path: Path, event_log: EventLog, projector: Projector
) -> None:
    await ensure_topics(settings)
    await kill_at(await child(settings, prefect, tmp_path, 'start', '--hang'), b'in-tool call-1\n')
    await projector.catch_up()
    [interrupted] = await ProjectionReader.of(projector).list_runs(conversation_id=conversation(tmp_path))
    assert interrupted.status == 'running'

    output = await finish(await child(settings, prefect, tmp_path, 'recover'))
    assert 'output answered after 2 tool calls' in output
    await projector.catch_up()
    reader = ProjectionReader.of(projector)
    await assert_tool_kill_recovered(
        reader,
        projector,
        event_log,
        conversation(tmp_path),
        effects(tmp_path),
        step_doc='Runs as a Prefect task, whose result a recovered flow run reuses.',  # the child's
    )
    [run] = await reader.list_runs(conversation_id=conversation(tmp_path))
    assert run.run_id == interrupted.run_id
    assert projector.duplicates_ignored == 0  # every completed write was a cache hit, not sent again


async def test_prefect_recovers_a_flow_run_killed_inside_a_durable_write(
    settings: Settings, prefect: dict[str, str], tmp_path: Path, event_log: EventLog, projector: Projector
) -> None:
    settings = signed(settings)
    await ensure_topics(settings)
    await kill_at(await child(settings, prefect, tmp_path, 'start', '--hang-write'), b'in-write\n')
    output = await finish(await child(settings, prefect, tmp_path, 'recover'))
    assert 'output answered after 2 tool calls' in output
    await projector.catch_up()
    await assert_write_kill_recovered(
        ProjectionReader.of(projector), projector, event_log, conversation(tmp_path), effects(tmp_path)
    )
    await assert_audited(settings, conversation(tmp_path))


async def test_prefect_run_without_a_crash_has_the_plain_trail_and_large_media_intact(
    settings: Settings, prefect: dict[str, str], tmp_path: Path, event_log: EventLog, projector: Projector
) -> None:
    await ensure_topics(settings)
    output = await finish(await child(settings, prefect, tmp_path, 'start', '--big'))
    assert 'output answered after 2 tool calls' in output
    await projector.catch_up()
    run = await assert_clean_big_run(
        ProjectionReader.of(projector), projector, event_log, conversation(tmp_path)
    )
    assert run.conversation_id == conversation(tmp_path)


async def test_deprecated_prefect_agent_is_refused_with_what_to_use(
    settings: Settings, prefect: dict[str, str], tmp_path: Path
) -> None:
    await ensure_topics(settings)
    process = await child(settings, prefect, tmp_path, 'start', '--deprecated')
    _, err = await process.communicate()
    assert process.returncode != 0
    assert 'the deprecated `PrefectAgent` wrapper does not provide one' in err.decode()
    assert 'capabilities=[StepPersistence(...), PrefectDurability()]' in err.decode()
