"""A workflow running the deprecated `TemporalAgent` wrapper around a persisted agent: refused."""

from __future__ import annotations

import warnings

from pydantic_ai import Agent
from pydantic_ai.durable_exec.temporal import PydanticAIWorkflow, TemporalAgent
from pydantic_ai.models.test import TestModel
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from stepstream import Settings
    from stepstream.producer import EventLog, StepPersistence

log = EventLog(Settings.from_env())
with warnings.catch_warnings():
    warnings.simplefilter('ignore')  # the wrapper's deprecation is the point here
    agent = TemporalAgent(
        Agent(
            TestModel(), name='deprecated', capabilities=[StepPersistence(log=log, agent_name='deprecated')]
        )
    )


@workflow.defn
class DeprecatedRun(PydanticAIWorkflow):
    """Runs the wrapped agent (never: stepstream refuses the wrapper)."""

    __pydantic_ai_agents__ = [agent]

    @workflow.run
    async def run(self, conversation_id: str) -> str:
        """The agent's output."""
        return (await agent.run('go', conversation_id=conversation_id)).output
