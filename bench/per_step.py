"""Workload 1, stepstream side: per-step wall time and bytes per run, against no persistence.

Each stepstream run writes to topics of its own, with a projector consuming them in its own
process (as deployed), so the bytes counted are exactly that run's records. Baseline and
stepstream runs alternate, so drift on a shared machine hits both alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

from aiokafka import ConsumerRecord

from bench.common import (
    ProjectorProcess,
    Scale,
    dir_bytes,
    fresh,
    process_cpu_s,
    read_topics,
    record_bytes,
    say,
    stored_bytes,
)
from bench.workload import timed_run
from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.schemas import StepEvent, decode

# Where the capability waits for acknowledgements: a producer batch ends there.
DURABLE_KINDS = frozenset({'tool_call_started', 'snapshot_saved', 'run_completed', 'run_failed'})

# The headline variant (EventLog as configured by default), and two diagnoses (see
# `_variants_at`): every record sent as it is appended (`linger_ms=0`, the default before
# decision 0025), and what the projector process costs by sharing the 2 cores.
VARIANTS: dict[str, dict[str, Any]] = {
    'stepstream': {'linger_ms': None, 'projector': True},
    'stepstream-linger0': {'linger_ms': 0, 'projector': True},
    'stepstream-no-projector': {'linger_ms': None, 'projector': False},
}


async def _stepstream_run(
    settings: Settings,
    n: int,
    workdir: Path,
    *,
    linger_ms: int | None,
    projector: bool,
    broker_pid: int | None = None,
) -> dict[str, Any]:
    run_settings = fresh(settings, f'w1-{n}')
    db_path = Path(tempfile.mkdtemp(prefix=f'proj-{n}-', dir=workdir))
    async with contextlib.AsyncExitStack() as stack:
        child = (
            await stack.enter_async_context(ProjectorProcess(run_settings, db_path)) if projector else None
        )
        log_of = EventLog(run_settings) if linger_ms is None else EventLog(run_settings, linger_ms=linger_ms)
        async with log_of as log:
            capability = StepPersistence(log=log, agent_name='bench')
            broker_cpu = process_cpu_s(broker_pid)
            timing = await timed_run(n, [capability])
            broker_cpu = process_cpu_s(broker_pid) - broker_cpu
            position = await log.flush()
        applied = await child.finish(position) if child is not None else None
    records = await read_topics(run_settings, position)
    if applied is not None and applied['records_applied'] != len(records):
        raise RuntimeError(f'projector applied {applied["records_applied"]} of {len(records)} records')
    return {
        **timing.as_dict(),
        # As stored: record batches with compression and framing. The records' own sizes too.
        'bytes': await stored_bytes(run_settings, position),
        'record_bytes': sum(record_bytes(r) for r in records),
        'records': len(records),
        'bytes_breakdown': breakdown(records),
        # CPU per step of the other two processes on the 2 cores (the agent's is cpu_per_step_ms).
        'broker_cpu_per_step_ms': broker_cpu * 1000 / n if broker_pid else None,
        'projector_cpu_per_step_ms': applied['cpu_s'] * 1000 / n if applied else None,
        'projector': applied,
        'projection_bytes': await asyncio.to_thread(dir_bytes, db_path),
    }


def breakdown(records: list[ConsumerRecord[bytes, bytes]]) -> dict[str, Any]:
    """Where a run's bytes go, and what two known savings would leave.

    - by kind: value + key + headers per event kind / effect status;
    - resent: snapshot tail messages that an earlier snapshot of the run already carried (the
      capability re-sends the previous tail when the graph stamped it after it was saved);
    - gzip estimate: each producer batch compressed with zlib (Kafka's gzip codec, the one
      aiokafka supports without extra packages). In a single run a batch is what one topic
      received between two durability points; record framing is left out.
    """
    decoded = sorted(((decode(r.value or b''), r) for r in records), key=lambda d: (d[0].run_id, d[0].seq))
    by_kind: dict[str, int] = defaultdict(int)
    resent = 0
    carried: dict[str, int] = {}  # run_id -> messages in its previous snapshot
    segments: dict[tuple[str, str, int], list[bytes]] = defaultdict(list)
    segment = 0
    for record, raw in decoded:
        kind = record.kind if isinstance(record, StepEvent) else f'effect {record.status}'
        by_kind[kind] += record_bytes(raw)
        segments[(record.run_id, raw.topic, segment)].append(
            (raw.key or b'') + (raw.value or b'') + b''.join(k.encode() + v for k, v in raw.headers)
        )
        if isinstance(record, StepEvent) and record.snapshot is not None:
            snap = record.snapshot
            tail = json.loads(snap.messages)
            before = carried.get(record.run_id, 0)
            for index, message in enumerate(tail, start=snap.prefix_len):
                if index < before:
                    resent += len(json.dumps(message, separators=(',', ':'), ensure_ascii=False).encode())
            carried[record.run_id] = snap.prefix_len + len(tail)
        if isinstance(record, StepEvent) and record.kind in DURABLE_KINDS:
            segment += 1
    total = sum(record_bytes(r) for r in records)
    gzipped = sum(len(zlib.compress(b''.join(parts), 6)) for parts in segments.values())
    return {
        'by_kind': dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        'resent_snapshot_bytes': resent,
        'without_resent_bytes': total - resent,
        'gzip_batches_estimate_bytes': gzipped,
    }


def _variants_at(n: int, rep: int) -> list[str]:
    if n == 200:
        return list(VARIANTS)
    if n > 200 and rep == 0:
        return ['stepstream', 'stepstream-no-projector']
    return ['stepstream']


async def run(
    settings: Settings, scale: Scale, workdir: Path, *, broker_pid: int | None = None
) -> list[dict[str, Any]]:
    """Rows for `none` and `stepstream` at every N, and the diagnostic variants at N=200."""
    rows: list[dict[str, Any]] = []
    # Warm up: imports, schema builds, topic metadata paths; untimed.
    await timed_run(5)
    await _stepstream_run(settings, 5, workdir, **VARIANTS['stepstream'])
    for n in scale.ns:
        # A 1000-step run takes about a minute: two repeats, and the no-projector diagnosis once,
        # to tell stepstream's own growth from the broker's (its fetches slow as the log grows).
        repeats = scale.repeats if n <= 200 else min(scale.repeats, 2)
        for rep in range(repeats):
            for variant in ['none', *_variants_at(n, rep)]:
                t0 = time.perf_counter()
                if variant == 'none':
                    row: dict[str, Any] = {**(await timed_run(n)).as_dict(), 'bytes': 0}
                else:
                    row = await _stepstream_run(
                        settings, n, workdir, **VARIANTS[variant], broker_pid=broker_pid
                    )
                row.update(variant=variant, rep=rep)
                rows.append(row)
                say(
                    f'  {variant:18} N={n:<5} {row["per_step_ms"]:8.2f} ms/step '
                    f'{row["bytes"] / 1e6:8.3f} MB  [{time.perf_counter() - t0:.1f}s]'
                )
    return rows
