"""A producer process SIGKILLed in the middle of a tool body."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from pydantic_ai.messages import ModelRequest, ModelResponse, UserPromptPart

from stepstream import Settings
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader, continue_run
from stepstream.topics import ensure_topics

from agents import tool_returns

pytestmark = pytest.mark.broker

CHILD = Path(__file__).with_name('crash_child.py')


async def test_sigkill_mid_tool_leaves_unknown_effect_and_last_settled_snapshot(
    settings: Settings, projector: Projector
) -> None:
    await ensure_topics(settings)
    env = {**os.environ, **settings.to_env(), 'PYTHONPATH': str(CHILD.parent)}
    child = await asyncio.create_subprocess_exec(sys.executable, str(CHILD), 'crashy', env=env)
    reader = ProjectionReader.of(projector)
    try:
        for _ in range(600):
            effect = await reader.get_tool_effect('crashy', 'call-1')
            if effect is not None:
                break
            assert child.returncode is None, 'the child exited before its second tool ran'
            await asyncio.sleep(0.05)
        else:
            raise AssertionError('the second tool never started')
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGKILL)
        await child.wait()
    assert child.returncode == -signal.SIGKILL
    await projector.catch_up()

    [unresolved] = await reader.list_unresolved_tool_effects('crashy')
    # Killed a moment ago: in flight until its writer has been silent for `stale_after_s`
    # (test_liveness_e2e.py shows it turn unknown_after_crash then).
    assert (unresolved.tool_call_id, unresolved.tool_name, unresolved.status) == ('call-1', 'step', 'started')
    assert [e.tool_call_id for e in await reader.list_unresolved_tool_effects()] == ['call-1']
    run = await reader.get_run('crashy')
    assert run is not None and run.status == 'running' and run.ended_at is None
    kinds = [e.kind for e in await reader.list_events('crashy')]
    assert 'run_completed' not in kinds and 'run_failed' not in kinds
    assert kinds[-1] == 'tool_call_started'

    history = await continue_run(reader, run_id='crashy')
    assert [type(m) for m in history] == [ModelRequest, ModelResponse, ModelRequest]
    assert isinstance(history[0].parts[0], UserPromptPart)
    assert [(p.tool_call_id, p.content) for p in tool_returns(history)] == [('call-0', 'step 1 done')]
