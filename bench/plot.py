"""Per-step cost and bytes per run against run length, drawn from a results file.

Runs in bench/.venv-harness, where matplotlib is installed (it is not a project dependency):

    bench/.venv-harness/bin/python -m bench.plot bench/results/latest.json docs/benchmarks-per-step.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter

from bench.report import LABELS

STYLE = {
    'none': ('black', '-', 'o'),
    'stepstream': ('tab:blue', '-', 'o'),
    'stepstream-linger0': ('tab:cyan', ':', 'o'),
    'stepstream-no-projector': ('tab:purple', ':', 'o'),
    'none-harness-env': ('grey', '--', 's'),
    'harness-memory': ('tab:green', '--', 's'),
    'harness-sqlite': ('tab:orange', '--', 's'),
    'harness-file': ('tab:red', '--', 's'),
}


def _line(ax: Any, cells: dict[int, Any], ns: list[int], key: str, look: dict[str, Any]) -> None:
    xs = [n for n in ns if cells[n].get(key) is not None]
    ax.plot(xs, [cells[n][key] for n in xs], **look)
    estimated = [n for n in xs if cells[n]['estimated']]
    if estimated:
        ax.plot(
            estimated,
            [cells[n][key] for n in estimated],
            linestyle='none',
            marker=look['marker'],
            markersize=11,
            markerfacecolor='white',
            markeredgecolor=look['color'],
        )


def draw(summary: dict[str, Any], png: Path, title: str) -> None:
    per_step = {v: {int(n): c for n, c in by_n.items()} for v, by_n in summary['per_step'].items()}
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 6))
    for variant, (color, style, marker) in STYLE.items():
        cells = per_step.get(variant)
        if not cells:
            continue
        ns = sorted(cells)
        label = LABELS[variant]

        look = {'color': color, 'linestyle': style, 'marker': marker, 'label': label}
        _line(left, cells, ns, 'ms', look)
        if variant.startswith(('stepstream', 'harness-')):
            _line(middle, cells, ns, 'added_ms', look)
        if variant == 'stepstream' or variant.startswith('harness-'):
            _line(right, cells, ns, 'bytes', look)
    left.set_title('wall time per step')
    left.set_ylabel('ms per step')
    middle.set_title('added by persistence (vs its own baseline)')
    middle.set_ylabel('ms per step')
    middle.axhline(2.0, color='tab:blue', linewidth=0.8, linestyle=':')
    middle.annotate('target 2 ms', (50, 2.0), textcoords='offset points', xytext=(2, 3), fontsize=8)
    right.set_title('bytes written per run')
    right.set_ylabel('bytes')
    for ax in (left, middle, right):
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel('run length N (tool steps)')
        ax.set_xticks([50, 200, 1000], ['50', '200', '1000'])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which='both', alpha=0.3)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc='lower center', ncol=4, fontsize=8, frameon=False)
    fig.suptitle(
        title + '   (hollow markers: extrapolated from a run stopped at its time budget)', fontsize=9
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


if __name__ == '__main__':
    results = json.loads(Path(sys.argv[1]).read_text())
    draw(results['summary'], Path(sys.argv[2]), f'stepstream benchmarks, {results["date"]}')
