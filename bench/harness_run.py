"""Workload 1 against the reference: pydantic-ai-harness `StepPersistence` and its three stores.

Runs inside bench/.venv-harness (created by `python -m bench`), never in the project's
environment: the reference pins its own pydantic-ai. It times "no persistence" too, in this
environment, so the reference's added cost is measured against its own baseline. Prints one
JSON document on stdout; progress goes to stderr.

    bench/.venv-harness/bin/python -m bench.harness_run --ns 50,200,1000 --budget-s 30 --workdir /tmp/x
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from bench.workload import extrapolate_mean_step_ms, timed_run

STORES = ('memory', 'sqlite', 'file')


def _dir_bytes(path: Path) -> int:
    # Not bench.common.dir_bytes: that module needs stepstream, which this environment lacks.
    return sum(p.stat().st_size for p in path.rglob('*') if p.is_file())


def _memory_bytes(store: Any) -> int:
    """JSON size of what an `InMemoryStepStore` holds (each snapshot is a deep copy of the history)."""
    from pydantic_core import to_json

    parts = [
        list(store._runs.values()),
        [e for events in store._events.values() for e in events],
        [s for snaps in store._snapshots.values() for s in snaps],
        list(store._tool_effects.values()),
    ]
    return sum(len(to_json(p)) for p in parts)


def _make_store(kind: str, where: Path) -> tuple[Any, Any]:
    """A fresh store and a function that measures the bytes it holds."""
    from pydantic_ai_harness.step_persistence import FileStepStore, InMemoryStepStore, SqliteStepStore

    if kind == 'memory':
        memory = InMemoryStepStore()
        return memory, lambda: _memory_bytes(memory)
    if kind == 'sqlite':
        db = where / 'steps.sqlite'
        return SqliteStepStore(database=db), lambda: _dir_bytes(where)
    root = where / 'files'
    return FileStepStore(root), lambda: _dir_bytes(root)


async def _one(kind: str, n: int, budget_s: float | None, workdir: Path) -> dict[str, Any]:
    from pydantic_ai_harness import StepPersistence

    where = Path(tempfile.mkdtemp(prefix=f'{kind}-{n}-', dir=workdir))
    try:
        if kind == 'none':
            timing = await timed_run(n)
            return {**timing.as_dict(), 'bytes': 0}
        store, measure = _make_store(kind, where)
        capability = StepPersistence(store=store, agent_name='bench')
        timing = await timed_run(n, [capability], budget_s=budget_s)
        out = {**timing.as_dict(), 'bytes': measure()}
        if timing.truncated:
            out['extrapolated_per_step_ms'] = extrapolate_mean_step_ms(timing.step_ms, n)
        return out
    finally:
        shutil.rmtree(where, ignore_errors=True)


async def main(ns: list[int], stores: list[str], budget_s: float | None, repeats: int, workdir: Path) -> None:
    results: dict[str, Any] = {
        'pydantic_ai_version': version('pydantic-ai-slim'),
        'harness_version': version('pydantic-ai-harness'),
        'budget_s': budget_s,
        'runs': [],
    }
    # Warm up imports, schema builds and the stores' first-use paths, untimed.
    for kind in ['none', *stores]:
        await _one(kind, 5, None, workdir)
    for n in ns:
        for kind in ['none', *stores]:
            # Only the short baselines are repeated: each reference run is long, and its cost
            # dominates the noise (the same rule as the stepstream side).
            for rep in range(repeats if kind == 'none' and n <= 200 else 1):
                t0 = time.perf_counter()
                row = await _one(kind, n, budget_s if n > 200 else None, workdir)
                row.update(variant=f'harness-{kind}' if kind != 'none' else 'none-harness-env', rep=rep)
                results['runs'].append(row)
                print(
                    f'  reference {kind:6} N={n:<5} {row["per_step_ms"]:8.2f} ms/step '
                    f'{row["bytes"] / 1e6:8.2f} MB  steps={row["steps_done"]}'
                    f'{" (truncated)" if row["truncated"] else ""}  [{time.perf_counter() - t0:.1f}s]',
                    file=sys.stderr,
                    flush=True,
                )
    print(json.dumps(results))


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--ns', default='50,200,1000')
    parser.add_argument('--stores', default=','.join(STORES))
    parser.add_argument('--budget-s', type=float, default=None, help='time budget of one run above N=200')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--workdir', type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    asyncio.run(
        main(
            [int(x) for x in args.ns.split(',')],
            [s for s in args.stores.split(',') if s],
            args.budget_s,
            args.repeats,
            args.workdir,
        )
    )
