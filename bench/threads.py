"""One shared `EventLog`, runs on its own loop against runs on other threads: wall time per step.

```sh
.venv/bin/python -m bench.threads                  # 100-step runs, 1 and 4 at once, 3 rounds
.venv/bin/python -m bench.threads --steps 200 --at-once 1 4 8 --rounds 5
```

Issue 47: a process shares one `EventLog` (started on its loop), and a web or task-queue worker
runs its agents on its pool's threads, with `run_sync` or with one `asyncio.run` per request.
Workload 1's agent (`bench.workload`: one tool call per step) runs `--steps` steps, `--at-once`
runs at a time, placed four ways: as tasks on the log's own loop, and on as many worker threads
with `run_sync`, with `asyncio.run`, or without persistence (the baseline of each placement).
Each variant runs once per round, in turn, on one embedded Tansu; a figure is the median over
rounds of the mean wall time per step of the variant's runs. What persistence adds to a step is
the figure minus the baseline of the same placement and concurrency, and the ratio set against
the log's own loop is that added time over the one of runs on the log's loop.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic_ai.usage import UsageLimits

from bench.common import fresh, say
from bench.workload import StepClock, build_agent
from stepstream.embedded import EmbeddedStack
from stepstream.producer import EventLog, StepPersistence

PROMPT = 'Look up the archive records one by one.'

PLACEMENTS = ('loop', 'run_sync', 'asyncio.run')
"""Where the runs are: tasks on the log's loop, or worker threads with `run_sync` or `asyncio.run`."""


def _agent(steps: int, capabilities: Sequence[Any]) -> tuple[Any, StepClock]:
    clock = StepClock()
    return build_agent(steps, clock, capabilities), clock


def _per_step_ms(clock: StepClock, steps: int) -> float:
    return (time.perf_counter() - clock.start) * 1000 / steps


async def _on_loop(steps: int, capabilities: Sequence[Any]) -> float:
    agent, clock = _agent(steps, capabilities)
    clock.begin()
    await agent.run(PROMPT, usage_limits=UsageLimits(request_limit=steps + 2))
    return _per_step_ms(clock, steps)


def _on_thread(placement: str, steps: int, capabilities: Sequence[Any], ready: threading.Barrier) -> float:
    agent, clock = _agent(steps, capabilities)
    limits = UsageLimits(request_limit=steps + 2)
    ready.wait()  # the runs of a variant start together
    clock.begin()
    if placement == 'run_sync':
        agent.run_sync(PROMPT, usage_limits=limits)
    else:
        asyncio.run(agent.run(PROMPT, usage_limits=limits))
    return _per_step_ms(clock, steps)


async def _variant(
    placement: str, at_once: int, steps: int, make: Callable[[], list[Any]]
) -> tuple[float, float]:
    """The mean wall ms per step of `at_once` runs placed as `placement`, and the CPU ms per step."""
    gc.collect()
    cpu = time.process_time()
    if placement == 'loop':
        per_run = await asyncio.gather(*(_on_loop(steps, make()) for _ in range(at_once)))
    else:
        ready = threading.Barrier(at_once)
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(at_once) as pool:  # the log's loop stays free while they run
            per_run = await asyncio.gather(
                *(
                    loop.run_in_executor(pool, _on_thread, placement, steps, make(), ready)
                    for _ in range(at_once)
                )
            )
    return statistics.fmean(per_run), (time.process_time() - cpu) * 1000 / (steps * at_once)


async def measure(steps: int, at_once: list[int], rounds: int) -> dict[str, list[float]]:
    """Every variant's mean ms per step, one value per round, keyed `placement persistence at_once`.

    And the process's CPU ms per step under `cpu placement persistence at_once` (every thread's).
    """
    samples: dict[str, list[float]] = {}
    async with EmbeddedStack() as stack:
        settings = fresh(stack.settings, 'threads')
        async with EventLog(settings) as log:

            def persisted() -> list[Any]:
                return [StepPersistence(log=log, agent_name='bench')]

            def bare() -> list[Any]:
                return []

            for placement in PLACEMENTS:  # warm-up, untimed: imports, schemas, each thread's loop
                await _variant(placement, 1, 5, persisted)
            await _variant('loop', 1, 5, bare)
            for n in range(rounds):
                for k in at_once:
                    variants = [
                        ('loop', 'none'),
                        ('run_sync', 'none'),
                        *((p, 'stepstream') for p in PLACEMENTS),
                    ]
                    for placement, persistence in variants if n % 2 == 0 else reversed(variants):
                        make = persisted if persistence == 'stepstream' else bare
                        value, cpu = await _variant(placement, k, steps, make)
                        samples.setdefault(f'{placement} {persistence} {k}', []).append(value)
                        samples.setdefault(f'cpu {placement} {persistence} {k}', []).append(cpu)
                        say(
                            f'round {n + 1}, {k} at once, {placement} {persistence}: {value:.3f} ms/step, '
                            f'process CPU {cpu:.3f} ms/step'
                        )
            await log.flush()
    return samples


def report(samples: dict[str, list[float]], at_once: list[int]) -> None:
    """Print the table (medians over rounds) and the samples as one JSON line."""
    median = {key: statistics.median(values) for key, values in samples.items()}
    print('| runs at once | where the runs are | per step, no persistence | per step, stepstream | '
          'added per step | added, against the log\'s loop | process CPU per step, stepstream |')  # fmt: skip
    print('| ---: | --- | ---: | ---: | ---: | ---: | ---: |')
    for k in at_once:
        on_loop = median[f'loop stepstream {k}'] - median[f'loop none {k}']
        for placement in PLACEMENTS:
            base = median[f'{"loop" if placement == "loop" else "run_sync"} none {k}']
            value = median[f'{placement} stepstream {k}']
            where = "the log's loop" if placement == 'loop' else f'worker threads, `{placement}`'
            print(
                f'| {k} | {where} | {base:.3f} ms | {value:.3f} ms | {value - base:.3f} ms | '
                f'{(value - base) / on_loop:.2f} | {median[f"cpu {placement} stepstream {k}"]:.3f} ms |'
            )
    print('json ' + json.dumps(samples))


def main() -> None:
    """Parse the arguments, measure, print."""
    parser = argparse.ArgumentParser(prog='python -m bench.threads', description=__doc__.split('\n')[0])
    parser.add_argument('--steps', type=int, default=100)
    parser.add_argument('--at-once', type=int, nargs='+', default=[1, 4])
    parser.add_argument('--rounds', type=int, default=3)
    args = parser.parse_args()
    report(asyncio.run(measure(args.steps, args.at_once, args.rounds)), args.at_once)


if __name__ == '__main__':
    main()
