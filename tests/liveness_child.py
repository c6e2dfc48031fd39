"""Run as a child process by test_liveness_e2e.py: an agent whose tool runs until the process is stopped.

It prints `in tool` once the tool's `started` is acknowledged, so the test waits on that line, not
on time. The settings (heartbeat interval included) come from the environment.
"""

from __future__ import annotations

import asyncio
import sys

from pydantic_ai import Agent

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence

from agents import calls_then_answers


async def main(run_id: str) -> None:
    async with EventLog(Settings.from_env()) as log:
        agent = Agent(calls_then_answers('publish'), capabilities=[StepPersistence(log=log, run_id=run_id)])

        @agent.tool_plain
        async def publish() -> str:
            print('in tool', flush=True)
            await asyncio.sleep(3600)  # killed, stopped or terminated here, in the middle of the side effect
            return 'published'

        await agent.run('go')


if __name__ == '__main__':
    asyncio.run(main(sys.argv[1]))
