"""`make run`: the demo on a durable stack, twice, in a real child process of its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def run_demo(data_dir: Path) -> str:
    done = subprocess.run(
        [sys.executable, '-m', 'stepstream.cli', 'demo', '--data-dir', str(data_dir)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_demo_shows_lineage_crash_and_persisted_history(tmp_path: Path) -> None:
    first = run_demo(tmp_path)
    assert '1 orchestrator run(s)' in first
    lineage = first.split('== lineage')[1].split('== events')[0]
    assert '[orchestrator, completed]' in lineage
    assert '└── researcher-' in lineage and '[researcher, completed]' in lineage
    assert '└── publisher-' in lineage and '[publisher, running]' in lineage
    unresolved = first.split('== unresolved tool effects')[1]
    assert 'send_announcement' in unresolved and 'unknown_after_crash' in unresolved
    assert 'announce:#releases' in unresolved

    # The log lives in SeaweedFS under the data dir: remove the projection and it is rebuilt.
    shutil.rmtree(tmp_path / 'projection')
    second = run_demo(tmp_path)
    assert '2 orchestrator run(s)' in second
    first_orchestrator = lineage.splitlines()[1].split()[0]
    assert first_orchestrator.startswith('orchestrator-')
    assert first_orchestrator in second
    unresolved_rows = second.split('== unresolved tool effects')[1].split('\n\n')[0].splitlines()[3:]
    assert len(unresolved_rows) == 2 and all('unknown_after_crash' in row for row in unresolved_rows)
