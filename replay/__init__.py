"""Replay: re-execute an agent against a recorded run, with no model called, and report the first divergence.

```python
from stepstream.readmodel import ProjectionReader
from stepstream.replay import replay_run

async with ProjectionReader.from_settings(settings) as reader:
    report = await replay_run(agent, 'support-0193...', reader=reader)
assert report.ok, report.text()
```

See docs/replay.md for the workflow and the normalisation rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.replay._fork import fork_run_from_step
    from stepstream.replay._pytest import assert_replays, recorded_runs
    from stepstream.replay._recording import NotReplayable, Recording, load_recording
    from stepstream.replay._report import Divergence, ReplayReport
    from stepstream.replay._run import replay_run

_WHERE = {
    'Divergence': 'stepstream.replay._report',
    'NotReplayable': 'stepstream.replay._recording',
    'Recording': 'stepstream.replay._recording',
    'ReplayReport': 'stepstream.replay._report',
    'assert_replays': 'stepstream.replay._pytest',
    'fork_run_from_step': 'stepstream.replay._fork',
    'load_recording': 'stepstream.replay._recording',
    'recorded_runs': 'stepstream.replay._pytest',
    'replay_run': 'stepstream.replay._run',
}
"""Where each public name lives: imported on first use, so a command pays only for what it uses."""

__all__ = [
    'Divergence',
    'NotReplayable',
    'Recording',
    'ReplayReport',
    'assert_replays',
    'fork_run_from_step',
    'load_recording',
    'recorded_runs',
    'replay_run',
]

__getattr__ = lazy_exports(__name__, _WHERE)
