"""Workload 3: projector throughput and rebuild time, against the machine's ceilings.

The topics are filled with a bare aiokafka producer and pre-encoded records (see
`synthetic.many_runs`): producing a million records through agents would take longer than the
whole benchmark may. Then, on the same records:

- raw consume: a bare consumer reads every record, doing nothing with it (the fetch ceiling);
- raw fastavro decode: `schemaless_reader` on the record bodies (the decode ceiling);
- stepstream decode: `stepstream.schemas.decode`, which also builds the record types;
- raw RocksDB: the records' bytes written with `WriteBatch` puts of 5,000 (the write ceiling);
- rebuild: a `Projector` from offset zero into an empty directory, as
  `stepstream.projector.rebuild` runs it; its rate is the projector's records applied per second.
"""

from __future__ import annotations

import asyncio
import io
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import RecordMetadata
from fastavro import schemaless_reader
from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from bench.common import Scale, dir_bytes, fresh, log_partitions, say
from bench.synthetic import Wire, many_runs
from stepstream import Settings
from stepstream.projector import Projector, Rebuilding
from stepstream.schemas import STEP_EVENT_SCHEMA, TOOL_EFFECT_SCHEMA, decode
from stepstream.topics import Position, ensure_topics

STEPS_PER_RUN = 50
BATCH = 5000


async def fill(settings: Settings, total: int) -> tuple[list[Wire], Position, dict[str, Any]]:
    """Produce about `total` records; returns a sample (for the ceilings), the end written, the rate."""
    await ensure_topics(settings)
    producer = AIOKafkaProducer(
        bootstrap_servers=settings.kafka.bootstrap_servers,
        acks='all',
        linger_ms=20,
        max_batch_size=256 * 1024,
    )
    await producer.start()
    sample: list[Wire] = []
    position: Position = {}

    def sampled(wires: Iterable[Wire]) -> Iterator[Wire]:
        for wire in wires:
            if len(sample) < 200_000:
                sample.append(wire)
            yield wire

    t0 = time.perf_counter()
    try:
        count = await produce(
            producer, sampled(many_runs(settings, 'bench-r', total, STEPS_PER_RUN)), position
        )
    finally:
        await producer.stop()
    elapsed = time.perf_counter() - t0
    return sample, position, {'records': count, 'seconds': elapsed, 'records_per_s': count / elapsed}


async def produce(producer: AIOKafkaProducer, wires: Iterable[Wire], position: Position) -> int:
    """Send every wire, awaiting acknowledgements 50,000 at a time; how many it sent (`position` advances)."""
    acks = []
    count = 0
    for wire in wires:
        acks.append(await producer.send(wire.topic, wire.value, key=wire.key, headers=wire.headers))
        count += 1
        if len(acks) >= 50_000:
            _advance(position, await asyncio.gather(*acks))
            acks = []
    _advance(position, await asyncio.gather(*acks))
    return count


def _advance(position: Position, acked: list[RecordMetadata]) -> None:
    for meta in acked:
        tp = meta.topic_partition
        position[tp] = max(position.get(tp, 0), meta.offset + 1)


async def raw_consume(settings: Settings, expected: int) -> dict[str, Any]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap_servers, enable_auto_commit=False, fetch_max_wait_ms=50
    )
    await consumer.start()
    try:
        partitions = log_partitions(settings, settings.topics.partitions)
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        count = 0
        t0 = time.perf_counter()
        while count < expected:
            batches = await consumer.getmany(timeout_ms=1000, max_records=BATCH)
            if not batches:
                break
            count += sum(len(b) for b in batches.values())
        elapsed = time.perf_counter() - t0
    finally:
        await consumer.stop()
    return {'records': count, 'seconds': elapsed, 'records_per_s': count / elapsed}


def decode_rates(sample: list[Wire], count: int) -> dict[str, Any]:
    values = [w.value for w in sample[:count]]
    parsed = {STEP_EVENT_SCHEMA.fingerprint: STEP_EVENT_SCHEMA.parsed}
    parsed[TOOL_EFFECT_SCHEMA.fingerprint] = TOOL_EFFECT_SCHEMA.parsed
    t0 = time.perf_counter()
    for v in values:
        schemaless_reader(io.BytesIO(v[10:]), parsed[v[2:10]], None)
    raw = time.perf_counter() - t0
    t0 = time.perf_counter()
    for v in values:
        decode(v)
    ours = time.perf_counter() - t0
    return {
        'records': len(values),
        'fastavro_records_per_s': len(values) / raw,
        'stepstream_decode_records_per_s': len(values) / ours,
    }


def rocksdb_rate(sample: list[Wire], count: int, workdir: Path) -> dict[str, Any]:
    """Batched puts of `count` records (keys made unique per record), as the projector's store opens them."""
    path = Path(tempfile.mkdtemp(prefix='rocks-', dir=workdir))
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    db = Rdict(str(path), options)
    write_options = WriteOptions()
    try:
        t0 = time.perf_counter()
        batch = WriteBatch(raw_mode=True)
        for i in range(count):
            wire = sample[i % len(sample)]
            batch.put(b'e\x00' + wire.key + b'\x00%020d' % i, wire.value)
            if (i + 1) % BATCH == 0:
                db.write(batch, write_options)
                batch = WriteBatch(raw_mode=True)
        db.write(batch, write_options)
        db.flush()
        elapsed = time.perf_counter() - t0
    finally:
        db.close()
        shutil.rmtree(path, ignore_errors=True)
    return {'records': count, 'seconds': elapsed, 'records_per_s': count / elapsed}


async def rebuild_from_zero(settings: Settings, into: Path, position: Position) -> dict[str, Any]:
    """What `stepstream.projector.rebuild` does, waiting for the position the fill wrote.

    `rebuild` itself waits for the end offsets the broker reports, which Tansu under-reports
    (by the rest of each partition's last batch), so it would stop short of the last records.
    """
    t0 = time.perf_counter()
    async with Projector(settings, db_path=into, create_topics=False, rebuilding=Rebuilding()) as projector:
        await projector.wait_for(position, timeout=1800)
        elapsed = time.perf_counter() - t0
        applied = projector.records_applied + projector.duplicates_ignored + projector.dead_lettered
    return {
        'records': applied,
        'seconds': elapsed,
        'records_per_s': applied / elapsed,
        'projection_bytes': await asyncio.to_thread(dir_bytes, into),
    }


async def run(settings: Settings, scale: Scale, workdir: Path) -> dict[str, Any]:
    run_settings = fresh(settings, 'w3')
    say(f'  filling the log with {scale.rebuild_records:,} records ...')
    sample, position, filled = await fill(run_settings, scale.rebuild_records)
    out: dict[str, Any] = {'fill': filled}
    say(f'  fill (raw producer)   {filled["records_per_s"]:10,.0f} records/s')
    out['raw_consume'] = await raw_consume(run_settings, filled['records'])
    say(f'  raw consume           {out["raw_consume"]["records_per_s"]:10,.0f} records/s')
    out['decode'] = await asyncio.to_thread(decode_rates, sample, scale.ceiling_records)
    say(
        f'  fastavro decode       {out["decode"]["fastavro_records_per_s"]:10,.0f} records/s; '
        f'stepstream decode {out["decode"]["stepstream_decode_records_per_s"]:,.0f}/s'
    )
    out['rocksdb'] = await asyncio.to_thread(rocksdb_rate, sample, filled['records'], workdir)
    say(f'  RocksDB batched puts  {out["rocksdb"]["records_per_s"]:10,.0f} records/s')
    del sample
    into = Path(tempfile.mkdtemp(prefix='rebuild-', dir=workdir)) / 'projection'
    out['rebuild'] = await rebuild_from_zero(run_settings, into, position)
    applied, elapsed = out['rebuild']['records'], out['rebuild']['seconds']
    say(f'  rebuild               {applied:,} records in {elapsed:.1f}s ({applied / elapsed:,.0f} records/s)')
    shutil.rmtree(into.parent, ignore_errors=True)
    return out
