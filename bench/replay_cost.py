"""What replaying costs against running the agent's own code: a batch of recorded runs, replayed.

```sh
.venv/bin/python -m bench.replay_cost            # 100 runs of 20 steps, 3 rounds
.venv/bin/python -m bench.replay_cost 100 20 5
```

Recorded once: N runs of an agent that calls one tool a step for S steps, then answers, written
by `StepPersistence` to an `InMemoryLog` and projected by the projector's `Applier` into a
RocksDB shard on disk (`Shard`), the store `stepstream replay` reads. Then, per round and
interleaved: `agent` runs the same agent N times on a `FunctionModel` that answers at once (the
agent's own code with no model and no persistence: the ceiling) and `replay` replays the N
recorded runs through a `ProjectionReader` with `replay_run` (recorded tools). Printed: the
minimum over rounds of each, per run, in CPU and wall time, and the ratio replay / agent.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.projector._apply import EFFECTS, EVENTS, Applier, SourceRecord
from stepstream.readmodel import ProjectionReader
from stepstream.replay import replay_run
from stepstream.storage import Shard


def agent_for(steps: int, persistence: StepPersistence[Any] | None) -> Agent[None, str]:
    """One tool call a step for `steps` steps, then an answer; the model answers at once."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = sum(isinstance(m, ModelResponse) for m in messages)
        if done < steps:
            return ModelResponse(parts=[ToolCallPart('lookup', {'topic': f'topic-{done}'}, f'call-{done}')])
        return ModelResponse(parts=[TextPart('answered')])

    agent = Agent(
        FunctionModel(model),
        instructions='Answer from the tools.',
        capabilities=[persistence] if persistence is not None else [],
    )

    @agent.tool_plain
    def lookup(topic: str) -> str:
        return f'notes on {topic}: ' + 'x' * 400

    return agent


async def record(runs: int, steps: int, path: str) -> tuple[Shard, list[str]]:
    """`runs` recorded runs, projected into a RocksDB shard at `path`."""
    log = InMemoryLog()
    agent = agent_for(steps, StepPersistence(log=log, agent_name='bench'))
    run_ids = [f'bench-{(await agent.run("go")).run_id}' for _ in range(runs)]
    await log.flush()
    settings = log.settings
    topics = {settings.topics.step_events_topic: EVENTS, settings.topics.tool_effects_topic: EFFECTS}
    applier = Applier(
        (settings.topics.step_events_topic, settings.topics.tool_effects_topic),
        partitions=settings.topics.partitions,
    )
    shard = Shard.open(path, create=True)
    sources = [SourceRecord(topics[r.topic], r.partition, r.offset, r.key, r.value) for r in log.records]
    for i in range(0, len(sources), 2000):
        txn, _ = applier.stage(shard, sources[i : i + 2000])
        txn.commit()
    return shard, run_ids


async def measure(runs: int, steps: int, rounds: int) -> dict[str, Any]:
    """Per run, the minimum over rounds: the agent's own CPU and wall time, and replay's."""
    timings: dict[str, list[tuple[float, float]]] = {'agent': [], 'replay': []}
    with tempfile.TemporaryDirectory() as path:
        shard, run_ids = await record(runs, steps, path)
        reader = ProjectionReader(shard)
        plain = agent_for(steps, None)
        try:
            for _ in range(rounds):
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(runs):
                    await plain.run('go')
                timings['agent'].append((time.process_time() - cpu, time.perf_counter() - wall))
                cpu, wall = time.process_time(), time.perf_counter()
                for run_id in run_ids:
                    report = await replay_run(plain, run_id, reader=reader)
                    assert report.outcome == 'matched', report.text()
                timings['replay'].append((time.process_time() - cpu, time.perf_counter() - wall))
        finally:
            shard.close()
    best = {name: (min(c for c, _ in t), min(w for _, w in t)) for name, t in timings.items()}
    return {
        'runs': runs,
        'steps': steps,
        'rounds': rounds,
        'agent_ms_per_run': {
            'cpu': round(best['agent'][0] * 1000 / runs, 2),
            'wall': round(best['agent'][1] * 1000 / runs, 2),
        },
        'replay_ms_per_run': {
            'cpu': round(best['replay'][0] * 1000 / runs, 2),
            'wall': round(best['replay'][1] * 1000 / runs, 2),
        },
        'ratio_cpu': round(best['replay'][0] / best['agent'][0], 2),
        'ratio_wall': round(best['replay'][1] / best['agent'][1], 2),
    }


def main() -> None:
    """Print the figures as JSON."""
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    print(json.dumps(asyncio.run(measure(runs, steps, rounds)), indent=2))


if __name__ == '__main__':
    main()
