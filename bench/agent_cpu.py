"""The agent process's CPU per step of workload 1: without persistence, the capability alone, on Kafka.

```sh
.venv/bin/python -m bench.agent_cpu            # N=200, 9 interleaved repeats of each variant
.venv/bin/python -m bench.agent_cpu 200 15
.venv/bin/python -m bench.agent_cpu 200 3 none,hooks,memory   # some variants only
```

CPU time (`time.process_time`) of this process only, so the broker's and other processes' work
is not counted; the minimum over interleaved repeats is the run least disturbed by other load
on the machine (the median is printed too). Variants: `none` (pydantic-ai alone), `hooks`
(`bench.hooks.PassThroughHooks`: a capability with the same hooks doing nothing, what Pydantic
AI charges for calling them), `memory`
(`StepPersistence` on `InMemoryLog` with a disk media store: the capability's own cost) and
`eventlog` (`StepPersistence` on `EventLog` to an embedded Tansu: what an agent pays in all), and
`eventlog-linger0` (the same with `linger_ms=0`: each record sent as it is appended, as before
decision 0025).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import tempfile

from bench.common import fresh
from bench.hooks import PassThroughHooks
from bench.workload import timed_run
from stepstream.embedded import EmbeddedStack
from stepstream.media import DiskMediaStore
from stepstream.producer import EventLog, InMemoryLog, StepPersistence

VARIANTS = ('none', 'hooks', 'memory', 'eventlog', 'eventlog-linger0')


async def measure(n: int, repeats: int, variants: tuple[str, ...] = VARIANTS) -> dict[str, list[float]]:
    """CPU ms per step of each variant, one entry per repeat."""
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    on_kafka = 'eventlog' in variants or 'eventlog-linger0' in variants
    async with EmbeddedStack() if on_kafka else contextlib.nullcontext() as stack:
        await timed_run(5)  # imports and first-use paths, untimed
        with tempfile.TemporaryDirectory() as media:
            for rep in range(repeats):
                if 'none' in variants:
                    cpu['none'].append((await timed_run(n)).cpu_s * 1000 / n)
                if 'hooks' in variants:
                    cpu['hooks'].append((await timed_run(n, [PassThroughHooks()])).cpu_s * 1000 / n)
                if 'memory' in variants:
                    alone = StepPersistence(
                        log=InMemoryLog(), agent_name='bench', media_store=DiskMediaStore(media)
                    )
                    cpu['memory'].append((await timed_run(n, [alone])).cpu_s * 1000 / n)
                if 'eventlog' in variants:
                    async with EventLog(fresh(stack.settings, f'cpu-{n}-{rep}')) as log:
                        persisted = StepPersistence(log=log, agent_name='bench')
                        cpu['eventlog'].append((await timed_run(n, [persisted])).cpu_s * 1000 / n)
                if 'eventlog-linger0' in variants:
                    async with EventLog(fresh(stack.settings, f'cpu0-{n}-{rep}'), linger_ms=0) as log:
                        each_record = StepPersistence(log=log, agent_name='bench')
                        cpu['eventlog-linger0'].append((await timed_run(n, [each_record])).cpu_s * 1000 / n)
    return {name: values for name, values in cpu.items() if values}


def main() -> None:
    """Print each variant's minimum and median, and what the capability adds to the baseline."""
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    variants = tuple(sys.argv[3].split(',')) if len(sys.argv) > 3 else VARIANTS
    unknown = set(variants) - set(VARIANTS)
    if unknown or 'none' not in variants:
        raise SystemExit(f'variants are {", ".join(VARIANTS)}, with none among them; got {sys.argv[3]}')
    cpu = asyncio.run(measure(n, repeats, variants))
    for name, values in cpu.items():
        print(
            f'{name:9} CPU ms/step at N={n}: min {min(values):6.2f}  median {statistics.median(values):6.2f}'
        )
    for name in [v for v in VARIANTS[1:] if v in cpu]:
        added_min = min(cpu[name]) - min(cpu['none'])
        added_median = statistics.median(cpu[name]) - statistics.median(cpu['none'])
        print(f'{name:9} adds {added_min:+.2f} ms/step (min), {added_median:+.2f} (median)')
    if 'memory' in cpu and 'hooks' in cpu:
        own = min(cpu['memory']) - min(cpu['hooks'])
        print(f'capability beyond its hooks (memory - hooks): {own:+.2f} ms/step (min)')
    print('json', json.dumps(cpu))  # for bench.interleave


if __name__ == '__main__':
    main()
