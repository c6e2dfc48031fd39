"""The bench-only virtual environment: the reference library and matplotlib, apart from the project.

pydantic-ai-harness pins pydantic-ai-slim 2.62 while stepstream needs 2.68, so the reference
runs in `bench/.venv-harness`, created on first use and refreshed when `REQUIREMENTS` changes.
matplotlib lives there too: the plot is a benchmark artefact, not a runtime dependency.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

from bench.common import REPO, say

VENV = REPO / 'bench' / '.venv-harness'
REQUIREMENTS = ('pydantic-ai-harness==0.62.0', 'matplotlib>=3.8')
_STAMP = VENV / '.requirements'


def python() -> Path:
    return VENV / 'bin' / 'python'


def ensure() -> Path:
    """Create or refresh the environment; returns its python."""
    wanted = '\n'.join(REQUIREMENTS)
    if _STAMP.exists() and _STAMP.read_text() == wanted and python().exists():
        return python()
    say(f'  creating {VENV.relative_to(REPO)} ({", ".join(REQUIREMENTS)}) ...')
    venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    subprocess.run(
        [str(python()), '-m', 'pip', 'install', '--quiet', '--disable-pip-version-check', *REQUIREMENTS],
        check=True,
    )
    _STAMP.write_text(wanted)
    return python()


async def run_reference(ns: list[int], budget_s: float | None, repeats: int, workdir: Path) -> dict[str, Any]:
    """Workload 1 against pydantic-ai-harness, in its environment; returns its JSON."""
    args = ['-m', 'bench.harness_run', '--ns', ','.join(map(str, ns)), '--repeats', str(repeats)]
    args += ['--workdir', str(workdir)]
    if budget_s is not None:
        args += ['--budget-s', str(budget_s)]
    proc = await asyncio.create_subprocess_exec(
        str(ensure()), *args, cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=sys.stderr
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f'the reference benchmark failed (exit {proc.returncode}); see its output above')
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def plot(results: Path, png: Path) -> None:
    """Draw the per-step plot with matplotlib from the bench environment."""
    subprocess.run([str(ensure()), '-m', 'bench.plot', str(results), str(png)], cwd=REPO, check=True)
