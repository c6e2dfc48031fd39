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
"""

from __future__ import annotations

import asyncio
import statistics
import sys

from bench.common import EVENTLOG_LINGER_MS, fresh
from bench.producer_throughput import _plans, eventlog_concurrent, raw_aiokafka
from stepstream import Settings
from stepstream.embedded import EmbeddedStack
from stepstream.topics import ensure_topics

VARIANTS = ((32, EVENTLOG_LINGER_MS), (32, 0), (256, EVENTLOG_LINGER_MS), (256, 0))


async def measure(total: int, rounds: int) -> dict[str, list[float]]:
    """Records/s of raw aiokafka and of each `(runs, linger_ms)` variant, one entry per round."""
    rates: dict[str, list[float]] = {'raw': [], **{f'{r} runs, linger {ms}': [] for r, ms in VARIANTS}}
    async with EmbeddedStack() as stack:

        async def topics(tag: str) -> Settings:
            settings = fresh(stack.settings, tag)
            await ensure_topics(settings)
            return settings

        for n in range(rounds):
            rates['raw'].append(
                (await raw_aiokafka(await topics('pr-raw'), _plans(f'r{n}', total)))['records_per_s']
            )
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
        print(
            f'{name:22} median {statistics.median(values):8,.0f} records/s, '
            f'of raw in the same round {ratio:.2f}'
        )


if __name__ == '__main__':
    main()
