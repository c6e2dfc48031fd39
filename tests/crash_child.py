"""Run as a child process by test_crash.py: an agent whose second tool call never returns."""

from __future__ import annotations

import asyncio
import sys

from pydantic_ai import Agent

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence

from agents import calls_then_answers


async def main(run_id: str) -> None:
    async with EventLog(Settings.from_env()) as log:
        agent = Agent(
            calls_then_answers('step', calls=3), capabilities=[StepPersistence(log=log, run_id=run_id)]
        )
        calls: list[int] = []

        @agent.tool_plain
        async def step() -> str:
            calls.append(1)
            if len(calls) == 2:
                await asyncio.sleep(3600)  # SIGKILLed here, in the middle of the side effect
            return f'step {len(calls)} done'

        await agent.run('go')


if __name__ == '__main__':
    asyncio.run(main(sys.argv[1]))
