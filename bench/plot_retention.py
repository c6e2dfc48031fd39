"""The retention soak's figures over simulated time, drawn from its results file.

Runs in bench/.venv-harness, where matplotlib is installed (it is not a project dependency):

    bench/.venv-harness/bin/python -m bench.plot_retention RESULTS.json docs/benchmarks-retention.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt


def draw(result: dict[str, Any], png: Path) -> None:
    """Projection and bucket size, and the apply rate, against simulated days."""
    samples = result['samples']
    days = [(s['hour'] + 1) / 24 for s in samples]
    fig, (sizes, rate) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[2, 1])
    mb = 1e6
    sizes.plot(
        days, [s['keep-all.live_bytes'] / mb for s in samples], 'tab:red', label='projection, no policy'
    )
    sizes.plot(
        days,
        [s['retain-1d.live_bytes'] / mb for s in samples],
        'tab:blue',
        label='projection, 1-day retention',
    )
    sizes.plot(
        days,
        [s['uploaded_bytes'] / mb for s in samples],
        'tab:red',
        ls='--',
        label='media uploaded (no sweep)',
    )
    sizes.plot(
        days, [s['bucket_bytes'] / mb for s in samples], 'tab:blue', ls='--', label='media bucket, swept'
    )
    sizes.set_ylabel('MB (live keys and values; objects)')
    sizes.legend(loc='upper left')
    sizes.grid(alpha=0.3)
    sizes.set_title(
        f'{result["runs_per_hour"]} runs per simulated hour, {result["steps"]} steps each, '
        f'{result["payload_bytes"] // 1024} KiB of media each'
    )
    for name, colour in (('keep-all', 'tab:red'), ('retain-1d', 'tab:blue')):
        rate.plot(days, [(s[f'{name}.apply_per_cpu_s'] or 0) / 1000 for s in samples], colour, lw=0.8)
    rate.set_ylabel('applied, k records / CPU s')
    rate.set_xlabel('simulated days of log')
    rate.set_ylim(bottom=0)
    rate.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == '__main__':
    draw(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
