"""`stepstream deferred`, `approve`, `deny`, `complete` and `status` against a real broker and projection.

A run ends waiting on an approval, a question and an outside call (tests/deferred_runs.py); the
commands list them, decide them (the first decision stands, a later one exits 1 naming it), refuse
a call that does not wait, and `status` counts what waits, as a user runs them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from stepstream import Settings
from stepstream.producer import EventLog
from stepstream.projector import Projector, ProjectorObserver
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import ToolEffectRecord

from deferred_runs import REFUND_ARGS, run_until_waiting

pytestmark = pytest.mark.broker

STEPSTREAM = str(Path(sys.executable).parent / 'stepstream')


async def cli(settings: Settings, db_path: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        STEPSTREAM,
        *args,
        env={**os.environ, **settings.replace(db_path=str(db_path)).to_env()},
        cwd=db_path.parent,  # no .stepstream stack of the checkout's `make run` in the way
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_list_decide_refuse_and_count_the_calls_that_wait(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    await run_until_waiting(event_log, 'wd')
    await projector.wait_for(await event_log.flush())

    code, out, err = await cli(settings, db_path, 'deferred', '--json')
    assert code == 0, err
    assert {c['tool_call_id']: c['kind'] for c in json.loads(out)} == {
        'call-refund': 'approval',
        'call-ask': 'question',
        'call-export': 'external',
    }
    code, out, _ = await cli(settings, db_path, 'deferred', '--kind', 'approval', '--agent', 'refunds')
    assert code == 0 and [line.split()[:4] for line in out.splitlines()[2:]] == [
        ['wd', 'call-refund', 'refund', 'approval']
    ]
    assert '"amount":120' in out  # the arguments as stored
    code, out, _ = await cli(settings, db_path, 'status')
    assert 'tool calls waiting for a decision: 3 (approval 1, external 1, question 1;' in out
    code, out, _ = await cli(settings, db_path, 'status', '--json')
    assert json.loads(out)['runs']['waiting_calls'] == {'approval': 1, 'external': 1, 'question': 1}
    waiting = await deferred_gauges(projector)
    assert waiting.pop('stepstream_deferred_oldest_age_seconds', {})[()] > 0
    assert waiting == {'stepstream_deferred_calls': {('approval',): 1, ('question',): 1, ('external',): 1}}

    changed = json.dumps({**REFUND_ARGS, 'amount': 100})
    code, out, err = await cli(
        settings, db_path, 'approve', 'wd', 'call-refund', '--args', changed, '--note', 'ok', '--by', 'alice'
    )
    assert code == 0, err
    assert out.startswith('approved call-refund of wd by alice: with arguments {"amount":100')

    # Decided already: a second decision is refused, naming the one that stands.
    code, out, err = await cli(
        settings, db_path, 'deny', 'wd', 'call-refund', '--message', 'no', '--by', 'bob'
    )
    assert code == 1 and 'Traceback' not in err
    assert 'the decision that stands: approved by alice at ' in err and '(ok)' in err

    code, out, err = await cli(settings, db_path, 'complete', 'wd', 'call-export', '--result', '{"rows": 3}')
    assert code == 0, err
    assert out.startswith('returned call-export of wd by ') and 'result {"rows":3}' in out
    code, out, err = await cli(settings, db_path, 'complete', 'wd', 'call-ask', '--error', 'gone', '--json')
    assert code == 0, err
    answer = json.loads(out)
    assert answer['stands'] is True and answer['decision']['resolution'] == 'failed'
    assert answer['recorded']['error'] == 'gone'

    code, out, err = await cli(settings, db_path, 'approve', 'wd', 'call-lookup')  # it ran: nothing to decide
    assert code == 1 and 'does not wait for a decision: it is completed' in err and 'Traceback' not in err
    code, out, err = await cli(settings, db_path, 'approve', 'wd', 'call-nope')
    assert code == 1 and "has no tool call 'call-nope'" in err

    code, out, _ = await cli(settings, db_path, 'deferred', '--json')
    assert (code, json.loads(out)) == (0, [])
    code, out, _ = await cli(settings, db_path, 'status')
    assert 'tool calls waiting for a decision: 0 (approval 0, external 0, question 0;' in out
    assert await deferred_gauges(projector) == {
        'stepstream_deferred_calls': {('approval',): 0, ('question',): 0, ('external',): 0},
        'stepstream_deferred_oldest_age_seconds': {(): 0},
    }
    await projector.wait_for(await event_log.flush())
    effects = {e.tool_call_id: e for e in await projector_effects(projector, 'wd')}
    assert [(r.resolution, r.resolved_by, r.applied) for r in effects['call-refund'].resolutions] == [
        ('approved', 'alice', True)
    ]


async def test_a_decision_the_call_cannot_take_is_refused_without_writing(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    await run_until_waiting(event_log, 'wq')
    await projector.wait_for(await event_log.flush())
    code, _, err = await cli(settings, db_path, 'approve', 'wq', 'call-ask')  # a question is answered
    assert code == 1 and 'waits for an answer, not an approval' in err and 'Traceback' not in err
    assert 'nothing was written' in err
    code, _, err = await cli(settings, db_path, 'complete', 'wq', 'call-refund', '--result', '1')
    assert code == 1 and 'waits for an approval: approve or deny it' in err


async def projector_effects(projector: Projector, run_id: str) -> list[ToolEffectRecord]:
    return await ProjectionReader.of(projector).list_tool_effects(run_id)


async def deferred_gauges(projector: Projector) -> dict[str, dict[tuple[str, ...], float]]:
    """What the projector's `/metrics` shows of the calls waiting: each deferred gauge's samples."""
    observer = ProjectorObserver(projector, ProjectionReader.of(projector))
    return {
        family.name: {tuple(s.labels.values()): s.value for s in family.samples}
        for family in await observer.gauges()
        if family.name.startswith('stepstream_deferred')
    }
