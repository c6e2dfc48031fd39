"""Where a freshness probe's latency goes, per 5-second window (workload 4, traced).

```sh
.venv/bin/python -m bench.freshness_trace stepstream 30   # EventLog -> Projector -> get_run
.venv/bin/python -m bench.freshness_trace raw 30          # the ceiling: bare producer, bare consumer
.venv/bin/python -m bench.freshness_trace log 30          # EventLog's traffic, read by a bare consumer
.venv/bin/python -m bench.freshness_trace raw0 30         # the ceiling, its producer not lingering
```

Runs `bench.freshness`'s load and probes on a fresh embedded stack (`STEPSTREAM_EMBEDDED_BROKER`
picks the broker) with aiokafka's fetch and produce requests and the projector's steps
timestamped (by wrapping them in this process only), then splits each probe's latency:

- `ack>fetch`: from its acknowledgement to the end of the fetch response that carried it
  (the broker's share: a record waits for the next fetch, and the fetch for the broker);
- `fetch>get`: from there to `getmany` returning it (the consumer's loop);
- `get>applied`: to `AppliedPosition.advance` covering it (pacing, staging, the RocksDB commit);
- `applied>woken`: to `Projector.wait_for` returning; `get_run`: the read itself.

The `raw0` variant is the ceiling with its producer's linger at 0: it sends at a durability
point at once, as `EventLog` does, where the ceiling's aiokafka waits out its 5 ms linger.

The `log` variant separates the write side's log from the read side: the same traffic as the
stepstream variant, read by the ceiling's bare consumer. Also per window: fetch round trips,
records per `getmany`, the projector's batch wall time and its staging CPU, the event loop's lag
(overshoot of a 5 ms sleep) and the CPU of this process and of the broker.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiokafka.consumer.fetcher as fetcher_module
import aiokafka.producer.sender as sender_module
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import RecordMetadata

from bench import freshness
from bench.common import EVENTLOG_LINGER_MS, Scale, fresh, median, percentile
from stepstream.embedded import EmbeddedStack
from stepstream.producer import EventLog
from stepstream.projector import Projector
from stepstream.projector._pipeline import BatchPipeline
from stepstream.projector._progress import AppliedPosition
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import LogRecord

WINDOW_S = 5.0
now = time.perf_counter
events: dict[str, list[Any]] = {
    k: [] for k in ('fetch', 'getmany', 'batch', 'advance', 'probe', 'lag', 'cpu', 'produce')
}


def _wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    setattr(owner, name, make(getattr(owner, name)))


def instrument() -> None:
    """Timestamp fetches, produce requests, `getmany`, the projector's batches and its advances."""

    def fetch(original: Any) -> Any:
        async def traced(self: Any, assignment: Any, node_id: int, request: Any) -> Any:
            sent = now()
            asked = {(topic, p[0]): p[1] for topic, parts in request.topics for p in parts}
            try:
                return await original(self, assignment, node_id, request)
            finally:
                events['fetch'].append((self._client._client_id, sent, now(), asked))

        return traced

    def produce(original: Any) -> Any:
        async def traced(self: Any, node_id: int, batches: dict[Any, Any]) -> Any:
            events['produce'].append((now(), len(batches)))
            return await original(self, node_id, batches)

        return traced

    def getmany(original: Any) -> Any:
        async def traced(self: AIOKafkaConsumer, *args: Any, **kwargs: Any) -> Any:
            got = await original(self, *args, **kwargs)
            spans = {(tp.topic, tp.partition): (m[0].offset, m[-1].offset) for tp, m in got.items() if m}
            if spans:
                events['getmany'].append((self._client._client_id, now(), spans))
            return got

        return traced

    def batch(original: Any) -> Any:
        async def traced(self: Any, consumer: Any, by_shard: dict[int, list[Any]], *args: Any) -> None:
            started, cpu = now(), time.thread_time()
            await original(self, consumer, by_shard, *args)
            records = sum(len(r) for r in by_shard.values())
            events['batch'].append((started, now(), records, time.thread_time() - cpu))

        return traced

    def advance(original: Any) -> Any:
        async def traced(self: AppliedPosition, offsets: Any) -> None:
            events['advance'].append((now(), {(tp.topic, tp.partition): o for tp, o in offsets.items()}))
            await original(self, offsets)

        return traced

    _wrap(fetcher_module.Fetcher, '_proc_fetch_request', fetch)
    _wrap(sender_module.Sender, '_send_produce_req', produce)
    _wrap(AIOKafkaConsumer, 'getmany', getmany)
    _wrap(BatchPipeline, '_stage_batch', batch)
    _wrap(AppliedPosition, 'advance', advance)


def _cpu_seconds(pid: int | None) -> float:
    if not pid:
        return 0.0
    fields = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


async def _watch(stop: asyncio.Event, broker_pid: int | None) -> None:
    """The loop's lag (overshoot of a 5 ms sleep) and, each second, this process's and the broker's CPU."""
    last, cpu, broker = now(), time.process_time(), _cpu_seconds(broker_pid)
    while not stop.is_set():
        before = now()
        await asyncio.sleep(0.005)
        events['lag'].append((before, now() - before - 0.005))
        if now() - last >= 1.0:
            elapsed, cpu_now, broker_now = now() - last, time.process_time(), _cpu_seconds(broker_pid)
            events['cpu'].append((now(), (cpu_now - cpu) / elapsed, (broker_now - broker) / elapsed))
            last, cpu, broker = now(), cpu_now, broker_now


def _probe(t0: float, applied: float, read: float, meta: RecordMetadata) -> None:
    events['probe'].append((t0, applied, read, (meta.topic, meta.partition), meta.offset))


async def _stepstream(stack: EmbeddedStack, scale: Scale, workdir: Path) -> dict[str, Any]:
    settings = fresh(stack.settings, 'w4')
    db_path = Path(tempfile.mkdtemp(prefix='fresh-', dir=workdir))
    async with EventLog(settings) as log, Projector(settings, db_path=db_path) as projector:
        reader = ProjectionReader.of(projector)
        await projector.wait_for(await log.flush())

        async def visible(record: LogRecord, meta: RecordMetadata) -> None:
            t0 = now()
            await projector.wait_for({meta.topic_partition: meta.offset + 1})
            applied = now()
            if await reader.get_run(record.run_id) is None:
                raise RuntimeError(f'probe {record.run_id} applied but not visible')
            _probe(t0, applied, now(), meta)

        return await freshness._drive(log.append, log.wait_acked, visible, scale, 1000.0)


async def _log(stack: EmbeddedStack, scale: Scale) -> dict[str, Any]:
    settings = fresh(stack.settings, 'w4-log')
    async with EventLog(settings) as log:
        await log.flush()
        async with freshness.bare_reader(settings) as fetched:  # the ceiling's consumer

            async def visible(record: LogRecord, meta: RecordMetadata) -> None:
                t0 = now()
                await fetched(meta)
                _probe(t0, now(), now(), meta)

            return await freshness._drive(log.append, log.wait_acked, visible, scale, 1000.0)


async def _raw(stack: EmbeddedStack, scale: Scale, *, linger_ms: int) -> dict[str, Any]:
    drive = freshness._drive

    async def traced(append: Any, wait_acked: Any, visible: Any, scale: Scale, rate: float) -> dict[str, Any]:
        async def timed(record: LogRecord, meta: RecordMetadata) -> None:
            t0 = now()
            await visible(record, meta)
            _probe(t0, now(), now(), meta)

        return await drive(append, wait_acked, timed, scale, rate)

    freshness._drive = traced  # type: ignore[assignment]
    try:
        return await freshness.raw_ceiling(stack.settings, scale, linger_ms=linger_ms)
    finally:
        freshness._drive = drive


@dataclass(frozen=True)
class _Scale(Scale):
    seconds: float = 30.0

    @property
    def freshness_s(self) -> float:
        return self.seconds


async def main(variant: str, seconds: float) -> None:
    instrument()
    workdir = Path(tempfile.mkdtemp(prefix='stepstream-trace-'))
    async with EmbeddedStack() as stack:
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch(stop, stack.pids.get('broker')))
        scale = _Scale(quick=False, full=False, seconds=seconds)
        if variant == 'stepstream':
            result = await _stepstream(stack, scale, workdir)
        elif variant == 'log':
            result = await _log(stack, scale)
        else:
            result = await _raw(stack, scale, linger_ms=0 if variant == 'raw0' else EVENTLOG_LINGER_MS)
        stop.set()
        await watcher
    report(variant, result)


def _ms(values: list[float | None]) -> float:
    present = [v for v in values if v is not None]
    return median(present) * 1000 if present else float('nan')


def report(variant: str, result: dict[str, Any]) -> None:
    """Print the per-window split of the probes' latency and what the loop and the broker did."""
    projector = variant == 'stepstream'
    mine = (
        (lambda client: client == 'stepstream-projector')
        if projector
        else (lambda client: client != 'stepstream-projector')
    )
    fetches = sorted((f for f in events['fetch'] if mine(f[0])), key=lambda f: f[1])
    gets = [g for g in events['getmany'] if mine(g[0])]
    by_tp: dict[Any, list[tuple[int, float]]] = {}
    for _, _, done, asked in fetches:
        for tp, position in asked.items():
            by_tp.setdefault(tp, []).append((position, done))
    start = events['probe'][0][0]
    rows = []
    for t0, applied, read, tp, offset in events['probe']:
        # The fetch that carried the record: the last one for its partition that asked from at
        # or below its offset (the next one asks from past it).
        asked_from = by_tp.get(tp, [])
        i = bisect.bisect_right([position for position, _ in asked_from], offset) - 1
        fetched = asked_from[i][1] if 0 <= i < len(asked_from) - 1 else None
        got = next((g[1] for g in gets if tp in g[2] and g[2][tp][0] <= offset <= g[2][tp][1]), None)
        advanced = next((a[0] for a in events['advance'] if a[1].get(tp, -1) > offset), None)
        rows.append((t0 - start, t0, fetched, got, advanced if projector else None, applied, read))

    def split(rows: list[Any]) -> list[float]:
        return [
            _ms([r[6] - r[1] for r in rows]),
            _ms([r[2] - r[1] if r[2] else None for r in rows]),
            _ms([r[3] - r[2] if r[3] and r[2] else None for r in rows]),
            _ms([r[4] - r[3] if r[4] and r[3] else None for r in rows]),
            _ms([r[5] - r[4] if r[4] else None for r in rows]),
            _ms([r[6] - r[5] for r in rows]),
        ]

    print(
        f'{variant}: p50 {result["p50_ms"]:.1f} ms, p99 {result["p99_ms"]:.1f} ms, '
        f'{result["samples"]} probes; medians in ms per {WINDOW_S:g} s window'
    )
    print(
        'win probes total ack>fetch fetch>get get>applied applied>woken get_run | fetch_rtt '
        'fetches/s recs/get batch_ms batch_cpu loop_lag p99 | cpu_self cpu_broker batches/s'
    )
    for w in range(int(rows[-1][0] // WINDOW_S) + 1):
        lo, hi = start + w * WINDOW_S, start + (w + 1) * WINDOW_S
        chosen = [r for r in rows if w * WINDOW_S <= r[0] < (w + 1) * WINDOW_S]
        if len(chosen) < 5:
            continue
        window_gets = [g for g in gets if lo <= g[1] < hi]
        batches = [b for b in events['batch'] if lo <= b[0] < hi]
        lag = [x[1] * 1000 for x in events['lag'] if lo <= x[0] < hi]
        cpu = [x for x in events['cpu'] if lo <= x[0] < hi] or [(0, 0.0, 0.0)]
        records = sum(sum(b - a + 1 for a, b in g[2].values()) for g in window_gets)
        parts = ' '.join(f'{v:6.1f}' for v in split(chosen))
        print(
            f'{w:3d} {len(chosen):6d} {parts} | '
            f'{_ms([f[2] - f[1] for f in fetches if lo <= f[2] < hi]):6.1f} '
            f'{len([f for f in fetches if lo <= f[2] < hi]) / WINDOW_S:6.1f} '
            f'{records / max(len(window_gets), 1):6.1f} '
            f'{_ms([b[1] - b[0] for b in batches]):6.2f} {_ms([b[3] for b in batches]):6.2f} '
            f'{median(lag) if lag else 0:6.2f} {percentile(lag, 99) if lag else 0:6.1f} | '
            f'{sum(c[1] for c in cpu) / len(cpu):5.2f} {sum(c[2] for c in cpu) / len(cpu):5.2f} '
            f'{sum(p[1] for p in events["produce"] if lo <= p[0] < hi) / WINDOW_S:7.1f}'
        )
    totals = sorted(r[6] - r[1] for r in rows)
    slowest = [r for r in rows if r[6] - r[1] >= totals[int(len(totals) * 0.9)]]
    print('slowest 10%:', ' '.join(f'{v:6.1f}' for v in split(slowest)))


if __name__ == '__main__':
    which = sys.argv[1] if len(sys.argv) > 1 else 'stepstream'
    if which not in ('stepstream', 'raw', 'raw0', 'log'):
        raise SystemExit('usage: python -m bench.freshness_trace stepstream|raw|raw0|log [SECONDS]')
    asyncio.run(main(which, float(sys.argv[2]) if len(sys.argv) > 2 else 30.0))
