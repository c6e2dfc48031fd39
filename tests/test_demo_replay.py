"""`make run`'s last lines: the replay and the fork of its orchestrator run, pasted as printed."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_demo import STEPSTREAM, stepstream, user_env

from waits import until_sync

pytestmark = [pytest.mark.broker, pytest.mark.once]  # the demo's agents, not the broker, are under test


def pasted(cwd: Path, line: str) -> subprocess.CompletedProcess[str]:
    """`line` run by a shell, as a user pastes it, with the checkout's `stepstream` on the PATH."""
    env = user_env() | {'PATH': f'{Path(STEPSTREAM).parent}{os.pathsep}{os.environ.get("PATH", "")}'}
    return subprocess.run(line, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_demo_ends_with_a_replay_and_a_fork_that_work_as_printed(tmp_path: Path) -> None:
    try:
        stepstream(tmp_path, 'stack', 'up')
        out = stepstream(tmp_path, 'demo').stdout
        *_, heading, replay, fork = out.rstrip().splitlines()
        assert heading.startswith('Replay its orchestrator run')
        found = re.fullmatch(
            r'  stepstream replay (orchestrator-\S+) --agent stepstream\.demo:orchestrator', replay
        )
        assert found is not None, replay
        run_id = found.group(1)
        assert f'== events of {run_id} (orchestrator, completed)' in out  # this demo's orchestrator run
        assert fork == f'{replay} --from-step 2 --model stepstream.demo:cautious_model'

        replayed = pasted(tmp_path, replay)
        assert replayed.returncode == 0, replayed.stderr[-3000:]
        assert replayed.stdout == f'{run_id}: matched after 3 step(s), tools recorded\n'

        forked = pasted(tmp_path, fork)
        assert forked.returncode == 0, forked.stderr[-3000:]
        head = f'{run_id}: forked after 1 step(s), tools recorded: forked at step 2 into '
        assert forked.stdout.startswith(head), forked.stdout
        fork_id = forked.stdout.removeprefix(head).strip()
        assert fork_id.startswith('orchestrator-') and fork_id != run_id

        # The fork is a run on the log: it names where it came from, and its model did not publish.
        def applied() -> dict[str, Any] | None:
            runs = json.loads(stepstream(tmp_path, 'runs', '--json').stdout)
            return next((r for r in runs if r['run_id'] == fork_id and r['status'] == 'completed'), None)

        run = until_sync(applied, 'the stack to apply the fork', 120)
        metadata = run['metadata']
        assert (metadata['stepstream.forked_from'], metadata['stepstream.forked_at_step']) == (run_id, '2')
        assert run['conversation_id'] == 'release-demo'
        assert 'tool_call_started' not in stepstream(tmp_path, 'events', fork_id).stdout  # no tool ran
        answer = stepstream(tmp_path, 'snapshot', fork_id).stdout.rstrip().splitlines()[-1]
        assert "text: researched: the release adds delta snapshots (3 documents match 'changelog')" in answer
        assert answer.endswith('; not publishing until a person has read the notes')
    finally:
        down = stepstream(tmp_path, 'stack', 'down', check=False)
    assert down.returncode == 0, down.stderr
