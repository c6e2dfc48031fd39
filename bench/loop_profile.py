"""Where the projector's loop spends its time: a cProfile of a `Projector` from offset zero.

    .venv/bin/python -m bench.loop_profile [RECORDS] [--top N]

Fills a fresh topic pair of an embedded stack with RECORDS synthetic records (the 50-step runs
of workload 3, `synthetic.many_runs`), then profiles one `Projector` consuming them from offset
zero into an empty directory (the loop `rebuild` runs), with `asyncio.to_thread` replaced by a
direct call so that one profile holds the staging thread's work too. Prints the records parked
for a registration and decoded a second time (wrapping the applier's methods), the run's wall
and CPU time, and the top functions by own time. The profiler's cost per call inflates the many
small functions: read the shares as an order, and take rates from `bench.loop_ab`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import fresh, say
from bench.projector_throughput import fill
from stepstream.embedded import EmbeddedStack
from stepstream.projector import Projector, ProjectorParts
from stepstream.projector._commits import GroupOffsets
from stepstream.projector._parked import DecodedParked

COUNTS = {'parked': 0, 'decoded_again': 0}


def _count_parking() -> None:
    """Count parked records, and drained ones that were not kept decoded."""
    keep, take = DecodedParked.keep, DecodedParked.take

    def keep_decoded(self: DecodedParked, parked: bytes, value: bytes, record: Any) -> None:
        COUNTS['parked'] += 1
        keep(self, parked, value, record)

    def take_decoded(self: DecodedParked, parked: bytes, value: bytes) -> Any:
        if parked not in self:
            COUNTS['decoded_again'] += 1
        return take(self, parked, value)

    DecodedParked.keep = keep_decoded  # type: ignore[method-assign]
    DecodedParked.take = take_decoded  # type: ignore[method-assign]


async def _inline(function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


async def main() -> None:
    parser = argparse.ArgumentParser(prog='python -m bench.loop_profile', description=__doc__.split('\n')[0])
    parser.add_argument('records', type=int, nargs='?', default=300_000)
    parser.add_argument('--top', type=int, default=40)
    args = parser.parse_args()
    _count_parking()
    async with EmbeddedStack() as stack:
        settings = fresh(stack.settings, 'profile')
        say(f'filling the log with {args.records:,} records ...')
        _, position, _ = await fill(settings, args.records)
        with tempfile.TemporaryDirectory(prefix='loop-profile-') as workdir:
            asyncio.to_thread = _inline  # type: ignore[assignment]
            profile = cProfile.Profile()
            t0, cpu0 = time.perf_counter(), time.process_time()
            profile.enable()
            async with Projector(
                settings,
                db_path=Path(workdir) / 'projection',
                create_topics=False,
                parts=ProjectorParts(group_offsets=GroupOffsets(enabled=False)),
            ) as projector:
                await projector.wait_for(position, timeout=1800)
                applied = projector.records_applied + projector.duplicates_ignored + projector.dead_lettered
            profile.disable()
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    print(f'{applied:,} records in {wall:.1f} s, {cpu:.1f} CPU s (profiled); {COUNTS}')
    pstats.Stats(profile).sort_stats('tottime').print_stats(args.top)


if __name__ == '__main__':
    asyncio.run(main())
