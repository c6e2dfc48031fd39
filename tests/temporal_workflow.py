"""The Temporal workflow of temporal_child.py: one persisted agent run."""

from __future__ import annotations

from pydantic_ai.durable_exec.temporal import PydanticAIWorkflow
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_agent import prompt
    from temporal_agent import agent


@workflow.defn
class PersistedRun(PydanticAIWorkflow):
    """Runs the agent of temporal_agent.py once, in the conversation it is given."""

    __pydantic_ai_agents__ = [agent]

    @workflow.run
    async def run(self, conversation_id: str) -> str:
        """The agent's output."""
        return (await agent.run(prompt(), conversation_id=conversation_id)).output
