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

from stepstream.replay._fork import fork_run_from_step
from stepstream.replay._pytest import assert_replays, recorded_runs
from stepstream.replay._recording import NotReplayable, Recording, load_recording
from stepstream.replay._report import Divergence, ReplayReport
from stepstream.replay._run import replay_run

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
