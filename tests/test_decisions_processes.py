"""A run paused in one process, decided by the CLI in others, resumed in a child process, then audited.

Each step is its own operating-system process, as on a platform: the test's process runs the agent
until it waits and runs the projector; `stepstream approve` and `complete` decide; a child
interpreter (tests/resume_child.py) resumes from the projection on disk; `stepstream audit verify`
reads the topics. They share nothing but the log and the projection.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from aiokafka.structs import TopicPartition
from test_decide_cli import cli

from stepstream import Settings
from stepstream.producer import EventLog
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.topics import log_end_offsets

from deferred_runs import run_until_waiting

pytestmark = pytest.mark.broker

CHILD = Path(__file__).with_name('resume_child.py')


async def test_paused_decided_by_the_cli_resumed_in_another_process_and_audited(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    await run_until_waiting(event_log, 'paused-1')
    await projector.wait_for(await event_log.flush())

    for args in [
        (
            'approve',
            'paused-1',
            'call-refund',
            '--args',
            '{"amount": 90, "reason": "partial"}',
            '--by',
            'alice',
        ),
        ('complete', 'paused-1', 'call-ask', '--result', '"visa"', '--note', 'asked by phone'),
        ('complete', 'paused-1', 'call-export', '--error', 'the export job crashed'),
    ]:
        code, out, err = await cli(settings, db_path, *args)
        assert code == 0, (args, out, err)
    code, out, _ = await cli(settings, db_path, 'deny', 'paused-1', 'call-refund', '--message', 'late')
    assert code == 1 and 'approved by alice' in out + _  # the first decision stands

    child = await asyncio.create_subprocess_exec(
        sys.executable,
        str(CHILD),
        'paused-1',
        'resumed-1',
        env={
            **os.environ,
            **settings.replace(db_path=str(db_path)).to_env(),
            'PYTHONPATH': os.pathsep.join(filter(None, [str(CHILD.parent), os.environ.get('PYTHONPATH')])),
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out_bytes, err_bytes = await child.communicate()
    assert child.returncode == 0, err_bytes.decode()[-3000:]
    assert out_bytes.decode().strip() == 'done'

    topics = (settings.topics.step_events_topic, settings.topics.tool_effects_topic)
    ends = await log_end_offsets(
        settings.kafka, {(t, p): 0 for t in topics for p in range(settings.topics.partitions)}
    )  # what the child wrote included: wait on the projection reaching the log's ends
    await projector.wait_for({TopicPartition(t, p): end for (t, p), end in ends.items()})
    reader = ProjectionReader.of(projector)
    paused, resumed = await reader.get_run('paused-1'), await reader.get_run('resumed-1')
    assert paused is not None and (paused.status, paused.resumed_by) == ('resumed', 'resumed-1')
    assert resumed is not None and (resumed.status, resumed.resumes, resumed.conversation_id) == (
        'completed',
        'paused-1',
        'conv-paused-1',
    )
    refund = await reader.get_tool_effect('paused-1', 'call-refund')
    assert refund is not None and [(r.resolution, r.resolved_by, r.applied) for r in refund.resolutions] == [
        ('approved', 'alice', True)
    ]

    code, out, err = await cli(settings, db_path, 'audit', 'verify', '--all', '--json')
    assert code == 0, (out, err)
    report = json.loads(out)
    chains = {r['run_id']: r['integrity']['chain'] for r in report['runs']}
    assert chains == {
        'paused-1': 'intact',
        'resumed-1': 'intact',
    }  # the mark and the decisions beside the trail
