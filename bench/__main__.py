"""`python -m bench` (what `make bench` runs): every workload, one table, one results file.

    python -m bench                      # everything, about 12 minutes on 2 cores
    BENCH_QUICK=1 python -m bench        # scaled down, for iterating on the benchmarks
    python -m bench --only per-step,freshness --no-plot

Results go to bench/results/latest.json (and a dated copy), the table to stdout and to
bench/results/latest.md, the plot to docs/benchmarks-per-step.png. A full-scale run also puts
the figures it measured, with its date and commit, into docs/benchmarks/current.json and the
"Current figures" of docs/benchmarks.md (`bench.current`); `--no-record` leaves them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import stepstream
from bench import (
    current,
    freshness,
    harness_env,
    partitioned,
    per_step,
    producer_throughput,
    projector_throughput,
    report,
)
from bench.common import REPO, Scale, say
from stepstream.embedded import EmbeddedStack

WORKLOADS = ('per-step', 'producer', 'projector', 'freshness', 'partitioned')


def _flag(name: str) -> bool:
    return os.environ.get(name, '').strip().lower() not in ('', '0', 'false', 'no')


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog='python -m bench', description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true', default=_flag('BENCH_QUICK'), help='or BENCH_QUICK=1')
    parser.add_argument(
        '--full', action='store_true', default=_flag('BENCH_FULL'),
        help='run the reference stores to N=1000 instead of extrapolating (long; or BENCH_FULL=1)',
    )  # fmt: skip
    parser.add_argument('--only', default=','.join(WORKLOADS), help=f'comma-separated subset of {WORKLOADS}')
    parser.add_argument('--no-reference', action='store_true', help='skip pydantic-ai-harness')
    parser.add_argument('--no-plot', action='store_true')
    parser.add_argument(
        '--no-record', action='store_true', help='leave docs/benchmarks/current.json as it is'
    )
    parser.add_argument('--results', type=Path, default=REPO / 'bench' / 'results')
    parser.add_argument('--plot', type=Path, default=REPO / 'docs' / 'benchmarks-per-step.png')
    args = parser.parse_args()
    unknown = set(args.only.split(',')) - set(WORKLOADS)
    if unknown:
        parser.error(f'unknown workloads {sorted(unknown)}; choose from {WORKLOADS}')
    return args


async def _run(args: argparse.Namespace, scale: Scale, workdir: Path) -> dict[str, Any]:
    only = set(args.only.split(','))
    raw: dict[str, Any] = {}
    if 'per-step' in only and not args.no_reference:
        # The reference first, before the stack runs: nothing else competes for the 2 cores.
        say('workload 1, reference (pydantic-ai-harness, its own environment)')
        raw['reference'] = await harness_env.run_reference(
            scale.ns, scale.harness_budget_s, scale.repeats, workdir
        )
    # Each workload gets a broker of its own: what one leaves in Tansu's memory (a million
    # records, hundreds of topics) must not slow the next.
    steps: list[tuple[str, str, Callable[[EmbeddedStack], Awaitable[Any]]]] = [
        ('per-step', 'workload 1, stepstream',
         lambda s: per_step.run(s.settings, scale, workdir, broker_pid=s.pids.get('broker'))),
        ('producer', 'workload 2, producer throughput', lambda s: producer_throughput.run(s.settings, scale)),
        ('freshness', 'workload 4, freshness', lambda s: freshness.run(s.settings, scale, workdir)),
        ('freshness-raw', 'workload 4, freshness ceiling',
         lambda s: freshness.raw_ceiling(s.settings, scale)),
        ('projector', 'workload 3, projector throughput and rebuild',
         lambda s: projector_throughput.run(s.settings, scale, workdir)),
        ('partitioned', 'workload 7, partitioned projection: rebuild jobs, members, failover',
         lambda s: partitioned.run(s.settings, scale, workdir)),
    ]  # fmt: skip
    for name, title, workload in steps:
        if name.removesuffix('-raw') in only:
            say(title)
            async with EmbeddedStack() as stack:
                raw[name.replace('-', '_')] = await workload(stack)
    return raw


def _jsonable(summary: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(summary, default=str))


def main() -> int:
    args = _parse()
    scale = Scale(quick=args.quick, full=args.full)
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix='stepstream-bench-'))
    try:
        raw = asyncio.run(_run(args, scale, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = raw.get('per_step', []) + raw.get('reference', {}).get('runs', [])
    summary: dict[str, Any] = {'per_step': report.per_step_summary(rows)} if rows else {}
    summary['targets'] = report.targets(summary, raw)
    command = 'make bench' if not (args.quick or args.full) else f'{"BENCH_QUICK=1 " * args.quick}make bench'
    results = {
        'date': started.strftime('%Y-%m-%d %H:%M UTC'),
        'command': command,
        'argv': sys.argv[1:],
        'scale': {'quick': scale.quick, 'full': scale.full},
        'machine': {
            'cpus': os.cpu_count(),
            'python': platform.python_version(),
            'platform': platform.platform(),
        },
        'seconds': round(time.perf_counter() - t0, 1),
        'summary': _jsonable(summary),
        'raw': raw,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    latest = args.results / 'latest.json'
    latest.write_text(json.dumps(results, indent=1))
    (args.results / f'{started.strftime("%Y%m%dT%H%M%S")}.json').write_text(json.dumps(results))
    text = report.render(summary, raw)
    header = f'# stepstream benchmarks, {results["date"]} (`{command}`, {results["seconds"]:.0f} s)\n\n'
    (args.results / 'latest.md').write_text(header + text)
    plotted = bool(summary.get('per_step')) and not args.no_plot
    if plotted:
        harness_env.plot(latest, args.plot)
        say(f'plot: {args.plot.relative_to(REPO) if args.plot.is_relative_to(REPO) else args.plot}')
    print(header + text)
    say(f'results: {latest.relative_to(REPO) if latest.is_relative_to(REPO) else latest}')
    # The figures are this checkout's only if stepstream came from it (a before/after comparison
    # may put another tree first on PYTHONPATH) and the run was at full scale.
    here = Path(stepstream.__file__).resolve().is_relative_to(REPO)
    if args.quick or args.no_record or not here:
        why = (
            'scaled down'
            if args.quick
            else '--no-record'
            if args.no_record
            else 'stepstream from another tree'
        )
        say(f'docs/benchmarks/current.json: not updated ({why})')
    else:
        ids = current.record_run(
            summary, raw, date=results['date'], command=_command(args), plot=args.plot if plotted else None
        )
        say(f'docs/benchmarks/current.json and docs/benchmarks.md: {len(ids)} figures updated')
    return 0


def _command(args: argparse.Namespace) -> str:
    """How this run was started, as the figures it records name it."""
    argv = sys.argv[1:]
    prefix = 'BENCH_FULL=1 ' if args.full and '--full' not in argv else ''
    return f'{prefix}make bench' if not argv else f'{prefix}python -m bench {" ".join(argv)}'


if __name__ == '__main__':
    sys.exit(main())
