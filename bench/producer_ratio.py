"""Workload 2's ratios, interleaved: `EventLog` at 32 and 256 concurrent runs against raw aiokafka.

```sh
.venv/bin/python -m bench.producer_ratio                 # 20,000 records, 5 rounds
.venv/bin/python -m bench.producer_ratio 20000 7
```

One `make bench` sample of workload 2 moves by 30 % between repeats on a shared machine, more
than the changes it is meant to show. Here each round runs raw aiokafka
(`producer_throughput.raw_aiokafka`, the ceiling) and `EventLog` with 32 and 256 concurrent
simulated runs (`producer_throughput.eventlog_concurrent`), each with the default linger and
with `linger_ms=0`, one after the other on fresh topics of one embedded Tansu; it prints each
variant's median records/s and the median of its ratio to the raw ceiling of the same round.

Raw aiokafka is also run in the shape of the capability's traffic
(`producer_throughput.raw_concurrent`: 32 and 256 concurrent runs, each waiting at its
durability points, on a producer configured as `EventLog`'s, gzip included, once with aiokafka's
linger at `EventLog`'s 5 ms and once at 0), and each `EventLog` variant's ratio to the better of
the two is printed too: what the log costs over aiokafka sending the same traffic, apart from
what the waits cost any producer.
"""

from __future__ import annotations

import asyncio
import statistics
import sys

from bench.common import EVENTLOG_LINGER_MS, fresh_topics
from bench.producer_throughput import _plans, eventlog_concurrent, raw_aiokafka, raw_concurrent
from stepstream import Settings
from stepstream.embedded import EmbeddedStack

VARIANTS = ((32, EVENTLOG_LINGER_MS), (32, 0), (256, EVENTLOG_LINGER_MS), (256, 0))
RUNS = (32, 256)


async def measure(total: int, rounds: int) -> dict[str, list[float]]:
    """Records/s of raw aiokafka and of each `(runs, linger_ms)` variant, one entry per round."""
    rates: dict[str, list[float]] = {
        'raw': [],
        **{f'raw, {r} runs with waits{lg}': [] for r in RUNS for lg in ('', ', linger 0')},
        **{f'{r} runs, linger {ms}': [] for r, ms in VARIANTS},
    }
    async with EmbeddedStack() as stack:

        async def topics(tag: str) -> Settings:
            return await fresh_topics(stack.settings, tag)

        for n in range(rounds):
            rates['raw'].append(
                (await raw_aiokafka(await topics('pr-raw'), _plans(f'r{n}', total)))['records_per_s']
            )
            for runs in RUNS:
                row = await raw_concurrent(await topics('pr-rawc'), _plans(f'w{n}', total), runs)
                rates[f'raw, {runs} runs with waits'].append(row['records_per_s'])
                row = await raw_concurrent(
                    await topics('pr-rawc0'), _plans(f'z{n}', total), runs, linger_ms=0
                )
                rates[f'raw, {runs} runs with waits, linger 0'].append(row['records_per_s'])
            for runs, linger in VARIANTS:
                row = await eventlog_concurrent(await topics('pr-log'), _plans(f'c{n}', total), runs, linger)
                rates[f'{runs} runs, linger {linger}'].append(row['records_per_s'])
            print(
                f'round {n + 1}: '
                + ', '.join(f'{name} {values[-1]:,.0f}/s' for name, values in rates.items()),
                flush=True,
            )
    return rates


def main() -> None:
    """Print each variant's median records/s and its median ratio to raw aiokafka."""
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    rates = asyncio.run(measure(total, rounds))
    for name, values in rates.items():
        ratio = statistics.median(v / raw for v, raw in zip(values, rates['raw'], strict=True))
        median = statistics.median(values)
        line = f'{name:36} median {median:8,.0f} records/s, of raw in the same round {ratio:.2f}'
        runs = next((r for r in RUNS if name.startswith(f'{r} runs')), None)
        if runs is not None:  # against raw aiokafka sending the same traffic with the same waits
            # at its better linger of the round (its own 5 ms, as EventLog's, or 0)
            same = map(
                max, rates[f'raw, {runs} runs with waits'], rates[f'raw, {runs} runs with waits, linger 0']
            )
            waits = statistics.median(v / w for v, w in zip(values, same, strict=True))
            line += f', of raw with the same waits {waits:.2f}'
        print(line)


if __name__ == '__main__':
    main()
