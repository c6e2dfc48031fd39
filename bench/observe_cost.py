"""What the projector's bookkeeping of a committed batch costs, today against a baseline revision.

    .venv/bin/python -m bench.observe_cost [--baseline REV] [--rounds N]

`ApplyMetrics.observe` runs once per committed batch on the projector's loop: since issue 39 it
also feeds the Prometheus instruments (records, duplicates, dead letters, the batch's apply time,
each partition's freshness) and the lag clocks. This times it for a live batch (one shard, two
topic partitions, 3 records) and a catch-up batch (6 shards, 5,000 records), today's module and
REV's (`projector/_metrics.py` as it was there, loaded from `git show`), in alternating rounds,
and prints the median µs per batch of each and the difference per record, to set beside the
apply path's own cost per record (`bench.apply_rate`: about 20 µs).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from aiokafka.structs import TopicPartition

from stepstream.projector._apply import BatchOutcome

ROOT = Path(__file__).resolve().parent.parent


def _module(rev: str | None, scratch: Path) -> ModuleType:
    if rev is None:
        from stepstream.projector import _metrics

        return _metrics
    source = subprocess.run(
        ['git', 'show', f'{rev}:projector/_metrics.py'], cwd=ROOT, capture_output=True, check=True
    ).stdout
    path = scratch / f'metrics_{rev}.py'
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location(f'bench_metrics_{rev}', path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _batch(shards: int, records: int) -> tuple[list[BatchOutcome], dict[TopicPartition, int]]:
    per = records // shards
    outcomes = [
        BatchOutcome(applied=per, next_offsets={(0, p): 1000 + per, (1, p): 500}) for p in range(shards)
    ]
    offsets = {TopicPartition(t, p): 1000 + per for p in range(shards) for t in ('events', 'effects')}
    return outcomes, offsets


def _time(module: ModuleType, shards: int, records: int, repeats: int) -> float:
    """Median µs per `observe` of one batch, over `repeats` calls."""
    metrics: Any = module.ApplyMetrics()
    outcomes, offsets = _batch(shards, records)
    highwater = {tp: offset + 10 for tp, offset in offsets.items()}.get
    stamps = [int(time.time() * 1000) - 5] * shards
    new = 'timing' in module.ApplyMetrics.observe.__code__.co_varnames
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        if new:
            metrics.observe(outcomes, offsets, highwater, None, (0.004, stamps))
        else:
            metrics.observe(outcomes, offsets, highwater, None)
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def main() -> None:
    """Time both modules in alternating rounds and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--baseline', default='8e835be', help='the revision to compare with')
    parser.add_argument('--rounds', type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        today, before = _module(None, Path(scratch)), _module(args.baseline, Path(scratch))
        for shards, records, label in ((1, 3, 'live batch, 3 records'), (6, 5000, 'catch-up batch, 5,000')):
            now_us, then_us = [], []
            for round_ in range(args.rounds):
                pair = [(today, now_us), (before, then_us)]
                for module, into in pair if round_ % 2 == 0 else reversed(pair):
                    into.append(_time(module, shards, records, 2000))
            now, then = statistics.median(now_us), statistics.median(then_us)
            print(
                f'{label}: {now:.1f} µs per batch today, {then:.1f} µs at {args.baseline}; '
                f'+{now - then:.1f} µs, +{(now - then) / records * 1000:.0f} ns per record'
            )


if __name__ == '__main__':
    main()
