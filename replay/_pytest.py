"""Recorded runs as test cases: `recorded_runs` for `pytest.mark.parametrize`, `assert_replays` to check one.

```python
import pytest
from stepstream.replay import assert_replays, recorded_runs
from myapp.agents import support

@pytest.mark.parametrize('run_id', recorded_runs(agent_name='support', last=50))
def test_support_still_does_what_it_did(run_id):
    assert_replays(support, run_id)
```

Both read the projection the settings name (`STEPSTREAM_*`, as every command does); both are
synchronous, for collection time and plain tests. In an async test, await `replay_run` instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

from stepstream.replay._report import ReplayReport, ToolMode
from stepstream.replay._run import replay_run
from stepstream.settings import Settings


def recorded_runs(
    *,
    agent_name: str | None = None,
    conversation_id: str | None = None,
    status: str | None = None,
    last: int = 20,
    settings: Settings | None = None,
) -> list[str]:
    """The ids of the newest `last` runs matching the filters, newest first: one test case each."""
    from stepstream.readmodel import ProjectionReader

    async def listed() -> list[str]:
        async with ProjectionReader.from_settings(settings or Settings.from_env()) as reader:
            runs = await reader.list_runs(
                conversation_id=conversation_id,
                status=status,
                agent_name=agent_name,
                newest_first=True,
                limit=last,
            )
        return [run.run_id for run in runs]

    return asyncio.run(listed())


def assert_replays(
    agent: Any,
    run_id: str,
    *,
    tools: ToolMode = 'recorded',
    deps: Any = None,
    settings: Settings | None = None,
) -> ReplayReport:
    """Replay `run_id` with `agent`; unless it matched, fail with the report (where, what, the diff)."""
    from stepstream.readmodel import ProjectionReader

    async def replayed() -> ReplayReport:
        async with ProjectionReader.from_settings(settings or Settings.from_env()) as reader:
            return await replay_run(agent, run_id, reader=reader, tools=tools, deps=deps)

    report = asyncio.run(replayed())
    assert report.ok, report.text()
    return report
