"""Run as a child process by test_durable_exec.py: a persisted agent inside a DBOS workflow.

    python dbos_child.py start WORKFLOW_ID SYSTEM_DB EFFECTS_FILE [FLAGS]
    python dbos_child.py recover WORKFLOW_ID SYSTEM_DB EFFECTS_FILE [--big]

`start` runs the workflow; durable_agent.py says where `--hang` and `--hang-write` stop it and
what `--big` changes, and `--deprecated` runs it under the deprecated `DBOSAgent` wrapper.
`recover` only launches DBOS, which recovers the pending workflow, and waits for its result.
The tool's side effect is a DBOS step.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from dbos import DBOS, SetWorkflowID
from pydantic_ai import RunContext
from pydantic_ai.durable_exec.dbos import DBOSAgent, DBOSDurability

from durable_agent import effect, make_agent, make_log, prompt

MODE, WORKFLOW_ID, SYSTEM_DB, EFFECTS = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])

DEPRECATED = '--deprecated' in sys.argv[5:]

log = make_log()
agent = make_agent(log, None if DEPRECATED else DBOSDurability(), 'dbos_worker')


@DBOS.step()
async def side_effect(call_id: str) -> str:
    return await effect(EFFECTS, call_id)


@agent.tool
async def step(ctx: RunContext[None]) -> str:
    assert ctx.tool_call_id is not None
    return await side_effect(ctx.tool_call_id)


runner = DBOSAgent(agent) if DEPRECATED else agent  # the deprecated wrapper, which stepstream refuses


@DBOS.workflow()
async def persisted_run() -> str:
    return (await runner.run(prompt(), conversation_id=WORKFLOW_ID)).output


async def main() -> None:
    async with log:
        DBOS(config={'name': 'stepstream-test', 'system_database_url': f'sqlite:///{SYSTEM_DB}'})
        DBOS.launch()  # in `recover` mode this is what starts the pending workflow again
        try:
            if MODE == 'start':
                with SetWorkflowID(WORKFLOW_ID):
                    output = await persisted_run()
            else:
                output = await (await DBOS.retrieve_workflow_async(WORKFLOW_ID)).get_result()
            print(f'output {output[:40]}', flush=True)
        finally:
            DBOS.destroy()


if __name__ == '__main__':
    asyncio.run(main())
