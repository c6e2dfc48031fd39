"""Run as a child process by test_durable_exec.py: a persisted agent inside a DBOS workflow.

    python dbos_child.py start WORKFLOW_ID SYSTEM_DB EFFECTS_FILE [--hang]
    python dbos_child.py recover WORKFLOW_ID SYSTEM_DB EFFECTS_FILE

`start` runs the workflow; with `--hang` its second tool call prints `in-tool call-1` and never
returns (the parent SIGKILLs it there). `recover` only launches DBOS, which recovers the pending
workflow, and waits for its result. The tool's side effect is a DBOS step that appends one line
to EFFECTS_FILE, so the file shows how many times each effect really happened.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from dbos import DBOS, SetWorkflowID
from pydantic_ai import Agent, RunContext
from pydantic_ai.durable_exec.dbos import DBOSDurability

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence

from agents import calls_then_answers

MODE, WORKFLOW_ID, SYSTEM_DB, EFFECTS = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
HANG = '--hang' in sys.argv[5:]

log = EventLog(Settings.from_env())
agent = Agent(
    calls_then_answers('step', calls=2),
    name='dbos_worker',
    capabilities=[StepPersistence(log=log, agent_name='worker'), DBOSDurability()],
)


@DBOS.step()
async def side_effect(call_id: str) -> str:
    if HANG and call_id == 'call-1':
        print('in-tool call-1', flush=True)
        await asyncio.Event().wait()  # SIGKILLed here, in the middle of the side effect
    with EFFECTS.open('a') as effects:
        effects.write(f'{call_id}\n')
    return f'{call_id} done'


@agent.tool
async def step(ctx: RunContext[None]) -> str:
    assert ctx.tool_call_id is not None
    return await side_effect(ctx.tool_call_id)


@DBOS.workflow()
async def persisted_run(prompt: str) -> str:
    return (await agent.run(prompt, conversation_id=WORKFLOW_ID)).output


async def main() -> None:
    async with log:
        DBOS(config={'name': 'stepstream-test', 'system_database_url': f'sqlite:///{SYSTEM_DB}'})
        DBOS.launch()  # in `recover` mode this is what starts the pending workflow again
        try:
            if MODE == 'start':
                with SetWorkflowID(WORKFLOW_ID):
                    output = await persisted_run('go')
            else:
                output = await (await DBOS.retrieve_workflow_async(WORKFLOW_ID)).get_result()
            print(f'output {output}', flush=True)
        finally:
            DBOS.destroy()


if __name__ == '__main__':
    asyncio.run(main())
