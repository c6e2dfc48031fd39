"""A workflow module that imports stepstream inside Temporal's sandbox (not passed through): refused."""

from __future__ import annotations

from pydantic_ai import Agent
from pydantic_ai.durable_exec.temporal import PydanticAIWorkflow, TemporalDurability
from pydantic_ai.models.test import TestModel
from temporalio import workflow

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence

agent = Agent(
    TestModel(),
    name='sandboxed',
    capabilities=[
        StepPersistence(log=EventLog(Settings.from_env()), agent_name='sandboxed'),
        TemporalDurability(),
    ],
)


@workflow.defn
class SandboxedRun(PydanticAIWorkflow):
    """Runs the agent above, whose stepstream the sandbox imported itself."""

    __pydantic_ai_agents__ = [agent]

    @workflow.run
    async def run(self, conversation_id: str) -> str:
        """The agent's output (never: stepstream refuses to run in the sandbox)."""
        return (await agent.run('go', conversation_id=conversation_id)).output
