"""Workload 4: from the broker's acknowledgement to visibility in `ProjectionReader`.

Background writers append synthetic runs at a steady rate (1,000 records/s by default) in the
capability's pattern, waiting for acknowledgements at its durability points. Every 50 ms a
probe appends the `run_started` of a new run; its latency runs from the moment its
acknowledgement resolves to the moment it is visible:

- stepstream: `Projector.wait_for` returns for its offset and `reader.get_run` finds the run
  (writers, probes and projector share one process, as in the design's read-your-writes
  example);
- raw aiokafka (the ceiling): the same traffic from a bare producer, and a bare consumer holds
  the record (no decode, no RocksDB). It shows the broker's own share: Tansu's fetch slows as
  a partition grows (docs/benchmarks/history/2026-11-30-recorded-run.md, "Broker findings").
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import RecordMetadata, TopicPartition

from bench.common import EVENTLOG_LINGER_MS, Scale, fresh, log_partitions, median, percentile, say
from bench.synthetic import plan_run, run_id, to_wire
from stepstream import Settings
from stepstream.producer import EventLog
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import LogRecord
from stepstream.topics import ensure_topics

PROBE_INTERVAL_S = 0.05
WRITERS = 8

Ack = asyncio.Future[RecordMetadata]
Append = Callable[[LogRecord], Awaitable[Ack]]
WaitAcked = Callable[[Iterable[Ack]], Awaitable[Any]]
Visible = Callable[[LogRecord, RecordMetadata], Awaitable[None]]


async def _drive(
    append: Append, wait_acked: WaitAcked, visible: Visible, scale: Scale, rate: float
) -> dict[str, Any]:
    """Steady background load plus probes; returns the probes' ack -> visible latencies."""
    stop = asyncio.Event()
    background = 0
    latencies: list[float] = []
    timeline: list[tuple[float, float]] = []
    t0 = time.perf_counter()

    async def writer(lane: int) -> None:
        # Several runs at a time: one run alone cannot reach the rate, since it waits at its
        # durability points. The lanes share one schedule: record k is due at t0 + k/rate.
        nonlocal background
        index = lane
        while not stop.is_set():
            pending = []
            for planned in plan_run(run_id('bg', index), 20):
                delay = t0 + background / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                background += 1
                pending.append(await append(planned.record))
                if planned.durable:
                    await wait_acked(pending)
                    pending = []
                if stop.is_set():
                    break
            index += WRITERS

    async def probe(index: int) -> None:
        record = plan_run(run_id('probe', index), 1)[0].record
        acked_at: list[float] = []
        ack = await append(record)
        ack.add_done_callback(lambda _: acked_at.append(time.perf_counter()))
        await wait_acked([ack])
        await visible(record, ack.result())
        latencies.append((time.perf_counter() - acked_at[0]) * 1000)
        timeline.append((acked_at[0] - started, latencies[-1]))

    load = [asyncio.create_task(writer(lane)) for lane in range(WRITERS)]
    await asyncio.sleep(1.0)  # settle into the steady rate
    started = time.perf_counter()
    background_at_start = background
    probes = []
    index = 0
    while time.perf_counter() - started < scale.freshness_s:
        probes.append(asyncio.create_task(probe(index)))
        index += 1
        await asyncio.sleep(PROBE_INTERVAL_S)
    await asyncio.gather(*probes)
    elapsed = time.perf_counter() - started
    achieved = (background - background_at_start) / elapsed
    stop.set()
    await asyncio.gather(*load)
    return {
        'samples': len(latencies),
        'p50_ms': median(latencies),
        'p99_ms': percentile(latencies, 99),
        'max_ms': max(latencies),
        'background_records_per_s': achieved,
        'target_background_records_per_s': rate,
        'p50_by_5s_ms': _windows(timeline, 5.0),
    }


def _windows(timeline: list[tuple[float, float]], width: float) -> list[float]:
    """p50 latency per `width`-second window of the measurement: does it drift as the log grows?"""
    buckets: dict[int, list[float]] = {}
    for at, latency in timeline:
        buckets.setdefault(int(at // width), []).append(latency)
    return [round(median(buckets[k]), 1) for k in sorted(buckets)]


async def run(settings: Settings, scale: Scale, workdir: Path, *, rate: float = 1000.0) -> dict[str, Any]:
    """stepstream: EventLog -> Tansu -> Projector -> ProjectionReader, in one process."""
    run_settings = fresh(settings, 'w4')
    db_path = Path(tempfile.mkdtemp(prefix='fresh-', dir=workdir))
    async with EventLog(run_settings) as log, Projector(run_settings, db_path=db_path) as projector:
        reader = ProjectionReader.of(projector)
        await projector.wait_for(await log.flush())

        async def visible(record: LogRecord, meta: RecordMetadata) -> None:
            await projector.wait_for({meta.topic_partition: meta.offset + 1})
            if await reader.get_run(record.run_id) is None:
                raise RuntimeError(f'probe {record.run_id} applied but not visible')

        result = await _drive(log.append, log.wait_acked, visible, scale, rate)
    say(
        f'  freshness             p50 {result["p50_ms"]:.1f} ms, p99 {result["p99_ms"]:.1f} ms '
        f'({result["samples"]} probes at {result["background_records_per_s"]:,.0f} records/s background)'
    )
    return result


@contextlib.asynccontextmanager
async def bare_reader(settings: Settings) -> AsyncIterator[Callable[[RecordMetadata], Awaitable[None]]]:
    """The ceiling's consumer: both log topics from the beginning, read by a task of its own.

    Yields `fetched(meta)`, which returns once the record acknowledged with `meta` was fetched.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap_servers, enable_auto_commit=False, fetch_max_wait_ms=50
    )
    seen: dict[TopicPartition, int] = {}
    progress = asyncio.Condition()

    async def consume() -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=100)
            if batches:
                async with progress:
                    for tp, messages in batches.items():
                        seen[tp] = messages[-1].offset + 1
                    progress.notify_all()

    async def fetched(meta: RecordMetadata) -> None:
        async with progress:
            await progress.wait_for(lambda: seen.get(meta.topic_partition, 0) > meta.offset)

    await consumer.start()
    try:
        partitions = log_partitions(settings, settings.topics.partitions)
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        reader = asyncio.create_task(consume())
        try:
            yield fetched
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
    finally:
        await consumer.stop()


async def raw_ceiling(
    settings: Settings, scale: Scale, *, rate: float = 1000.0, linger_ms: int = EVENTLOG_LINGER_MS
) -> dict[str, Any]:
    """The same traffic through a bare producer and a bare consumer.

    The producer lingers `linger_ms` (`EventLog`'s default) also while a writer waits at a
    durability point, which `EventLog` never does (decision 0025); `linger_ms=0` sends as
    `EventLog` does at a durability point, at once.
    """
    run_settings = fresh(settings, 'w4-raw')
    await ensure_topics(run_settings)
    producer = AIOKafkaProducer(
        bootstrap_servers=run_settings.kafka.bootstrap_servers, acks='all', linger_ms=linger_ms
    )

    async def append(record: LogRecord) -> Ack:
        wire = to_wire(record, run_settings)
        return await producer.send(wire.topic, wire.value, key=wire.key, headers=wire.headers)

    async def wait_acked(acks: Iterable[Ack]) -> None:
        await asyncio.gather(*acks)

    await producer.start()
    try:
        async with bare_reader(run_settings) as fetched:

            async def visible(record: LogRecord, meta: RecordMetadata) -> None:
                await fetched(meta)

            result = await _drive(append, wait_acked, visible, scale, rate)
    finally:
        await producer.stop()
    say(f'  raw aiokafka          p50 {result["p50_ms"]:.1f} ms, p99 {result["p99_ms"]:.1f} ms (ceiling)')
    return result
