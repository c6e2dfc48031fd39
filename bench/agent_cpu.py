"""The agent process's CPU per step of workload 1: without persistence, the capability alone, on Kafka.

```sh
.venv/bin/python -m bench.agent_cpu            # N=200, 9 interleaved repeats of each variant
.venv/bin/python -m bench.agent_cpu 200 15
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
import statistics
import sys
import tempfile

from bench.common import fresh
from bench.hooks import PassThroughHooks
from bench.workload import timed_run
from stepstream.embedded import EmbeddedStack
from stepstream.media import DiskMediaStore
from stepstream.producer import EventLog, InMemoryLog, StepPersistence


async def measure(n: int, repeats: int) -> dict[str, list[float]]:
    """CPU ms per step of each variant, one entry per repeat."""
    cpu: dict[str, list[float]] = {
        'none': [],
        'hooks': [],
        'memory': [],
        'eventlog': [],
        'eventlog-linger0': [],
    }
    async with EmbeddedStack() as stack:
        await timed_run(5)  # imports and first-use paths, untimed
        with tempfile.TemporaryDirectory() as media:
            for rep in range(repeats):
                cpu['none'].append((await timed_run(n)).cpu_s * 1000 / n)
                cpu['hooks'].append((await timed_run(n, [PassThroughHooks()])).cpu_s * 1000 / n)
                alone = StepPersistence(
                    log=InMemoryLog(), agent_name='bench', media_store=DiskMediaStore(media)
                )
                cpu['memory'].append((await timed_run(n, [alone])).cpu_s * 1000 / n)
                async with EventLog(fresh(stack.settings, f'cpu-{n}-{rep}')) as log:
                    on_kafka = StepPersistence(log=log, agent_name='bench')
                    cpu['eventlog'].append((await timed_run(n, [on_kafka])).cpu_s * 1000 / n)
                async with EventLog(fresh(stack.settings, f'cpu0-{n}-{rep}'), linger_ms=0) as log:
                    each_record = StepPersistence(log=log, agent_name='bench')
                    cpu['eventlog-linger0'].append((await timed_run(n, [each_record])).cpu_s * 1000 / n)
    return cpu


def main() -> None:
    """Print each variant's minimum and median, and what the capability adds to the baseline."""
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    cpu = asyncio.run(measure(n, repeats))
    for name, values in cpu.items():
        print(
            f'{name:9} CPU ms/step at N={n}: min {min(values):6.2f}  median {statistics.median(values):6.2f}'
        )
    for name in ('hooks', 'memory', 'eventlog', 'eventlog-linger0'):
        added_min = min(cpu[name]) - min(cpu['none'])
        added_median = statistics.median(cpu[name]) - statistics.median(cpu['none'])
        print(f'{name:9} adds {added_min:+.2f} ms/step (min), {added_median:+.2f} (median)')
    own = min(cpu['memory']) - min(cpu['hooks'])
    print(f'capability beyond its hooks (memory - hooks): {own:+.2f} ms/step (min)')


if __name__ == '__main__':
    main()
