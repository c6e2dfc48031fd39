"""The capability's cost per step in instructions: a figure this VM's CPU-time noise does not move.

```sh
.venv/bin/python -m bench.instructions                    # this tree
.venv/bin/python -m bench.instructions /tmp/before        # and a checkout of an earlier commit
```

CPU time per step moves by 10-20 % from one process to the next on a shared VM, more than most
changes to the hot path (docs/benchmarks.md, issue 27). Valgrind counts the instructions a
process executes instead, and those barely vary. Each tree runs two processes under
`valgrind --tool=callgrind`, with the same imports and a warm-up run of 3 steps: `none` runs
workload 1 twice for 100 steps without persistence, `memory` runs it with `StepPersistence` on
an `InMemoryLog`. The difference between the two, divided by the 203 steps (the warm-up's
included), is what the capability adds to a step; import and compile costs are the same in
both and cancel. Instructions are a proxy for CPU time, not a measure of it: memory stalls and
cache misses are not counted. A tree's two processes run at once and take two to four minutes.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.interleave import HERE, installed_layout

WARM_UP, STEPS, RUNS = 3, 100, 2


async def child(variant: str) -> None:
    """One process's work: a warm-up run, then `RUNS` runs of `STEPS` steps."""
    from bench.workload import timed_run
    from stepstream.media import DiskMediaStore
    from stepstream.producer import InMemoryLog, StepPersistence

    with tempfile.TemporaryDirectory() as media:

        def capabilities() -> list[StepPersistence[None]]:
            if variant == 'none':
                return []
            return [StepPersistence(log=InMemoryLog(), agent_name='bench', media_store=DiskMediaStore(media))]

        await timed_run(WARM_UP, capabilities())
        for _ in range(RUNS):
            await timed_run(STEPS, capabilities())


def instructions(pythonpath: str, variant: str) -> int:
    """Instructions executed by one `child` process under callgrind."""
    env = {**os.environ, 'PYTHONPATH': pythonpath, 'PYTHONHASHSEED': '0'}
    with tempfile.TemporaryDirectory() as empty:  # not a checkout: its folders would shadow the layout
        done = subprocess.run(
            [
                'valgrind',
                '--tool=callgrind',
                f'--callgrind-out-file={empty}/callgrind.out',
                sys.executable,
                '-m',
                'bench.instructions',
                '--child',
                variant,
            ],
            cwd=empty,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
    found = re.search(r'Collected : (\d+)', done.stderr)
    if found is None:
        raise RuntimeError(f'callgrind printed no count:\n{done.stderr[-2000:]}')
    return int(found.group(1))


def main() -> None:
    """Print each tree's instructions per step added by the capability."""
    if sys.argv[1:2] == ['--child']:
        asyncio.run(child(sys.argv[2]))
        return
    if shutil.which('valgrind') is None:
        raise SystemExit('bench.instructions needs valgrind (Debian: apt-get install valgrind)')
    trees = {'this tree': HERE}
    if len(sys.argv) > 1:
        trees = {'before': Path(sys.argv[1]).resolve(), 'after': HERE}
    for name, tree in trees.items():
        pythonpath = f'{installed_layout(tree)}{os.pathsep}{HERE}'
        with ThreadPoolExecutor(2) as pool:  # the two processes at once, one core each
            none, memory = pool.map(functools.partial(instructions, pythonpath), ('none', 'memory'))
        added = (memory - none) / (WARM_UP + STEPS * RUNS)
        print(
            f'{name}: none {none:,} instructions, memory {memory:,}; '
            f'the capability adds {added / 1e6:.2f} M instructions per step',
            flush=True,
        )


if __name__ == '__main__':
    main()
