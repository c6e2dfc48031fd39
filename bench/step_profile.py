"""Where the agent process's CPU per step goes, by owner: ours, aiokafka's, Pydantic AI's, the rest.

```sh
.venv/bin/python -m bench.step_profile              # N=200, variants none, memory, eventlog
.venv/bin/python -m bench.step_profile 200 --top 25 # and the 25 functions of most own time
```

Runs workload 1's agent (`bench.workload.timed_run`) for N steps under `cProfile`, once without
persistence, once with `StepPersistence` on an `InMemoryLog` and once on an `EventLog` to an
embedded Tansu, and charges each function's own time (`tottime`) to the package its file is in:
`stepstream` (this repository), `aiokafka`, `pydantic_ai` (with pydantic, pydantic_core and
pydantic_graph), `asyncio` (the event loop, selectors, sockets, futures); a built-in function's
time goes to the owners of its callers and `other` (the standard library
but asyncio, opentelemetry, fastavro, ...). cProfile slows Python code down, C code less, so the
shares are the figure to read, not the absolute times; `bench.agent_cpu` gives the CPU per step.
The profiler's clock is `time.process_time`, so time blocked in `epoll` waiting for the broker is
not counted; its resolution is coarse, which is why N should stay in the hundreds.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.common import fresh
from bench.workload import timed_run
from stepstream.embedded import EmbeddedStack
from stepstream.media import DiskMediaStore
from stepstream.producer import EventLog, InMemoryLog, StepPersistence

REPO = str(Path(__file__).resolve().parent.parent)
OWNERS = (
    ('/aiokafka/', 'aiokafka'),
    ('/pydantic_ai/', 'pydantic_ai'),
    ('/pydantic_graph/', 'pydantic_ai'),
    ('/pydantic/', 'pydantic_ai'),
    ('/pydantic_core/', 'pydantic_ai'),
    ('/asyncio/', 'asyncio'),
    ('/selectors.py', 'asyncio'),
)


def owner(filename: str, name: str) -> str:
    """The package a profiled function belongs to (built-ins by the name cProfile gives them)."""
    if filename == '~':
        if _event_loop(name) or 'Future' in name or 'Task' in name or '_asyncio' in name:
            return 'asyncio'
        return 'pydantic_ai' if 'pydantic_core' in name else 'other'
    if filename.startswith(REPO) and '/site-packages/' not in filename:
        return (
            'other' if filename.startswith(f'{REPO}/bench/') else 'stepstream'
        )  # the workload's model is not ours
    for marker, who in OWNERS:
        if marker in filename:
            return who
    return 'other'


def by_owner(profile: cProfile.Profile, steps: int) -> tuple[dict[str, float], pstats.Stats]:
    """Own time in ms per step, summed by owner; a built-in's time goes to the owners of its callers."""
    stats = pstats.Stats(profile)
    totals: dict[str, float] = defaultdict(float)
    entries = stats.stats  # type: ignore[attr-defined]
    for (filename, _line, name), (_cc, _nc, tottime, _cum, callers) in entries.items():
        if filename == '~' and callers and not _event_loop(name):
            for (c_file, _c_line, c_name), caller in callers.items():
                totals[owner(c_file, c_name)] += caller[2] * 1000 / steps
        else:
            totals[owner(filename, name)] += tottime * 1000 / steps
    return dict(totals), stats


def _event_loop(name: str) -> bool:
    return 'select' in name or 'socket' in name


async def profiled(n: int, capabilities: list[StepPersistence[None]]) -> cProfile.Profile:
    """One run of workload 1 with `capabilities`, under cProfile."""
    profile = cProfile.Profile(time.process_time)  # CPU, not the wall time spent waiting in epoll
    profile.enable()
    await timed_run(n, capabilities)
    profile.disable()
    return profile


async def main(n: int, top: int) -> None:
    """Print each variant's own time per step by owner, and the top functions on Kafka."""
    results: dict[str, tuple[dict[str, float], pstats.Stats]] = {}
    async with EmbeddedStack() as stack:
        await timed_run(5)
        with tempfile.TemporaryDirectory() as media:
            results['none'] = by_owner(await profiled(n, []), n)
            alone = StepPersistence(log=InMemoryLog(), agent_name='bench', media_store=DiskMediaStore(media))
            results['memory'] = by_owner(await profiled(n, [alone]), n)
            async with EventLog(fresh(stack.settings, f'prof-{n}')) as log:
                await timed_run(3, [StepPersistence(log=log, agent_name='warm')])
                results['eventlog'] = by_owner(
                    await profiled(n, [StepPersistence(log=log, agent_name='bench')]), n
                )
    owners = ('stepstream', 'aiokafka', 'pydantic_ai', 'asyncio', 'other')
    print(f'own time per step under cProfile, N={n} (ms)')
    print(f'{"variant":10}' + ''.join(f'{o:>12}' for o in owners) + f'{"total":>10}')
    for name, (totals, _stats) in results.items():
        row = ''.join(f'{totals.get(o, 0.0):12.3f}' for o in owners)
        print(f'{name:10}{row}{sum(totals.values()):10.3f}')
    base = results['none'][0]
    for name in ('memory', 'eventlog'):
        totals = results[name][0]
        row = ''.join(f'{totals.get(o, 0.0) - base.get(o, 0.0):+12.3f}' for o in owners)
        print(f'{name + " - none":10}{row}{sum(totals.values()) - sum(base.values()):+10.3f}')
    if top:
        results['eventlog'][1].sort_stats('tottime').print_stats(top)


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('n', type=int, nargs='?', default=200)
    parser.add_argument('--top', type=int, default=0)
    args = parser.parse_args()
    asyncio.run(main(args.n, args.top))
