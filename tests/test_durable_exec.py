"""StepPersistence under a durable-execution engine: DBOS (SQLite system database), real processes.

The child process (dbos_child.py) runs a persisted agent inside a DBOS workflow. One test SIGKILLs
it inside a tool and lets a new process recover the workflow; the other lets it finish. Both then
read the projection: one run, one writer, no conflicts, no gaps, and a trail that is the trail
of the same agent without DBOS, plus the marks of a recovered attempt.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from pydantic_ai import Agent, RunContext

from stepstream import Settings
from stepstream.producer import ATTEMPT_KEY, EventLog, StepPersistence
from stepstream.projector import ProjectionReader, Projector
from stepstream.schemas import RunRecord, StepEvent
from stepstream.topics import ensure_topics

from agents import calls_then_answers

pytest.importorskip('dbos')

CHILD = Path(__file__).with_name('dbos_child.py')


async def child(settings: Settings, tmp_path: Path, mode: str, *extra: str) -> asyncio.subprocess.Process:
    env = {**os.environ, **settings.to_env(), 'PYTHONPATH': str(CHILD.parent)}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(CHILD),
        mode,
        'wf-1',
        str(tmp_path / 'dbos.sqlite'),
        str(tmp_path / 'effects.txt'),
        *extra,
        env=env,
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
    )


async def finish(process: asyncio.subprocess.Process) -> str:
    out, _ = await process.communicate()
    assert process.returncode == 0, f'child exited with {process.returncode}'
    return out.decode()


async def the_run(reader: ProjectionReader) -> tuple[RunRecord, list[StepEvent]]:
    [run] = await reader.list_runs(conversation_id='wf-1')
    assert run.status == 'completed' and run.conflicting_writers == [] and run.gaps == []
    events = await reader.list_events(run.run_id)
    assert run.event_count == run.last_seq + 1  # every seq, of both topics, applied once
    assert {e.writer_id for e in events} == {run.registration_id}
    return run, events


async def trail_without_dbos(event_log: EventLog, projector: Projector) -> list[tuple[object, ...]]:
    """The same agent, tool and prompt, run plainly: the trail the DBOS runs must match."""
    agent = Agent(
        calls_then_answers('step', calls=2),
        capabilities=[StepPersistence(log=event_log, agent_name='worker')],
    )

    @agent.tool
    async def step(ctx: RunContext[None]) -> str:
        return f'{ctx.tool_call_id} done'

    await agent.run('go', conversation_id='plain')
    await projector.wait_for(await event_log.flush())
    [run] = await projector.reader().list_runs(conversation_id='plain')
    return shape(await projector.reader().list_events(run.run_id))


def shape(events: list[StepEvent]) -> list[tuple[object, ...]]:
    """What a trail says, without what differs between any two runs (ids, times)."""
    return [
        (e.seq, e.kind, e.step_index, e.tool_call_id, e.tool_name, e.error, e.snapshot and e.snapshot.state)
        for e in events
    ]


async def test_dbos_recovers_a_run_killed_inside_a_tool_as_one_run(
    settings: Settings, tmp_path: Path, event_log: EventLog, projector: Projector
) -> None:
    await ensure_topics(settings)
    first = await child(settings, tmp_path, 'start', '--hang')
    try:
        assert first.stdout is not None
        line = await asyncio.wait_for(first.stdout.readline(), 120)
        assert line == b'in-tool call-1\n', f'the child did not reach the second tool: {line!r}'
    finally:
        if first.returncode is None:
            first.send_signal(signal.SIGKILL)
        await first.wait()
    assert first.returncode == -signal.SIGKILL

    await projector.catch_up()
    reader = projector.reader()
    [interrupted] = await reader.list_runs(conversation_id='wf-1')
    assert interrupted.status == 'running'
    unresolved = await reader.list_unresolved_tool_effects(interrupted.run_id)
    assert [e.tool_call_id for e in unresolved] == ['call-1']

    output = await finish(await child(settings, tmp_path, 'recover'))
    assert 'output answered after 2 tool calls' in output
    await projector.catch_up()

    run, events = await the_run(reader)
    assert run.run_id == interrupted.run_id
    assert shape(events) == await trail_without_dbos(event_log, projector)
    # The trail: the first attempt up to the call it was killed in, then the recovered attempt.
    cut = next(i for i, e in enumerate(events) if (e.kind, e.tool_call_id) == ('tool_call_started', 'call-1'))
    assert all(ATTEMPT_KEY not in e.metadata for e in events[: cut + 1])
    assert all(e.metadata.get(ATTEMPT_KEY) == '2' for e in events[cut + 1 :])
    assert events[cut + 1].kind == 'tool_call_completed' and events[cut + 1].tool_call_id == 'call-1'
    # The interrupted call is resolved by the recovered attempt; each side effect happened once.
    effect = await reader.get_tool_effect(run.run_id, 'call-1')
    assert effect is not None and effect.status == 'completed'
    assert await reader.list_unresolved_tool_effects(run.run_id) == []
    assert (tmp_path / 'effects.txt').read_text().split() == ['call-0', 'call-1']
    assert projector.duplicates_ignored == 0


async def test_dbos_run_without_a_crash_has_the_plain_trail(
    settings: Settings, tmp_path: Path, event_log: EventLog, projector: Projector
) -> None:
    await ensure_topics(settings)
    output = await finish(await child(settings, tmp_path, 'start'))
    assert 'output answered after 2 tool calls' in output
    await projector.catch_up()
    run, events = await the_run(projector.reader())
    assert run.agent_name == 'worker' and run.run_id.startswith('worker-wf-1')
    assert all(ATTEMPT_KEY not in e.metadata for e in events)
    assert shape(events) == await trail_without_dbos(event_log, projector)
