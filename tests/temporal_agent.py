"""The persisted agent of the Temporal child (temporal_child.py), imported passed through the sandbox.

The workflow module (temporal_workflow.py) imports this one inside
`workflow.unsafe.imports_passed_through()`, so the worker's activities and its workflows share
one agent, one `StepPersistence` and one started `EventLog`.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from pydantic_ai import RunContext
from pydantic_ai.durable_exec.temporal import TemporalDurability
from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityConfig

from durable_agent import effect, make_agent, make_log

EFFECTS = Path(os.environ.get('STEPSTREAM_TEST_EFFECTS', 'effects.txt'))

log = make_log()
# A killed worker's activity is retried once its start-to-close timeout has passed.
agent = make_agent(
    log,
    TemporalDurability(
        activity_config=ActivityConfig(
            start_to_close_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=100)),
        )
    ),
    'temporal_worker',
)


@agent.tool
async def step(ctx: RunContext[None]) -> str:
    """Runs as a Temporal activity, so its side effect is the activity's."""
    assert ctx.tool_call_id is not None
    return await effect(EFFECTS, ctx.tool_call_id)
