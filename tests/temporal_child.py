"""Run as a child process by test_durable_temporal.py: a Temporal worker for one persisted run.

    python temporal_child.py start ADDRESS WORKFLOW_ID [--hang | --hang-write] [--big]
    python temporal_child.py recover ADDRESS WORKFLOW_ID [--big]

`start` starts the workflow and runs a worker until it ends (durable_agent.py says where `--hang`
and `--hang-write` stop it); `recover` runs a worker, which the server hands the pending
workflow's tasks, until the workflow ends. Both print the output. Tool calls are activities.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
from temporalio.client import Client
from temporalio.worker import Worker

from temporal_agent import log
from temporal_workflow import PersistedRun

MODE, ADDRESS, WORKFLOW_ID = sys.argv[1], sys.argv[2], sys.argv[3]
TASK_QUEUE = f'stepstream-{WORKFLOW_ID}'


async def main() -> None:
    logging.basicConfig(level=logging.WARNING)  # a failing workflow task is logged, not raised
    async with log:
        client = await Client.connect(ADDRESS, plugins=[PydanticAIPlugin()])
        async with Worker(client, task_queue=TASK_QUEUE, workflows=[PersistedRun]):
            if MODE == 'start':
                handle = await client.start_workflow(
                    PersistedRun.run, WORKFLOW_ID, id=WORKFLOW_ID, task_queue=TASK_QUEUE
                )
            else:
                handle = client.get_workflow_handle(WORKFLOW_ID)
            output = await handle.result()
        print(f'output {output[:40]}', flush=True)


if __name__ == '__main__':
    asyncio.run(main())
    # The worker's core threads can outlive the event loop and abort interpreter shutdown
    # (`PyGILState_Release` while finalizing); everything this process owed is flushed by now.
    sys.stdout.flush()
    os._exit(0)
