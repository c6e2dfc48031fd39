"""The projector's live loop against its ceiling, this checkout against a baseline, interleaved.

    .venv/bin/python -m bench.loop_ab [RECORDS] [--rounds N] [--baseline-dir DIR] [--jobs N]

Fills a fresh topic pair of an embedded stack with RECORDS synthetic records (the 50-step runs
of workload 3, `synthetic.many_runs`), then measures, in each round and on the same records:

- the ceiling: one aiokafka consumer reads every record and fastavro decodes each body with its
  writer schema, nothing else (no apply path that decodes every record can go faster);
- this checkout: `bench.projector_child`, a `Projector` in its own process consuming from offset
  zero into an empty directory (the loop `rebuild` runs: fetch, decode, apply, commit), until it
  applied the whole log;
- with `--baseline-dir DIR` (a checkout of another revision with its own `.venv`), the same
  child from there, right after;
- with `--jobs N`, `stepstream.projector.rebuild(..., jobs=N)` of this checkout (and of the
  baseline) in a process of its own, timed from the call to its return (wall time only: the
  work is in its N worker processes). It stops at the end offsets the broker reports, which
  Tansu under-reports by the rest of each partition's last batch.

Each is given in wall time and in CPU time (the child's own, from its `process_time`; the
ceiling's is the bench process's). The machine may be shared: the rounds interleave the three,
and CPU time is the steadier figure.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer
from fastavro import schemaless_reader

from bench.common import fresh, log_partitions, say
from bench.projector_throughput import fill
from stepstream import Settings
from stepstream.embedded import EmbeddedStack
from stepstream.schemas import STEP_EVENT_SCHEMA, TOOL_EFFECT_SCHEMA
from stepstream.topics import Position

REPO = Path(__file__).resolve().parent.parent


async def ceiling(settings: Settings, expected: int) -> dict[str, float]:
    """Consume every record and decode each body with fastavro, nothing else."""
    writers = {s.fingerprint: s.parsed for s in (STEP_EVENT_SCHEMA, TOOL_EFFECT_SCHEMA)}
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap_servers, enable_auto_commit=False, fetch_max_wait_ms=50
    )
    await consumer.start()
    try:
        partitions = log_partitions(settings, settings.topics.partitions)
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        count = 0
        t0, cpu0 = time.perf_counter(), time.process_time()
        while count < expected:
            batches = await consumer.getmany(timeout_ms=1000, max_records=5000)
            if not batches:
                break
            for messages in batches.values():
                for m in messages:
                    value = m.value
                    assert value is not None
                    schemaless_reader(io.BytesIO(value[10:]), writers[value[2:10]], None)
                count += len(messages)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        await consumer.stop()
    return {'records': count, 'wall_s': wall, 'cpu_s': cpu}


async def projector(settings: Settings, checkout: Path, position: Position, workdir: Path) -> dict[str, Any]:
    """`bench.projector_child` of `checkout`, from offset zero to `position`."""
    env = {**os.environ, **settings.to_env()}
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        child = await asyncio.create_subprocess_exec(
            str(checkout / '.venv' / 'bin' / 'python'),
            '-m',
            'bench.projector_child',
            str(Path(scratch) / 'projection'),
            cwd=checkout,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert child.stdin is not None and child.stdout is not None
        assert (await asyncio.wait_for(child.stdout.readline(), 120)).strip() == b'ready'
        wanted = [[tp.topic, tp.partition, offset] for tp, offset in position.items()]
        child.stdin.write(json.dumps(wanted).encode() + b'\n')
        await child.stdin.drain()
        report = json.loads(await asyncio.wait_for(child.stdout.readline(), 1800))
        await child.wait()
    applied = report['records_applied'] + report['duplicates_ignored'] + report['dead_lettered']
    return {'records': applied, 'wall_s': report['catch_up_s'], 'cpu_s': report['cpu_s']}


REBUILD = """
import asyncio, sys, time
from stepstream import Settings
from stepstream.projector import rebuild
t0 = time.perf_counter()
asyncio.run(rebuild(Settings.from_env(), sys.argv[1], jobs=int(sys.argv[2])))
print(time.perf_counter() - t0)
"""


async def rebuild_jobs(
    settings: Settings, checkout: Path, jobs: int, records: int, workdir: Path
) -> dict[str, Any]:
    """`rebuild(..., jobs=jobs)` of `checkout` in a process of its own, from the call to its return."""
    env = {**os.environ, **settings.to_env()}
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        child = await asyncio.create_subprocess_exec(
            str(checkout / '.venv' / 'bin' / 'python'),
            '-c',
            REBUILD,
            str(Path(scratch) / 'projection'),
            str(jobs),
            cwd=checkout,
            env=env,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(child.communicate(), 3600)
    assert child.returncode == 0, f'rebuild of {checkout} failed'
    return {'records': records, 'wall_s': float(out.decode().split()[-1]), 'cpu_s': float('nan')}


def line(what: str, figures: dict[str, Any]) -> str:
    """One measurement: records, wall and CPU rates."""
    n = figures['records']
    text = f'{what}: {n:,} records in {figures["wall_s"]:.1f} s ({n / figures["wall_s"]:,.0f}/s)'
    if math.isnan(figures['cpu_s']):
        return text
    return text + f', {figures["cpu_s"]:.1f} CPU s ({n / figures["cpu_s"]:,.0f}/CPU s)'


async def main() -> None:
    parser = argparse.ArgumentParser(prog='python -m bench.loop_ab', description=__doc__.split('\n')[0])
    parser.add_argument('records', type=int, nargs='?', default=300_000)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--baseline-dir', type=Path, help='a checkout of another revision, with its .venv')
    parser.add_argument('--jobs', type=int, help='also time rebuild(jobs=N) of each checkout')
    args = parser.parse_args()
    async with EmbeddedStack() as stack:
        settings = fresh(stack.settings, 'loop')
        say(f'filling the log with {args.records:,} records ...')
        _, position, filled = await fill(settings, args.records)
        total = filled['records']
        results: dict[str, list[dict[str, Any]]] = {'ceiling': [], 'now': [], 'baseline': []}
        if args.jobs:
            results |= {f'now --jobs {args.jobs}': [], f'baseline --jobs {args.jobs}': []}
        with tempfile.TemporaryDirectory(prefix='loop-ab-') as workdir:
            for n in range(1, args.rounds + 1):
                results['ceiling'].append(await ceiling(settings, total))
                results['now'].append(await projector(settings, REPO, position, Path(workdir)))
                if args.baseline_dir is not None:
                    results['baseline'].append(
                        await projector(settings, args.baseline_dir, position, Path(workdir))
                    )
                if args.jobs:
                    results[f'now --jobs {args.jobs}'].append(
                        await rebuild_jobs(settings, REPO, args.jobs, total, Path(workdir))
                    )
                    if args.baseline_dir is not None:
                        results[f'baseline --jobs {args.jobs}'].append(
                            await rebuild_jobs(settings, args.baseline_dir, args.jobs, total, Path(workdir))
                        )
                for what, runs in results.items():
                    if runs:
                        print(f'round {n} ' + line(what, runs[-1]), flush=True)
    for what, runs in results.items():
        if not runs:
            continue
        wall = statistics.median(r['records'] / r['wall_s'] for r in runs)
        cpu = statistics.median(r['records'] / r['cpu_s'] for r in runs)
        ratio = statistics.median(
            (r['records'] / r['wall_s']) / (c['records'] / c['wall_s'])
            for r, c in zip(runs, results['ceiling'], strict=True)
        )
        if math.isnan(cpu):  # a rebuild in processes: its time against the ceiling's
            times = statistics.median(
                r['wall_s'] / c['wall_s'] for r, c in zip(runs, results['ceiling'], strict=True)
            )
            seconds = statistics.median(r['wall_s'] for r in runs)
            print(
                f'{what}, median of {len(runs)}: {seconds:.1f} s ({wall:,.0f} records/s); '
                f'{times:.2f}x the ceiling time in the same round'
            )
            continue
        print(
            f'{what}, median of {len(runs)}: {wall:,.0f} records/s, {cpu:,.0f} records/CPU s; '
            f'of the ceiling in the same round: {ratio:.2f}'
        )


if __name__ == '__main__':
    sys.exit(asyncio.run(main()))
