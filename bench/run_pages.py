"""How long a page of runs takes on a projection of many runs (issue 35).

```sh
.venv/bin/python -m bench.run_pages 100000            # build a projection of 100,000 runs, time pages
.venv/bin/python -m bench.run_pages 100000 --keep /tmp/pages-100k   # keep it, and reuse it next time
```

The projection is built through the projector's own `Applier`, not through Kafka: synthetic
one-tool-call runs (`bench.synthetic.many_runs`, about ten records each), placed in three
partitions as the producer's partitioner puts them and applied in batches of 5,000 into one
RocksDB shard per partition, as a projector writes them. Their run ids differ and their times
are the template's (one `started_at` for all: the index orders them by run id), which changes
no walk's length; every run has completed, under one agent name. Each request is timed as a
reader opened over the shards answers it (`ProjectionReader.list_runs`, what the API's
`/api/runs` asks for), median of 5 after one
warm-up; the first line says which stepstream it imported, so the same command on an older
checkout (`PYTHONPATH=<checkout laid out as installed>`) gives its figures on the same files.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import stepstream
from bench.synthetic import many_runs
from stepstream import Settings
from stepstream.projector._apply import EFFECTS, EVENTS, Applier, SourceRecord
from stepstream.projector._shard import Shard
from stepstream.readmodel import ProjectionReader
from stepstream.topics import murmur2_partition

PARTITIONS = 3
BATCH = 5000
RECORDS_PER_RUN = 10
"""About what a one-tool-call synthetic run writes (`bench.synthetic.plan_run(..., 1)`)."""


def build(root: Path, runs: int) -> None:
    """A projection of about `runs` runs under `root`, one shard per partition."""
    settings = Settings(topic_prefix='pages')
    topics = {settings.step_events_topic: EVENTS, settings.tool_effects_topic: EFFECTS}
    applier = Applier((settings.step_events_topic, settings.tool_effects_topic), partitions=PARTITIONS)
    shards = {p: Shard.open(root / str(p), create=True) for p in range(PARTITIONS)}
    pending: dict[int, list[SourceRecord]] = {p: [] for p in range(PARTITIONS)}
    offsets: dict[tuple[int, int], int] = {}

    def flush(partition: int) -> None:
        txn, _ = applier.stage(shards[partition], pending[partition])
        txn.commit()
        pending[partition].clear()

    try:
        for wire in many_runs(settings, 'pages', runs * RECORDS_PER_RUN, 1):
            topic, partition = topics[wire.topic], murmur2_partition(wire.key, PARTITIONS)
            offset = offsets.get((topic, partition), 0)
            offsets[(topic, partition)] = offset + 1
            pending[partition].append(SourceRecord(topic, partition, offset, wire.key, wire.value))
            if len(pending[partition]) >= BATCH:
                flush(partition)
        for partition in pending:
            flush(partition)
    finally:
        for shard in shards.values():
            shard.close()


def median_ms(call: Callable[[], Awaitable[Any]], rounds: int = 5) -> float:
    """The median wall time of `call`, in milliseconds, after one warm-up."""

    async def timed() -> list[float]:
        await call()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            await call()
            times.append((time.perf_counter() - start) * 1000)
        return times

    return statistics.median(asyncio.run(timed()))


def measure(root: Path) -> dict[str, float]:
    """Each request's median over the projection at `root`."""
    shards = {p: Shard.open(root / str(p)) for p in range(PARTITIONS)}
    reader = ProjectionReader(shards, partitions=PARTITIONS)
    try:
        cursor = asyncio.run(reader.list_runs(newest_first=True, limit=1000))[-1].run_id  # the 1,000th
        agent = asyncio.run(reader.list_runs(limit=1))[0].agent_name
        requests: dict[str, Callable[[], Awaitable[Any]]] = {
            'first page, newest first (51 runs)': lambda: reader.list_runs(newest_first=True, limit=51),
            'first page, oldest first (51 runs)': lambda: reader.list_runs(limit=51),
            'the page after the 1,000th newest': lambda: reader.list_runs(
                newest_first=True, after=cursor, limit=51
            ),
            'conversation filter, none match': lambda: reader.list_runs(conversation_id='nope', limit=51),
            'status=failed, none match': lambda: reader.list_runs(
                status='failed', newest_first=True, limit=51
            ),
            'status=completed, first page (every run matches)': lambda: reader.list_runs(
                status='completed', newest_first=True, limit=51
            ),
            'status=stale, none (no run is running)': lambda: reader.list_runs(
                status='stale', newest_first=True, limit=51
            ),
            'agent_name=nope, none match': lambda: reader.list_runs(
                agent_name='nope', newest_first=True, limit=51
            ),
            'agent_name of every run, first page': lambda: reader.list_runs(
                agent_name=agent, newest_first=True, limit=51
            ),
        }
        return {name: median_ms(call) for name, call in requests.items()}
    finally:
        for shard in shards.values():
            shard.close()


def main() -> None:
    """Build (or reuse) a projection of the given size and print each request's median."""
    parser = argparse.ArgumentParser(prog='python -m bench.run_pages', description=__doc__.split('\n')[0])
    parser.add_argument('runs', type=int)
    parser.add_argument('--keep', type=Path, help='build the projection here, or reuse the one there')
    args = parser.parse_args()
    print(f'stepstream from {Path(stepstream.__file__).parent}')
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        if not (root / '0').exists():
            start = time.perf_counter()
            build(root, args.runs)
            print(f'built {args.runs} runs in {time.perf_counter() - start:.0f} s')
        for name, ms in measure(root).items():
            print(f'{name}: {ms:.1f} ms')


if __name__ == '__main__':
    main()
