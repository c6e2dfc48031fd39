"""Writer liveness on the real stack: a dead writer's run reads stale, a live call never reads crashed.

Short settings stand in for the defaults (a heartbeat every 0.2 s, stale after 2 s: ten intervals,
where the defaults are 5 s and 20 s) so that no test waits out a real window; each waits on what
the projection shows, read every 50 ms, never on a fixed time.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic_ai import Agent

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import RunRecord, ToolEffectRecord
from stepstream.topics import ensure_topics

from agents import calls_then_answers
from waits import until

CHILD = Path(__file__).with_name('liveness_child.py')
STEPSTREAM = str(Path(sys.executable).parent / 'stepstream')
INTERVAL_S = 0.2
STALE_AFTER_S = 2.0

pytestmark = pytest.mark.broker


@pytest.fixture
def live(settings: Settings) -> Settings:
    return settings.replace(heartbeat_interval_s=INTERVAL_S, stale_after_s=STALE_AFTER_S)


@pytest.fixture
async def reader(live: Settings, db_path: Path) -> AsyncIterator[ProjectionReader]:
    async with Projector(live, db_path=db_path) as projector:
        yield ProjectionReader.of(projector)


async def state(reader: ProjectionReader, run_id: str) -> tuple[RunRecord | None, ToolEffectRecord | None]:
    """The run, then its first effect: two reads, in that order, so that an effect is never read
    from an earlier projection than its run (a run read `cancelled` has its call read after it)."""
    run = await reader.get_run(run_id)
    effects = await reader.list_tool_effects(run_id)
    return run, (effects[0] if effects else None)


def reads(run_status: str, doubt: str) -> Callable[[tuple[RunRecord | None, ToolEffectRecord | None]], bool]:
    def holds(seen: tuple[RunRecord | None, ToolEffectRecord | None]) -> bool:
        run, effect = seen
        return run is not None and effect is not None and run.status == run_status and effect.doubt == doubt

    return holds


async def cli(settings: Settings, db_path: Path, *args: str) -> tuple[int, str, str]:
    """The installed command against this test's projection (read while the projector writes it)."""
    process = await asyncio.create_subprocess_exec(
        STEPSTREAM,
        *args,
        env={**os.environ, **settings.replace(db_path=str(db_path)).to_env()},
        cwd=db_path.parent,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def child_in_tool(settings: Settings, run_id: str) -> asyncio.subprocess.Process:
    await ensure_topics(settings)
    env = {**os.environ, **settings.to_env(), 'PYTHONPATH': str(CHILD.parent)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(CHILD), run_id, env=env, stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    line = await asyncio.wait_for(child.stdout.readline(), 60)
    if line != b'in tool\n':
        child.kill()
        await child.wait()
        raise AssertionError(f'the child did not reach its tool (printed {line!r}, exit {child.returncode})')
    return child


async def test_a_killed_writer_reads_stale_and_its_call_unknown_after_crash(
    live: Settings, reader: ProjectionReader
) -> None:
    child = await child_in_tool(live, 'killed')
    try:
        await until(lambda: state(reader, 'killed'), 'the run in flight', holds=reads('running', 'in_flight'))
    finally:
        child.send_signal(signal.SIGKILL)
        await child.wait()
    run, _ = await until(
        lambda: state(reader, 'killed'),
        'the run stale after the kill',
        holds=reads('stale', 'unknown_after_crash'),
    )
    assert run is not None and run.ended_at is None  # nothing was written for it: it is read stale
    [swept] = await reader.list_unresolved_tool_effects()
    assert (swept.tool_call_id, swept.doubt) == ('call-0', 'unknown_after_crash')


async def test_a_slow_tool_of_a_live_writer_stays_in_flight_for_its_whole_duration(
    live: Settings, reader: ProjectionReader, db_path: Path
) -> None:
    entered, release = asyncio.Event(), asyncio.Event()
    async with EventLog(live) as log:
        agent = Agent(calls_then_answers('slow'), capabilities=[StepPersistence(log=log, run_id='slow-run')])

        @agent.tool_plain
        async def slow() -> str:
            entered.set()
            await release.wait()
            return 'done'

        task = asyncio.create_task(agent.run('go'))
        await asyncio.wait_for(entered.wait(), 30)
        run, effect = await until(
            lambda: state(reader, 'slow-run'), 'the run in flight', holds=reads('running', 'in_flight')
        )
        assert effect is not None and effect.started_at is not None
        # Quiet for three stale windows, yet read in flight at every look: heartbeats alone carry it.
        quiet_until = effect.started_at + timedelta(seconds=3 * STALE_AFTER_S)
        seen = 0

        def in_flight_throughout(now: tuple[RunRecord | None, ToolEffectRecord | None]) -> bool:
            nonlocal seen
            seen += 1
            assert reads('running', 'in_flight')(now), f'a live call read otherwise: {now!r}'
            assert now[0] is not None and now[0].last_record_at is not None
            return now[0].last_record_at > quiet_until

        await until(
            lambda: state(reader, 'slow-run'), 'heartbeats to carry the run', holds=in_flight_throughout
        )
        assert seen > 10 and log.liveness.sent >= 3 * STALE_AFTER_S / INTERVAL_S / 2

        # The operator's views say so too, and resolving it is refused while it runs.
        code, out, _ = await cli(live, db_path, 'unresolved', '--json')
        assert code == 0 and [(e['tool_call_id'], e['status']) for e in json.loads(out)] == [
            ('call-0', 'in_flight')
        ]
        code, _, err = await cli(live, db_path, 'resolve', 'slow-run', 'call-0', '--happened', '--note', 'x')
        assert code == 1 and 'in flight' in err and '--force' in err
        release.set()
        await task
        await log.flush()
    run, effect = await until(
        lambda: state(reader, 'slow-run'),
        'the run completed',
        holds=lambda s: s[0] is not None and s[0].status == 'completed',
    )
    assert effect is not None and (effect.status, effect.doubt) == ('completed', None)
    assert (
        run is not None
        and run.gaps == []
        and [e.seq for e in await reader.list_events('slow-run')]
        == sorted(e.seq for e in await reader.list_events('slow-run'))
    )


async def test_a_paused_writer_reads_stale_then_running_again_and_sigterm_ends_its_run(
    live: Settings, reader: ProjectionReader
) -> None:
    child = await child_in_tool(live, 'paused')
    try:
        await until(lambda: state(reader, 'paused'), 'the run in flight', holds=reads('running', 'in_flight'))
        child.send_signal(signal.SIGSTOP)
        await until(
            lambda: state(reader, 'paused'),
            'the run stale while stopped',
            holds=reads('stale', 'unknown_after_crash'),
        )
        child.send_signal(signal.SIGCONT)
        await until(
            lambda: state(reader, 'paused'), 'the run running again', holds=reads('running', 'in_flight')
        )
        child.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(child.wait(), 30) == -signal.SIGTERM  # it still dies of SIGTERM
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
            await child.wait()
    run, effect = await until(
        lambda: state(reader, 'paused'),
        'the run cancelled by SIGTERM',
        holds=lambda s: s[0] is not None and s[0].status == 'cancelled',
    )
    assert run is not None and run.error == 'the process received SIGTERM while the run was open'
    assert effect is not None and effect.doubt == 'unknown_after_crash'  # the call will not finish now
