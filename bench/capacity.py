"""The capacity model of docs/capacity.md: what a platform needs at a number of active agents.

    python -m bench.capacity                         # the table in docs/capacity.md
    python -m bench.capacity --apply-rate 30000      # with another measured figure

Every input is a measured figure from docs/benchmarks.md (the flag names it) or an assumption
about the platform that the doc states; the outputs are arithmetic on them, nothing more.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Inputs:
    """Measured figures (per core of this 2-vCPU VM) and the platform's assumptions."""

    records_per_step: float = 5.0
    """Measured: a tool step appends about five records (workload 1: request, response,
    snapshot events and a tool effect's started and completed transitions)."""
    bytes_per_record: float = 520.0
    """Measured: 2.6 KB stored per step in the N=200 run (workload 1), over five records."""
    steps_per_agent_s: float = 0.5
    """Assumption: an active agent takes a step every 2 s (a model call plus a tool call)."""
    producer_rate: float = 19_000.0
    """Measured: records/s one `EventLog` appends on one core (workload 2, append only)."""
    apply_rate: float = 17_000.0
    """Measured: records/s one projector member applies on one core (workload 3 / 7)."""
    projection_bytes_per_record: float = 117.0
    """Measured: 117 MB of projection for 1,000,035 records (workload 3)."""
    headroom: float = 0.5
    """Plan to run members at half their measured rate (catch-up after a failover, bursts)."""
    partitions_per_member: int = 4
    """Partitions per member at the planned size, so the group can grow 4x without repartitioning."""
    checkpoint_interval_s: float = 60.0
    retain_days: float = 7.0
    """The retention policy (`STEPSTREAM_RETAIN_ENDED_DAYS`) the steady-state column assumes:
    a shard then holds about this many days of runs (decision 0032, measured by the soak)."""


def plan(agents: int, inputs: Inputs) -> dict[str, float]:
    """Producer cores, members, partitions and checkpoint sizes for `agents` active agents."""
    records_s = agents * inputs.steps_per_agent_s * inputs.records_per_step
    members = max(1, math.ceil(records_s / (inputs.apply_rate * inputs.headroom)))
    partitions = members * inputs.partitions_per_member
    projection_per_day = records_s * 86_400 * inputs.projection_bytes_per_record
    return {
        'agents': agents,
        'records_s': records_s,
        'log_mb_s': records_s * inputs.bytes_per_record / 1e6,
        'producer_cores': records_s / inputs.producer_rate,
        'members': members,
        'partitions': partitions,
        'projection_gb_per_day': projection_per_day / 1e9,
        'shard_gb_after_30_days': projection_per_day * 30 / partitions / 1e9,
        'shard_gb_retained': projection_per_day * inputs.retain_days / partitions / 1e9,
        'checkpoint_delta_mb': records_s
        / partitions
        * inputs.checkpoint_interval_s
        * inputs.projection_bytes_per_record
        / 1e6,
    }


def table(inputs: Inputs, sizes: tuple[int, ...] = (1_000, 10_000, 100_000)) -> str:
    """The plan for each size as a Markdown table."""
    rows = [plan(n, inputs) for n in sizes]
    header = (
        '| active agents | records/s | log MB/s | producer cores | projector members | partitions '
        '| projection GB/day | one shard after 30 days, GB '
        f'| one shard with {inputs.retain_days:g}-day retention, GB '
        '| new data per shard per checkpoint, MB |\n'
        '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n'
    )
    body = ''.join(
        f'| {r["agents"]:,} | {r["records_s"]:,.0f} | {r["log_mb_s"]:.1f} | {r["producer_cores"]:.2f} '
        f'| {r["members"]:,} | {r["partitions"]:,} | {r["projection_gb_per_day"]:,.0f} '
        f'| {r["shard_gb_after_30_days"]:,.1f} | {r["shard_gb_retained"]:,.1f} '
        f'| {r["checkpoint_delta_mb"]:.1f} |\n'
        for r in rows
    )
    return header + body


def main() -> None:
    """Print the capacity table, with any input overridden on the command line."""
    parser = argparse.ArgumentParser(prog='python -m bench.capacity', description=__doc__.split('\n')[0])
    defaults = Inputs()
    for name in defaults.__dataclass_fields__:
        parser.add_argument(f'--{name.replace("_", "-")}', type=type(getattr(defaults, name)))
    args = parser.parse_args()
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    print(table(Inputs(**overrides)), end='')


if __name__ == '__main__':
    main()
