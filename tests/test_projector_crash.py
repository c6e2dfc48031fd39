"""The projector SIGKILLed at random moments, many times, converges to a clean rebuild.

Half the kills are aimed: the child (`projector_child.py`) announces each shard commit, and the
test kills it between a batch's staging and its commit, so kills are shown to land mid-batch.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from pathlib import Path

import pytest
from pydantic_ai import Agent
from pydantic_ai.capabilities import ProcessHistory
from pydantic_ai.messages import ModelMessage, ModelRequest, UserPromptPart

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import rebuild, verify_paths
from stepstream.readmodel import ProjectionReader

from agents import turns_then_answers
from brokers import tansu_only
from waits import wait_applied

pytestmark = [pytest.mark.broker, pytest.mark.soak]

CHILD = Path(__file__).with_name('projector_child.py')
KILLS = int(os.environ.get('STEPSTREAM_SOAK_KILLS', '10'))
"""SIGKILLs of the projector; `make soak` raises it (and the runs written with it)."""
RUNS = 15 * KILLS


def compacting(messages: list[ModelMessage]) -> list[ModelMessage]:
    """Rewrites history once it grows, so some snapshots share less than the one before."""
    if len(messages) <= 4:
        return messages
    return [ModelRequest(parts=[UserPromptPart('(compacted)')]), *messages[-2:]]


async def produce(log: EventLog, runs: int) -> None:
    rng = random.Random(7)
    for i in range(runs):
        calls = rng.randint(1, 4)
        capabilities: list[object] = [StepPersistence(log=log, run_id=f'run-{i:04d}')]
        if i % 3 == 0:
            capabilities.insert(0, ProcessHistory(compacting))
        agent = Agent(turns_then_answers('work', calls), capabilities=capabilities)  # type: ignore[arg-type]

        @agent.tool_plain
        def work() -> str:
            return 'w' * rng.randint(10, 400)

        await agent.run(f'task {i}', conversation_id=f'conv-{i % 17}')
        await asyncio.sleep(0.1)  # spread the writes over the whole kill window
    await log.flush()


async def start_projector(
    settings: Settings, db_path: Path, marks: Path | None = None
) -> asyncio.subprocess.Process:
    """`stepstream projector`; with `marks`, the child that announces each commit in that file."""
    env = {**os.environ, **settings.replace(db_path=str(db_path)).to_env()}
    command = ['-m', 'stepstream.cli']
    if marks is not None:
        env |= {'STEPSTREAM_TEST_BATCH_MARKS': str(marks), 'PYTHONPATH': str(CHILD.parent)}
        command = [str(CHILD)]
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *command,
        'projector',
        '--max-batch-records',
        '200',
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )


def in_a_batch(marks: Path) -> bool:
    """Whether the child's last announced commit has begun and not ended."""
    lines = marks.read_text().split() if marks.exists() else []
    return bool(lines) and lines[-1] == 'b'


async def kill_mid_batch(child: asyncio.subprocess.Process, marks: Path, timeout: float = 10.0) -> bool:
    """SIGKILL the child inside a batch (staged, not committed); True if it was caught in one."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not in_a_batch(marks) and loop.time() < deadline:
        await asyncio.sleep(0.002)
    child.send_signal(signal.SIGKILL)
    await child.wait()
    return in_a_batch(marks)  # still `b` after the kill: that commit never ended


@tansu_only(
    'the projector writes state and offsets in one RocksDB batch whatever the broker; the Apache '
    'Kafka pass SIGKILLs the projector in test_hostile_log.py and keeps to CI time'
)
async def test_sigkilled_projector_equals_clean_rebuild(settings: Settings, tmp_path: Path) -> None:
    db_path = tmp_path / 'incremental'
    rng = random.Random(11)
    async with EventLog(settings) as log:
        producer = asyncio.create_task(produce(log, runs=RUNS))
        kills = mid_batch = 0
        while kills < KILLS or not producer.done():
            marks = tmp_path / f'marks-{kills}'
            child = await start_projector(settings, db_path, marks)
            await asyncio.sleep(rng.uniform(0.8, 2.5))  # the child needs ~1 s to import and start
            if kills % 2:
                mid_batch += await kill_mid_batch(child, marks)
            else:
                child.send_signal(signal.SIGKILL)
                await child.wait()
            kills += 1
        await producer
        assert mid_batch >= 1, f'none of {kills} kills landed between a batch and its commit'
        written = log.position

    # One last, uninterrupted run to the end of the log, then a graceful stop.
    child = await start_projector(settings, db_path)
    assert child.stdout is not None
    assert b'projector:' in await asyncio.wait_for(child.stdout.readline(), 60)  # signal handlers are set
    try:
        await wait_applied(db_path, written)
    finally:
        child.send_signal(signal.SIGTERM)
        assert await child.wait() == 0

    await rebuild(settings, tmp_path / 'clean')
    equal, difference = verify_paths(db_path, tmp_path / 'clean')
    assert difference is None, str(difference)

    records_written = sum(written.values())
    reader = ProjectionReader.open(db_path)
    try:
        runs = await reader.list_runs()
        assert len(runs) == RUNS
        # Every record applied exactly once: per-run counts add up to what the log holds.
        assert sum(r.event_count for r in runs) == records_written
        assert all(r.status == 'completed' and r.gaps == [] and r.event_count == r.last_seq + 1 for r in runs)
        assert await reader.list_unresolved_tool_effects() == []
        status = await reader.status()
        assert status.dead_lettered == 0
        assert len(await reader.list_runs(conversation_id='conv-3')) == len(range(3, RUNS, 17))
    finally:
        reader.close()
    assert equal > records_written
