"""Workload 2: records per second acknowledged by one process, and the raw aiokafka ceiling.

- raw aiokafka: the same encoded records (value, key, headers), sent by one `AIOKafkaProducer`
  configured as `EventLog` configures its own (acks=all, its default linger), as fast as it
  takes them.
- EventLog, concurrent runs: many simulated runs share one `EventLog`; each appends its
  records in the capability's order and waits for acknowledgements at the capability's
  durability points. This is the figure the target is about.
- EventLog, append only: one task appends everything and flushes once (the log's own cost).
- agent runs: real `Agent` runs with `StepPersistence`, concurrently, for context: there the
  agent framework, not the log, sets the pace.
- ack round trip: one record at a time, acks=all, linger_ms=0: the floor of a durability point.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from aiokafka import AIOKafkaProducer

from bench.common import EVENTLOG_LINGER_MS, Scale, fresh_topics, median, percentile, say
from bench.synthetic import Planned, gather, plan_run, run_id, send_wire, to_wire, write_run
from bench.workload import timed_run
from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence

STEPS_PER_RUN = 20
# (concurrent runs, EventLog linger_ms): the default linger, and none (each record sent as
# it is appended) as a diagnosis.
CONCURRENT_RUNS = ((32, EVENTLOG_LINGER_MS), (256, EVENTLOG_LINGER_MS), (256, 0))
AGENT_RUNS = 16
AGENT_STEPS = 20


def _plans(prefix: str, total: int) -> list[list[Planned]]:
    per_run = len(plan_run('x', STEPS_PER_RUN))
    return [plan_run(run_id(prefix, i), STEPS_PER_RUN) for i in range(-(-total // per_run))]


async def raw_aiokafka(settings: Settings, plans: list[list[Planned]]) -> dict[str, Any]:
    """Ceiling: the same bytes through a bare producer, no per-record work but the send."""
    wires = [to_wire(p.record, settings) for plan in plans for p in plan]
    producer = AIOKafkaProducer(
        bootstrap_servers=settings.kafka.bootstrap_servers, acks='all', linger_ms=EVENTLOG_LINGER_MS
    )
    await producer.start()
    try:
        # Metadata for both topics first, so the timed part is sending only.
        await producer.send_and_wait(
            wires[0].topic, wires[0].value, key=wires[0].key, headers=wires[0].headers
        )
        t0 = time.perf_counter()
        acks = [await producer.send(w.topic, w.value, key=w.key, headers=w.headers) for w in wires]
        await asyncio.gather(*acks)
        elapsed = time.perf_counter() - t0
    finally:
        await producer.stop()
    size = sum(len(w.value) + len(w.key) + sum(len(k) + len(v) for k, v in w.headers) for w in wires)
    return {
        'records': len(wires),
        'seconds': elapsed,
        'records_per_s': len(wires) / elapsed,
        'mean_record_bytes': size / len(wires),
    }


async def raw_concurrent(
    settings: Settings,
    plans: list[list[Planned]],
    runs: int,
    compression: str | None = 'gzip',
    linger_ms: int = EVENTLOG_LINGER_MS,
) -> dict[str, Any]:
    """Raw aiokafka in the shape of the capability's traffic: `runs` simulated runs at a time,
    each sending its records with `send` and waiting at every durability point, on a producer
    configured as `EventLog` configures its own (acks=all, its linger, its codec); `linger_ms` is
    aiokafka's own here.

    The ceiling for `eventlog_concurrent` with the same waits: what aiokafka itself does with
    this traffic, where `raw_aiokafka` (no waits, no codec) is what it does at its best.
    """
    queue = list(reversed([[(to_wire(p.record, settings), p.durable) for p in plan] for plan in plans]))
    producer = AIOKafkaProducer(
        bootstrap_servers=settings.kafka.bootstrap_servers,
        acks='all',
        linger_ms=linger_ms,
        compression_type=compression,
    )
    await producer.start()
    try:
        first = queue[-1][0][0]
        await producer.send_and_wait(first.topic, first.value, key=first.key, headers=first.headers)

        async def worker() -> None:
            while queue:
                await write_run(queue.pop(), functools.partial(send_wire, producer), gather)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(runs)))
        await producer.flush()
        elapsed = time.perf_counter() - t0
    finally:
        await producer.stop()
    records = sum(len(p) for p in plans)
    return {'records': records, 'seconds': elapsed, 'records_per_s': records / elapsed, 'runs': runs}


async def eventlog_concurrent(
    settings: Settings, plans: list[list[Planned]], runs: int, linger_ms: int = EVENTLOG_LINGER_MS
) -> dict[str, Any]:
    """`runs` simulated runs at a time share one EventLog, waiting at every durability point."""
    queue = list(reversed(plans))
    async with EventLog(settings, linger_ms=linger_ms) as log:
        await log.wait_acked([await log.append(plan_run(run_id('warm', 0), 1)[0].record)])

        async def worker() -> None:
            while queue:
                await write_run(((p.record, p.durable) for p in queue.pop()), log.append, log.wait_acked)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(runs)))
        await log.flush()
        elapsed = time.perf_counter() - t0
    records = sum(len(p) for p in plans)
    return {
        'records': records,
        'seconds': elapsed,
        'records_per_s': records / elapsed,
        'runs': runs,
        'linger_ms': linger_ms,
    }


async def eventlog_append_only(settings: Settings, plans: list[list[Planned]]) -> dict[str, Any]:
    """One task appends every record, then one flush: the EventLog's per-record cost alone."""
    async with EventLog(settings) as log:
        await log.wait_acked([await log.append(plan_run(run_id('warm', 0), 1)[0].record)])
        t0 = time.perf_counter()
        for plan in plans:
            for planned in plan:
                await log.append(planned.record)
        await log.flush()
        elapsed = time.perf_counter() - t0
    records = sum(len(p) for p in plans)
    return {'records': records, 'seconds': elapsed, 'records_per_s': records / elapsed}


async def agent_runs(settings: Settings) -> dict[str, Any]:
    """Real agent runs with StepPersistence, `AGENT_RUNS` at a time, on one EventLog."""
    async with EventLog(settings) as log:
        await timed_run(2, [StepPersistence(log=log, agent_name='warm')])
        before = sum((await log.flush()).values())
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                timed_run(AGENT_STEPS, [StepPersistence(log=log, agent_name='bench')])
                for _ in range(AGENT_RUNS)
            )
        )
        after = sum((await log.flush()).values())
        elapsed = time.perf_counter() - t0
    records = after - before
    return {
        'records': records,
        'seconds': elapsed,
        'records_per_s': records / elapsed,
        'runs': AGENT_RUNS,
        'steps_per_run': AGENT_STEPS,
    }


async def ack_round_trip(settings: Settings, count: int = 300) -> dict[str, Any]:
    """One record at a time: what a durability point costs at least, on this broker."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers, acks='all', linger_ms=0)
    await producer.start()
    try:
        wire = to_wire(plan_run(run_id('rtt', 0), 1)[0].record, settings)
        await producer.send_and_wait(wire.topic, wire.value, key=wire.key)
        samples = []
        for _ in range(count):
            t0 = time.perf_counter()
            await producer.send_and_wait(wire.topic, wire.value, key=wire.key, headers=wire.headers)
            samples.append((time.perf_counter() - t0) * 1000)
    finally:
        await producer.stop()
    return {'p50_ms': median(samples), 'p99_ms': percentile(samples, 99), 'samples': count}


async def run(settings: Settings, scale: Scale) -> dict[str, Any]:
    out: dict[str, Any] = {}
    total = scale.producer_records

    async def on_fresh_topics(tag: str) -> Settings:
        return await fresh_topics(settings, tag)

    plans = _plans('bench-p', total)
    out['raw_aiokafka'] = await raw_aiokafka(await on_fresh_topics('w2-raw'), plans)
    say(f'  raw aiokafka          {out["raw_aiokafka"]["records_per_s"]:10,.0f} records/s')
    for runs, linger in CONCURRENT_RUNS:
        row = await eventlog_concurrent(
            await on_fresh_topics('w2-log'), _plans('bench-c', total), runs, linger
        )
        name = f'eventlog_{runs}_runs' + ('' if linger == EVENTLOG_LINGER_MS else f'_linger{linger}')
        out[name] = row
        say(f'  {name:22}{row["records_per_s"]:10,.0f} records/s')
    out['eventlog_append_only'] = await eventlog_append_only(
        await on_fresh_topics('w2-app'), _plans('bench-a', total)
    )
    say(f'  EventLog, append only {out["eventlog_append_only"]["records_per_s"]:10,.0f} records/s')
    out['agent_runs'] = await agent_runs(await on_fresh_topics('w2-agents'))
    say(f'  agent runs            {out["agent_runs"]["records_per_s"]:10,.0f} records/s')
    out['ack_round_trip'] = await ack_round_trip(await on_fresh_topics('w2-rtt'))
    say(f'  ack round trip        p50 {out["ack_round_trip"]["p50_ms"]:.2f} ms')
    return out
