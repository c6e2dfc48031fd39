"""From recording a decision to seeing it applied, on a running stack (issue 49, item 6).

```sh
.venv/bin/python -m bench.decision_latency                # 30 decisions each way, Tansu
STEPSTREAM_EMBEDDED_BROKER=kafka .venv/bin/python -m bench.decision_latency --decisions 30
```

An embedded stack (Tansu unless `STEPSTREAM_EMBEDDED_BROKER` says otherwise), a projector in its
own process (`bench.projector_child`, as the stack runs it) writing a projection directory, and in
this process what a platform or an operator runs beside it: a reader of that directory (RocksDB
secondaries, as `stepstream serve` reads it) and the service (`serve.app_for` under uvicorn). An
agent run (`StepPersistence` on an `EventLog`) ends waiting on 2N approvals (`requires_approval`);
then each call is decided once, one at a time:

- library: `decide_deferred_call` (returns when the broker acknowledged the decision), then the
  reader is asked every 5 ms until the call's ledger shows the decision applied: the time to the
  acknowledgement, and to the projection showing it (what `resume_run` or `list_waiting` would see);
- API: `POST /api/runs/{run}/calls/{call}/approve`, answered once the projection shows the decision
  (`applied: true`; the service asks its reader every 50 ms, `serve/_resolutions.py`), as the
  CLI's `stepstream approve` and the explorer's form are.

Prints the median, p95 and max of each over N decisions, and checks that no call still waits and
that the projector dead-lettered nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from bench.common import ProjectorProcess, fresh_topics, median, percentile
from stepstream import Settings
from stepstream.embedded import EmbeddedStack
from stepstream.producer import EventLog, StepPersistence, decide_deferred_call, resolver_id
from stepstream.readmodel import ProjectionReader
from stepstream.serve import app_for, running

POLL_S = 0.005
"""How often the library's side asks the reader whether the decision shows (its resolution)."""


def _agent(log: EventLog, calls: int) -> Agent[None, Any]:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(
            parts=[ToolCallPart('refund', {'order': i}, tool_call_id=f'call-{i:03d}') for i in range(calls)]
        )

    agent: Agent[None, Any] = Agent(
        FunctionModel(model),
        capabilities=[StepPersistence(log=log, agent_name='refunds')],
        output_type=[str, DeferredToolRequests],
    )

    @agent.tool_plain(requires_approval=True)
    def refund(order: int) -> str:
        return 'refunded'

    return agent


async def _until(check: Any, what: str, timeout: float = 120.0) -> Any:
    """Ask `check()` every `POLL_S` until it answers something truthy; fail after `timeout`."""
    deadline = time.perf_counter() + timeout
    while True:
        found = await check()
        if found:
            return found
        if time.perf_counter() > deadline:
            raise RuntimeError(f'waited {timeout:g}s for {what}; last read {found!r}')
        await asyncio.sleep(POLL_S)


def _summary(values: list[float]) -> dict[str, float]:
    return {'median_ms': median(values), 'p95_ms': percentile(values, 95), 'max_ms': max(values)}


async def measure(settings: Settings, root: Path, decisions: int) -> dict[str, dict[str, float]]:
    """Decide `decisions` calls through the library and as many through the API; each one's times."""
    db_path = root / 'projection'
    async with ProjectorProcess(settings, db_path) as projector, EventLog(settings) as log:
        result = await _agent(log, 2 * decisions).run('refund every order')
        if not isinstance(result.output, DeferredToolRequests):
            raise RuntimeError(f'the run ended with {result.output!r}, not waiting')
        await _until(lambda: asyncio.to_thread(db_path.exists), 'the projection directory')
        reader = ProjectionReader.open(db_path)
        try:
            waiting = await _until(
                lambda: _all_waiting(reader, 2 * decisions), f'{2 * decisions} calls waiting'
            )
            by_library, by_api = waiting[:decisions], waiting[decisions:]
            writer = resolver_id('bench')
            acked: list[float] = []
            shown: list[float] = []
            for call in by_library:
                effect = call.effect
                start = time.perf_counter()
                record = await decide_deferred_call(
                    log, effect, decision='approved', operator='bench', writer_id=writer
                )
                acked.append((time.perf_counter() - start) * 1000)
                await _until(
                    functools.partial(_applied, reader, record), f'the decision on {effect.tool_call_id}'
                )
                shown.append((time.perf_counter() - start) * 1000)
            answered: list[float] = []
            async with (
                running(app_for(settings, reader=reader), port=0) as served,
                httpx.AsyncClient(base_url=served.url, timeout=60) as http,
            ):
                for call in by_api:
                    path = f'/api/runs/{call.effect.run_id}/calls/{call.effect.tool_call_id}/approve'
                    start = time.perf_counter()
                    response = await http.post(path, json={'note': 'bench'})
                    answered.append((time.perf_counter() - start) * 1000)
                    if response.status_code != 201 or not response.json()['applied']:
                        raise RuntimeError(
                            f'POST {path} answered {response.status_code}: {response.text[:300]}'
                        )
            if await reader.list_waiting():
                raise RuntimeError('calls still wait after every one was decided')
        finally:
            await reader.aclose()
        report = await projector.finish(await log.flush())
        if report['dead_lettered']:
            raise RuntimeError(f'the projector dead-lettered {report["dead_lettered"]} records')
    return {
        'decide_deferred_call, acknowledged': _summary(acked),
        'decide_deferred_call, then shown by a reader of the projection': _summary(shown),
        'POST .../approve, answered applied': _summary(answered),
    }


async def _all_waiting(reader: ProjectionReader, count: int) -> list[Any]:
    found = await reader.list_waiting()
    return found if len(found) == count else []


async def _applied(reader: ProjectionReader, record: Any) -> bool:
    effect = await reader.get_tool_effect(record.run_id, record.tool_call_id)
    return effect is not None and any(
        r.applied and (r.writer_id, r.resolved_at) == (record.writer_id, record.timestamp)
        for r in effect.resolutions
    )


async def main(decisions: int) -> None:
    """Start a stack, decide, print each figure."""
    with tempfile.TemporaryDirectory(prefix='decide-') as scratch:
        async with EmbeddedStack() as stack:
            settings = await fresh_topics(stack.settings, 'decide')
            print(
                f'broker {stack.broker}, {settings.topics.partitions} partitions, '
                f'{decisions} decisions each way'
            )
            figures = await measure(settings, Path(scratch), decisions)
    for name, figure in figures.items():
        print(
            f'  {name}: median {figure["median_ms"]:.1f} ms, p95 {figure["p95_ms"]:.1f} ms, '
            f'max {figure["max_ms"]:.1f} ms'
        )


if __name__ == '__main__':
    parser = argparse.ArgumentParser(
        prog='python -m bench.decision_latency', description=__doc__.split('\n')[0]
    )
    parser.add_argument('--decisions', type=int, default=30, help='decisions each way (default 30)')
    logging.getLogger('aiokafka').setLevel(logging.ERROR)
    asyncio.run(main(parser.parse_args().decisions))
