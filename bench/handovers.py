"""How `EventLog` hands records to the producer at each concurrency: hand-overs, batches, singles.

```sh
.venv/bin/python -m bench.handovers            # 1, 8, 32 and 256 concurrent runs, 12,000 records each
```

Workload 2's simulated runs (`producer_throughput._plans`), each waiting at its durability
points, share one `EventLog` on fresh topics of an embedded Tansu. The log's hand-overs, and
the producer's `send` and `send_batch` calls, are counted by wrapping them in this process,
and printed per record together with the CPU per record and the rate, for the default linger
and for `linger_ms=0`. Decision 0034 reads its figures from here: how many records a hand-over
carries, and how many go one by one, is what the default's cost per record follows.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from typing import Any

from bench.common import EVENTLOG_LINGER_MS, fresh_topics
from bench.producer_throughput import _plans
from bench.synthetic import write_run
from stepstream.embedded import EmbeddedStack
from stepstream.producer import EventLog


async def counted(settings: Any, runs: int, linger_ms: int, total: int) -> dict[str, float]:
    """One pass of `runs` concurrent runs: counts per record, CPU µs per record, records/s."""
    plans = _plans(f'h{runs}-{linger_ms}', total)
    queue = list(reversed(plans))
    counts: collections.Counter[str] = collections.Counter()
    async with EventLog(settings, linger_ms=linger_ms) as log:
        producer = log._producer
        assert producer is not None
        send, send_batch, hand = producer.send, producer.send_batch, log._hand_batches

        async def one(*args: Any, **kwargs: Any) -> Any:
            counts['sent one by one'] += 1
            return await send(*args, **kwargs)

        async def batch(builder: Any, *args: Any, **kwargs: Any) -> Any:
            counts['batches'] += 1
            return await send_batch(builder, *args, **kwargs)

        async def hand_over(queued: Any) -> None:
            counts['hand-overs'] += 1
            await hand(queued)

        producer.send, producer.send_batch = one, batch
        log._hand_batches = hand_over  # type: ignore[method-assign]

        async def worker() -> None:
            while queue:
                await write_run(((p.record, p.durable) for p in queue.pop()), log.append, log.wait_acked)

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(runs)))
        await log.flush()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    records = sum(len(p) for p in plans)
    return {
        **{name: counts[name] / records for name in ('hand-overs', 'batches', 'sent one by one')},
        'cpu_us': cpu / records * 1e6,
        'records_per_s': records / wall,
    }


async def main(total: int) -> None:
    """Print each concurrency's counts, default linger and `linger_ms=0`."""
    async with EmbeddedStack() as stack:
        for runs in (1, 8, 32, 256):
            for linger_ms in (EVENTLOG_LINGER_MS, 0):
                got = await counted(await fresh_topics(stack.settings, 'handovers'), runs, linger_ms, total)
                print(
                    f'{runs:3} runs, linger {linger_ms}: per record '
                    + ', '.join(
                        f'{name} {got[name]:.3f}' for name in ('hand-overs', 'batches', 'sent one by one')
                    )
                    + f'; CPU {got["cpu_us"]:.1f} us a record, {got["records_per_s"]:,.0f} records/s',
                    flush=True,
                )


if __name__ == '__main__':
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 12_000))
