"""What a Prometheus scrape of the projector reads from its shards, on a projection of many runs.

    .venv/bin/python -m bench.scrape_cost [RUNS] [--in-doubt N] [--keep DIR]

A scrape's gauges (`ProjectorObserver`) read the projection's status (its counters: runs by
status, calls unresolved, parked records, DLQ counts) and then every unresolved tool call, oldest
first, to tell calls in flight from calls in doubt and find the oldest in doubt. The first part
does not grow with the runs (issue 35's counts); the second grows with the calls unresolved. The
projection: RUNS synthetic completed one-call runs (`bench.run_pages.build`'s layout: three
shards, batches of 5,000 through the projector's `Applier`) plus N runs whose writer died in
their tool call an hour ago (stale: each call in doubt). Prints the median of 15 scrapes' reads
after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.run_pages import PARTITIONS, RECORDS_PER_RUN, apply_wires, open_shards, timed_ms
from bench.synthetic import many_runs, plan_run, to_wire
from stepstream.projector._observe import ProjectorObserver
from stepstream.readmodel import ProjectionReader
from stepstream.settings import Settings


def crashed(settings: Settings, count: int) -> list[Any]:
    """`count` runs that stopped an hour ago inside their first tool call (the call started, never ended)."""
    wires = []
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    for index in range(count):
        planned = plan_run(f'crash-{index:08d}', 1, start=an_hour_ago)
        cut = next(i for i, p in enumerate(planned) if getattr(p.record, 'kind', None) == 'tool_call_started')
        wires += [to_wire(p.record, settings) for p in planned[: cut + 1]]
    return wires


def build(root: Path, runs: int, in_doubt: int) -> None:
    """The projection: `runs` completed runs and `in_doubt` crashed ones, three shards."""
    settings = Settings(topic_prefix='scrape')
    wires = [*many_runs(settings, 'scrape', runs * RECORDS_PER_RUN, 1), *crashed(settings, in_doubt)]
    apply_wires(root, settings, wires)


async def measure(root: Path) -> tuple[float, dict[str, float]]:
    """The median ms of a scrape's reads, and what they found."""
    reader = ProjectionReader(open_shards(root), partitions=PARTITIONS)
    observer = ProjectorObserver(SimpleNamespace(), reader)  # type: ignore[arg-type]
    try:
        families = await observer._projection_gauges()
        found = {f'{f.name}{dict(s.labels) or ""}': s.value for f in families for s in f.samples}
        return await timed_ms(observer._projection_gauges), found
    finally:
        await reader.aclose()


def main() -> None:
    """Build (or reuse) the projection and print the scrape's median."""
    parser = argparse.ArgumentParser(prog='python -m bench.scrape_cost', description=__doc__.split('\n')[0])
    parser.add_argument('runs', type=int, nargs='?', default=100_000)
    parser.add_argument('--in-doubt', type=int, default=1000)
    parser.add_argument('--keep', type=Path, help='build the projection here, or reuse the one there')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        if not (root / '0').exists():
            start = time.perf_counter()
            build(root, args.runs, args.in_doubt)
            print(
                f'built {args.runs} runs and {args.in_doubt} in doubt in {time.perf_counter() - start:.0f} s'
            )
        ms, found = asyncio.run(measure(root))
        print(f'a scrape reads the shards in {ms:.1f} ms (median of 15): {found}')


if __name__ == '__main__':
    main()
