"""How long a page of the calls that wait takes on a projection of many runs (issue 49, item 6).

```sh
.venv/bin/python -m bench.waiting_pages 100000                       # build and time
.venv/bin/python -m bench.waiting_pages 1000000 --keep /tmp/waiting-1m --json waiting.json
```

The projection: RUNS synthetic completed one-call runs (`bench.run_pages.build`'s layout: three
shards, batches of 5,000 through the projector's `Applier`) and then WAITING runs of real agents
(`FunctionModel`, `StepPersistence` on an `InMemoryLog`) that each end waiting on one deferred call:
four agents, 100 conversations (each one agent's), the kinds in turn (`approval`, `question`,
`external`), but the agent `deploys`, whose calls are all approvals. Their records are applied
after the synthetic runs', at the offsets they take there.

Each figure is the median of 15 after one warm-up:

- reader: `ProjectionReader.list_waiting` in this process, oldest and newest first, the page
  after a cursor, each filter, filters that match nothing (an unknown agent or conversation, and
  `deploys` with `external`: 1 in 4 waiting calls are that agent's approvals), and `counts()`;
  and the filters that match nothing again as shards made before the filter indexes read them
  (`run_index` 4: `WAITING` walked whole and filtered), the reference.
- HTTP: `GET /api/deferred` (50 calls, the page after its cursor, filters) and `GET /api/counts`
  of the service (`serve.app_for`, uvicorn in this loop) over the same shards, asked with httpx.

Every page is checked against what it must hold, and every request must be answered 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
from pydantic_ai import Agent, CallDeferred, DeferredToolRequests
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import stepstream
from bench.run_pages import (
    PARTITIONS,
    RECORDS_PER_RUN,
    apply_wires,
    http_figures,
    median_ms,
    open_shards,
    refusing_address,
)
from bench.synthetic import many_runs
from stepstream import Settings
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.readmodel import ProjectionReader
from stepstream.readmodel._runs import Runs
from stepstream.serve import app_for, running

AGENTS = ('refunds', 'billing', 'support', 'deploys')
"""The waiting runs' agents, in turn; `deploys` waits only on approvals."""
CONVERSATIONS = 100
KINDS = {'approval': 'refund', 'question': 'ask_customer', 'external': 'export'}
"""What a call waits for, and the tool that defers so."""
PREFIX = 'waiting'


def kind_of(index: int) -> str:
    """What the `index`th waiting run's call waits for."""
    if AGENTS[index % len(AGENTS)] == 'deploys':
        return 'approval'
    return list(KINDS)[(index // len(AGENTS)) % len(KINDS)]


def _model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Call the tool the prompt names: the run then ends waiting on it."""
    prompt = next(
        p.content for m in messages for p in getattr(m, 'parts', ()) if isinstance(p, UserPromptPart)
    )
    assert isinstance(prompt, str)
    return ModelResponse(parts=[ToolCallPart(prompt, {'order': 7}, tool_call_id=f'call-{prompt}')])


def _agent(log: InMemoryLog, name: str) -> Agent[None, Any]:
    agent: Agent[None, Any] = Agent(
        FunctionModel(_model),
        capabilities=[StepPersistence(log=log, agent_name=name)],
        output_type=[str, DeferredToolRequests],
    )

    @agent.tool_plain(requires_approval=True)
    def refund(order: int) -> str:
        return 'refunded'

    @agent.tool_plain
    def ask_customer(order: int) -> str:
        raise CallDeferred(kind='question')

    @agent.tool_plain
    def export(order: int) -> str:
        raise CallDeferred(metadata={'job': f'export-{order}'})

    return agent


async def waiting_runs(settings: Settings, count: int) -> InMemoryLog:
    """`count` agent runs that end waiting, their records in an in-memory log of `settings`' topics."""
    log = InMemoryLog(settings)
    agents = {name: _agent(log, name) for name in AGENTS}
    for index in range(count):
        agent = agents[AGENTS[index % len(AGENTS)]]
        conversation = f'conv-{index % CONVERSATIONS:03d}'
        result = await agent.run(KINDS[kind_of(index)], conversation_id=conversation)
        if not isinstance(result.output, DeferredToolRequests):
            raise RuntimeError(f'waiting run {index} ended with {result.output!r}, not waiting')
    return log


def build(root: Path, runs: int, waiting: int) -> None:
    """The projection under `root`: `runs` completed runs, then `waiting` runs that wait."""
    settings = Settings(topic_prefix=PREFIX)
    log = asyncio.run(waiting_runs(settings, waiting))
    apply_wires(root, settings, [*many_runs(settings, PREFIX, runs * RECORDS_PER_RUN, 1), *log.records])


Requests = dict[str, tuple[Callable[[], Awaitable[Any]], int]]
"""Each request by name, with how many calls its answer must hold."""


def _reader_requests(reader: ProjectionReader, waiting: int, cursor: Any) -> Requests:
    some_conversation = 'conv-001'  # agent `billing`'s
    per_conversation = len(range(1, waiting, CONVERSATIONS))
    page = 51
    return {
        'first page, oldest first (51 calls)': (lambda: reader.list_waiting(limit=page), page),
        'first page, newest first (51 calls)': (
            lambda: reader.list_waiting(newest_first=True, limit=page),
            page,
        ),
        'the page after the 1,000th newest': (
            lambda: reader.list_waiting(newest_first=True, after=cursor, limit=page),
            page,
        ),
        'kind=question, first page': (lambda: reader.list_waiting(deferral='question', limit=page), page),
        'agent_name=billing, first page': (
            lambda: reader.list_waiting(agent_name='billing', limit=page),
            page,
        ),
        'conversation_id, first page (its calls)': (
            lambda: reader.list_waiting(conversation_id=some_conversation, limit=page),
            min(page, per_conversation),
        ),
        'agent_name=nope, none match': (lambda: reader.list_waiting(agent_name='nope', limit=page), 0),
        'conversation_id=nope, none match': (
            lambda: reader.list_waiting(conversation_id='nope', limit=page),
            0,
        ),
        'agent_name=deploys and kind=external, none match': (
            lambda: reader.list_waiting(agent_name='deploys', deferral='external', limit=page),
            0,
        ),
    }


def _checked(call: Callable[[], Awaitable[Any]], expected: int, name: str) -> Callable[[], Awaitable[Any]]:
    async def checked() -> Any:
        found = await call()
        if len(found) != expected:
            raise RuntimeError(f'{name}: {len(found)} calls, not {expected}')
        return found

    return checked


def measure(root: Path, waiting: int) -> dict[str, float]:
    """Each request's median over the projection at `root`, and the unindexed walk's where nothing matches."""
    reader = ProjectionReader(open_shards(root), partitions=PARTITIONS)
    try:
        cursor = asyncio.run(reader.list_waiting(newest_first=True, limit=1000))[-1].cursor
        requests = _reader_requests(reader, waiting, cursor)
        figures = {name: median_ms(_checked(call, n, name)) for name, (call, n) in requests.items()}
        figures['counts (runs per status and agent, calls in doubt and waiting)'] = median_ms(reader.counts)
        counts = asyncio.run(reader.counts())
        if counts is None or sum(counts.waiting_calls.values()) != waiting:
            raise RuntimeError(f'counts: {counts}, not {waiting} waiting calls')
        with mock.patch.object(Runs, 'index_version', return_value=4):  # a shard made before the indexes
            for name, (call, n) in requests.items():
                if 'none match' in name:
                    figures[f'{name}, walking WAITING (before)'] = median_ms(_checked(call, n, name))
        return figures
    finally:
        reader.close()


async def _serve(root: Path) -> dict[str, float]:
    reader = ProjectionReader(open_shards(root), partitions=PARTITIONS)
    try:
        requests = {
            'GET /api/deferred (first page, 50 calls, oldest first)': ('/api/deferred', {}),
            'GET /api/deferred?newest=true': ('/api/deferred', {'newest': 'true'}),
            'GET /api/deferred?after= (the next page)': ('/api/deferred', {}),
            'GET /api/deferred?kind=question': ('/api/deferred', {'kind': 'question'}),
            'GET /api/deferred?agent=nope (none match)': ('/api/deferred', {'agent': 'nope'}),
            'GET /api/deferred?agent=deploys&kind=external (none match)': (
                '/api/deferred',
                {'agent': 'deploys', 'kind': 'external'},
            ),
            'GET /api/counts': ('/api/counts', {}),
        }
        with refusing_address() as broker:
            settings = Settings(topic_prefix=PREFIX, bootstrap_servers=broker)
            async with running(app_for(settings, reader=reader), port=0) as served:
                async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                    first = (await http.get('/api/deferred')).raise_for_status().json()
                    if len(first['calls']) != 50 or first['next_after'] is None:
                        raise RuntimeError(
                            f'GET /api/deferred gave {len(first["calls"])} calls and no cursor'
                        )
                    requests['GET /api/deferred?after= (the next page)'] = (
                        '/api/deferred',
                        {'after': first['next_after']},
                    )
                return await http_figures(served.url, requests)
    finally:
        reader.close()


def measure_http(root: Path) -> dict[str, float]:
    """Each request's median over HTTP, asked of the service (`app_for`) over the shards at `root`."""
    return asyncio.run(_serve(root))


def main() -> None:
    """Build (or reuse) the projection and print each request's median."""
    parser = argparse.ArgumentParser(prog='python -m bench.waiting_pages', description=__doc__.split('\n')[0])
    parser.add_argument('runs', type=int)
    parser.add_argument('--waiting', type=int, default=5000, help='runs that end waiting (default 5,000)')
    parser.add_argument('--keep', type=Path, help='build the projection here, or reuse the one there')
    parser.add_argument('--json', type=Path, metavar='PATH', help='also write every figure here, {name: ms}')
    args = parser.parse_args()
    print(f'stepstream from {Path(stepstream.__file__).parent}')
    logging.getLogger('aiokafka').setLevel(logging.CRITICAL)  # the status pages' refused broker
    logging.getLogger('asyncio').setLevel(logging.CRITICAL)
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        if not (root / '0').exists():
            start = time.perf_counter()
            build(root, args.runs, args.waiting)
            print(f'built {args.runs} runs and {args.waiting} waiting in {time.perf_counter() - start:.0f} s')
        groups: dict[str, tuple[str, Callable[[], dict[str, float]]]] = {
            'reader': ('ProjectionReader.list_waiting, in this process', lambda: measure(root, args.waiting)),
            'HTTP': ('the service over the three shards, asked with httpx', lambda: measure_http(root)),
        }
        for group, (what, measured) in groups.items():
            print(f'{group}: {what}')
            for name, value in measured().items():
                print(f'  {name}: {value:.1f} ms')
                figures[f'{group}: {name}'] = value
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + '\n')


if __name__ == '__main__':
    main()
