"""Before and after in one run: `bench.agent_cpu` in alternating processes of two checkouts.

```sh
git worktree add /tmp/before <commit>
.venv/bin/python -m bench.interleave /tmp/before 6 -- 200 3 none,hooks,memory
```

One process's CPU time per step moves by 10-20 % from process to process on a shared VM, more
than most changes to the hot path. This runs `bench.agent_cpu` (with the arguments after `--`)
once per round in each tree, alternating: `before` imports `stepstream` from the given
checkout (laid out as installed, under `<checkout>/build/installed`, as `make lint` lays out
this one), `after` from this tree; the bench modules are this tree's in both. It prints each
variant's minimum over every repeat of every round, and what each adds to `none` (by minima, and
by medians).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
PACKAGES = ('schemas', 'producer', 'projector', 'media', 'serve', 'analytics', 'readmodel')


def installed_layout(checkout: Path) -> Path:
    """`checkout/build/installed`, holding `stepstream/` as it installs: its folders, linked."""
    root = checkout / 'build' / 'installed'
    package = root / 'stepstream'
    package.mkdir(parents=True, exist_ok=True)
    for source in [*(checkout / 'stepstream').iterdir(), *(checkout / p for p in PACKAGES)]:
        link = package / source.name
        if source.exists() and not link.exists():
            link.symlink_to(source)
    return root


def run(pythonpath: str, args: list[str]) -> dict[str, list[float]]:
    """One `bench.agent_cpu` process; its CPU ms per step, by variant."""
    env = {**os.environ, 'PYTHONPATH': pythonpath}
    with tempfile.TemporaryDirectory() as empty:  # not a checkout: its folders would shadow the layout
        out = subprocess.run(
            [sys.executable, '-m', 'bench.agent_cpu', *args],
            cwd=empty,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    line = next(line for line in out.splitlines() if line.startswith('json '))
    result: dict[str, list[float]] = json.loads(line.removeprefix('json '))
    return result


def main() -> None:
    """Alternate the two trees for the given rounds; print the minima and what each variant adds."""
    if len(sys.argv) < 3:
        raise SystemExit('usage: python -m bench.interleave BEFORE_CHECKOUT ROUNDS [-- AGENT_CPU_ARGS]')
    before, rounds = Path(sys.argv[1]).resolve(), int(sys.argv[2])
    args = sys.argv[sys.argv.index('--') + 1 :] if '--' in sys.argv else ['200', '3', 'none,hooks,memory']
    trees = {
        'before': f'{installed_layout(before)}{os.pathsep}{HERE}',
        'after': f'{installed_layout(HERE)}{os.pathsep}{HERE}',
    }
    cpu: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for n in range(rounds):
        for name, pythonpath in trees.items():
            for variant, values in run(pythonpath, args).items():
                cpu[name].setdefault(variant, []).extend(values)
            print(
                f'round {n + 1} {name}: ' + ', '.join(f'{v} {min(x):.2f}' for v, x in cpu[name].items()),
                flush=True,
            )
    for name, variants in cpu.items():
        base, middle = min(variants['none']), statistics.median(variants['none'])
        added = ', '.join(
            f'{v} {min(x) - base:+.2f} (median {statistics.median(x) - middle:+.2f})'
            for v, x in variants.items()
            if v != 'none'
        )
        print(f'{name}: none {base:.2f} ms/step; adds, min over {rounds} rounds: {added}')


if __name__ == '__main__':
    main()
