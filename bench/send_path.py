"""The agent process's CPU per record on the way to the broker: `EventLog` against raw aiokafka.

```sh
.venv/bin/python -m bench.send_path            # 400 runs of 20 steps, 5 interleaved repeats
.venv/bin/python -m bench.send_path 400 9
```

The same encoded records of workload 2 (`bench.synthetic.plan_run`), sent three ways to an
embedded Tansu, interleaved, each on fresh topics, one run at a time:

- `raw`: one `AIOKafkaProducer` (acks=all, `linger_ms=0`), `send` for each record and a wait for
  the acknowledgements at each of the capability's durability points, as a run does: the
  aiokafka floor of this shape of traffic;
- `eventlog`: `EventLog.append` (queued, handed over at the durability point) and
  `EventLog.wait_acked` at the same points;
- `eventlog-linger0`: the same with `linger_ms=0`;
- `eventlog-uncompressed`: `eventlog` with `compression_type=None`, as the raw producer sends
  (gzip is the log's default, decision 0007).

Prints CPU (`time.process_time`, this process only, so not the broker's) per record, min and
median over the repeats. `append` encodes each record, which the raw variant does not (its bytes
are made beforehand); the encoder's time per record is printed too, to subtract.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import sys
import time

from aiokafka import AIOKafkaProducer

from bench.common import fresh_topics
from bench.synthetic import Planned, gather, plan_run, run_id, send_wire, to_wire, write_run
from stepstream import Settings
from stepstream.embedded import EmbeddedStack
from stepstream.producer import EventLog
from stepstream.schemas import encode


async def raw(settings: Settings, plans: list[list[Planned]]) -> float:
    """CPU seconds per record: aiokafka `send` per record, a wait at each durability point."""
    wires = [[(to_wire(p.record, settings), p.durable) for p in plan] for plan in plans]
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers, acks='all', linger_ms=0)
    await producer.start()
    try:
        first = wires[0][0][0]
        await producer.send_and_wait(first.topic, first.value, key=first.key, headers=first.headers)
        cpu0 = time.process_time()
        for plan in wires:
            await write_run(plan, functools.partial(send_wire, producer), gather)
        cpu = time.process_time() - cpu0
    finally:
        await producer.stop()
    return cpu / sum(len(p) for p in plans)


async def eventlog(
    settings: Settings, plans: list[list[Planned]], linger_ms: int, compression: str | None = 'gzip'
) -> float:
    """CPU seconds per record: `EventLog.append` per record, `wait_acked` at each durability point."""
    async with EventLog(settings, linger_ms=linger_ms, compression_type=compression) as log:
        await log.wait_acked([await log.append(plan_run(run_id('warm', 0), 1)[0].record)])
        cpu0 = time.process_time()
        for plan in plans:
            await write_run(((p.record, p.durable) for p in plan), log.append, log.wait_acked)
        cpu = time.process_time() - cpu0
    return cpu / sum(len(p) for p in plans)


def encoding(plans: list[list[Planned]]) -> float:
    """CPU seconds per record of the Avro encoder alone."""
    records = [p.record for plan in plans for p in plan]
    cpu0 = time.process_time()
    for record in records:
        encode(record)
    return (time.process_time() - cpu0) / len(records)


# Each `EventLog` variant: its linger and its codec.
LOGS: dict[str, tuple[int, str | None]] = {
    'eventlog': (5, 'gzip'),
    'eventlog-linger0': (0, 'gzip'),
    'eventlog-uncompressed': (5, None),
    'eventlog-zstd': (5, 'zstd'),
    'eventlog-lz4': (5, 'lz4'),
}


async def measure(runs: int, repeats: int) -> dict[str, list[float]]:
    """Microseconds of CPU per record of each variant, one entry per repeat."""
    out: dict[str, list[float]] = {name: [] for name in ('raw', *LOGS, 'encode')}
    async with EmbeddedStack() as stack:
        for rep in range(repeats):
            plans = [plan_run(run_id(f'sp{rep}', i), 20) for i in range(runs)]
            out['raw'].append(await raw(await fresh_topics(stack.settings, 'sp-raw'), plans) * 1e6)
            for name, (linger_ms, codec) in LOGS.items():
                settings = await fresh_topics(stack.settings, f'sp-{name}')
                out[name].append(await eventlog(settings, plans, linger_ms, codec) * 1e6)
            out['encode'].append(encoding(plans) * 1e6)
    return out


def main() -> None:
    """Print the CPU per record of each variant."""
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    results = asyncio.run(measure(runs, repeats))
    for name, values in results.items():
        print(f'{name:21} CPU us/record: min {min(values):6.1f}  median {statistics.median(values):6.1f}')


if __name__ == '__main__':
    main()
