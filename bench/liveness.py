"""What writer liveness costs: heartbeats per open run per minute, idle and busy, and a pass's CPU.

```sh
.venv/bin/python -m bench.liveness                 # 1,000 and 10,000 open runs, interval 5 s
.venv/bin/python -m bench.liveness --runs 100000
```

A simulated minute: the runs are registered with the `Liveness` of an `InMemoryLog` (the records
are encoded and stored as `EventLog` would send them), and the keeper's pass runs every half
interval with its clock moved forward (`beat(now=...)`), so a minute takes as long as its
passes' work. Idle runs append nothing; busy runs append a record every second. Printed per
population: heartbeats per run per minute, the CPU of one pass over every run, and the longest
the pass held the event loop between two yields. Stored records are dropped after each pass, as
an `EventLog` keeps none once they are sent.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import UTC, datetime

from stepstream import Settings
from stepstream.producer import InMemoryLog
from stepstream.producer._liveness import OpenRun
from stepstream.schemas import StepEvent

INTERVAL_S = 5.0
MINUTE_S = 60.0


def _heartbeat(run_id: str) -> StepEvent:
    return StepEvent(
        run_id=run_id, seq=7, writer_id='0123456789abcdef', timestamp=datetime.now(UTC), kind='run_heartbeat'
    )


async def _end(reason: str) -> None:
    return None


async def _minute(runs: int, busy: bool) -> tuple[float, float, float]:
    """(heartbeats per run per minute, CPU ms of one pass, longest loop hold in ms)."""
    log = InMemoryLog(Settings(partitions=6, heartbeat_interval_s=INTERVAL_S))
    keeper = log.liveness
    handles: list[OpenRun] = []
    for i in range(runs):
        run_id = f'agent-{i:06d}'
        handle = keeper.open(run_id, heartbeat=lambda run_id=run_id: _heartbeat(run_id), end=_end)
        assert handle is not None
        handles.append(handle)
    await keeper.stop()  # the passes below stand in for its timer
    holds: list[float] = []
    last = time.perf_counter()

    async def watch() -> None:
        nonlocal last
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            holds.append(now - last)
            last = now

    watcher = asyncio.create_task(watch())
    start = time.monotonic()
    cpu: list[float] = []
    t = 0.0
    while t < MINUTE_S:
        t += INTERVAL_S / 2
        if busy:  # each busy run appended within the last second
            for handle in handles:
                handle.last_append = start + t - 1.0
        began = time.process_time()
        last = time.perf_counter()
        await keeper.beat(now=start + t)
        cpu.append(time.process_time() - began)
        log.records.clear()  # sent and gone, as with `EventLog`: no heap for the GC to walk
    watcher.cancel()
    per_run = keeper.sent / runs
    for handle in handles:
        keeper.close(handle)
    return per_run, max(cpu) * 1e3, max(holds, default=0.0) * 1e3


async def main(populations: list[int]) -> None:
    """Print the table."""
    print(f'interval {INTERVAL_S:g} s, one simulated minute, passes every {INTERVAL_S / 2:g} s')
    print('| open runs | activity | heartbeats per run per minute | CPU of the busiest pass | longest hold |')
    print('| ---: | --- | ---: | ---: | ---: |')
    for runs in populations:
        for busy in (False, True):
            per_run, cpu_ms, hold_ms = await _minute(runs, busy)
            activity = 'busy (a record every 1 s)' if busy else 'idle'
            print(f'| {runs:,} | {activity} | {per_run:.1f} | {cpu_ms:.1f} ms | {hold_ms:.1f} ms |')


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--runs', type=int, nargs='*', default=[1_000, 10_000])
    asyncio.run(main(parser.parse_args().runs))
