"""Run as a child process by test_durable_prefect.py: one persisted agent run as a Prefect flow run.

    python prefect_child.py start FLOW_RUN_FILE CONVERSATION_ID [--hang | --hang-write | --deprecated] [--big]
    python prefect_child.py recover FLOW_RUN_FILE CONVERSATION_ID [--big]

`start` creates a flow run on the Prefect server (`PREFECT_API_URL`), writes its id to
FLOW_RUN_FILE and runs it here (durable_agent.py says where `--hang` and `--hang-write` stop it);
`recover` runs the same flow run again, as a retry of a crashed run does: Prefect returns the
cached results of the tasks that completed (model requests, tools, stepstream's writes) and runs
the rest. Tool calls are tasks, so the tool's side effect is the task's. `--deprecated` runs the
agent under the deprecated `PrefectAgent` wrapper.
"""

from __future__ import annotations

import asyncio
import os
import sys
import warnings
from pathlib import Path
from uuid import UUID

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.flow_engine import run_flow_async
from prefect.states import Scheduled
from pydantic_ai import RunContext
from pydantic_ai.durable_exec.prefect import PrefectAgent, PrefectDurability

from durable_agent import effect, make_agent, make_log, prompt

MODE, FLOW_RUN_FILE, CONVERSATION_ID = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
EFFECTS = Path(os.environ['STEPSTREAM_TEST_EFFECTS'])

DEPRECATED = '--deprecated' in sys.argv[4:]

log = make_log()
agent = make_agent(log, None if DEPRECATED else PrefectDurability(), 'prefect_worker')


@agent.tool
async def step(ctx: RunContext[None]) -> str:
    """Runs as a Prefect task, whose result a recovered flow run reuses."""
    assert ctx.tool_call_id is not None
    return await effect(EFFECTS, ctx.tool_call_id)


with warnings.catch_warnings():
    warnings.simplefilter('ignore')  # the wrapper's deprecation is the point here
    runner = PrefectAgent(agent) if DEPRECATED else agent  # the deprecated wrapper, which stepstream refuses


@flow(name='persisted-run')
async def persisted_run(conversation_id: str) -> str:
    return (await runner.run(prompt(), conversation_id=conversation_id)).output


async def main() -> None:
    parameters = {'conversation_id': CONVERSATION_ID}
    async with log, get_client() as client:
        if MODE == 'start':
            flow_run = await client.create_flow_run(persisted_run, parameters=parameters)
            FLOW_RUN_FILE.write_text(str(flow_run.id))
        else:
            flow_run_id = UUID(FLOW_RUN_FILE.read_text())
            # The killed process left its flow run `Running`: schedule it again, as a retry does.
            await client.set_flow_run_state(flow_run_id, Scheduled(), force=True)
            flow_run = await client.read_flow_run(flow_run_id)
        output = await run_flow_async(persisted_run, flow_run=flow_run, parameters=parameters)
    assert isinstance(output, str)
    print(f'output {output[:40]}', flush=True)


if __name__ == '__main__':
    asyncio.run(main())
