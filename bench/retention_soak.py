"""Bounded growth, measured: runs written for several simulated retention windows.

    .venv/bin/python -m bench.retention_soak [--days 5] [--runs-per-hour 30] [--steps 8] [--out FILE]

Log time is simulated (every record carries a timestamp of the simulated hour), so six days of
log fit in minutes. Each simulated hour, `--runs-per-hour` runs of `--steps` tool steps start and
end; each run offloads one payload of its own (4 KiB, to the media bucket: the embedded stack's
SeaweedFS) and references one payload all runs share. The runs' records go through the
projector's apply rules into a RocksDB shard on disk (the path `bench.apply_rate` measures; the
broker adds nothing to what is kept). The same workload is applied twice, into a projection
without a policy and into one that keeps runs for one simulated day; with the policy, a media
sweep follows every simulated six hours (the projection is always caught up here, and no
writer races it, so the sweep's grace period does not apply: `now` is put past it).

Every simulated hour it records, for both projections: the live bytes of the projection (keys
and values; what RocksDB holds after compaction), its bytes on disk, the bucket's bytes, and the
apply rate of that hour's records (per CPU second). The summary and every sample go to `--out`
(default bench/results/retention-soak.json); `--plot PNG` draws them (`bench.plot_retention`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelRequest, UserPromptPart

from bench.common import dir_bytes, say
from bench.synthetic import _tail_json, plan_run
from stepstream.embedded import EmbeddedStack
from stepstream.media import S3MediaStore
from stepstream.projector._apply import EFFECTS, EVENTS, Applier, SourceRecord
from stepstream.readmodel import ProjectionReader, sweep_media
from stepstream.schemas import StepEvent, encode
from stepstream.storage import Identity, Shard
from stepstream.topics import murmur2_partition

T0 = datetime(2026, 1, 1, tzinfo=UTC)
DAY_US = 86_400_000_000
TOPICS = ('soak.step-events', 'soak.tool-effects')
PARTITION = 0
PAYLOAD_BYTES = 4096


@dataclass
class Projection:
    """One projection of the soak: its shard, its applier, the records' next offsets."""

    name: str
    path: Path
    shard: Shard
    applier: Applier
    offsets: dict[int, int]


def hour_of_runs(
    hour: int, runs: int, steps: int, shared_uri: str, uris: list[str]
) -> list[tuple[int, bytes, bytes]]:
    """(topic, key, value) of the runs that start and end in one simulated hour, in append order."""
    out = []
    start = T0 + timedelta(hours=hour)
    for i in range(runs):
        rid = f'soak-{hour:05d}-{i:04d}'
        planned = [p.record for p in plan_run(rid, steps, start=start + timedelta(seconds=i * 3600 / runs))]
        # The first snapshot's prompt references the run's own payload and the shared one, as
        # the media walker leaves them in a record: their URIs in place of the bytes.
        at, first = next(
            (n, r) for n, r in enumerate(planned) if isinstance(r, StepEvent) and r.snapshot is not None
        )
        assert isinstance(first, StepEvent) and first.snapshot is not None
        prompt = ModelRequest(parts=[UserPromptPart([uris[i], shared_uri])])
        tail = [prompt, *ModelMessagesTypeAdapter.validate_json(first.snapshot.messages)[1:]]
        planned[at] = replace(first, snapshot=replace(first.snapshot, messages=_tail_json(tail)))
        for record in planned:
            topic = EVENTS if isinstance(record, StepEvent) else EFFECTS
            out.append((topic, rid.encode(), encode(record)))
    return out


def live_bytes(shard: Shard) -> int:
    return sum(len(k) + len(v) for k, v in shard.items())


async def soak(days: int, runs_per_hour: int, steps: int, workdir: Path) -> dict[str, Any]:
    stack = EmbeddedStack()
    await asyncio.to_thread(stack.start)
    try:
        settings = stack.settings
        prefix = f'soak-{os.getpid()}'
        store = S3MediaStore.from_settings(settings.media, key_prefix=prefix)
        shared_uri = await store.put(b'shared system prompt. ' * 200)
        projections = []
        for name, retain in (('keep-all', None), ('retain-1d', DAY_US)):
            path = workdir / name
            path.mkdir()
            identity = Identity(
                format=Identity.FORMAT,
                topic_prefix='soak',
                cluster='soak',
                max_snapshots_per_run=None,
                partitions=1,
                partition=PARTITION,
                retain_ended_us=retain,
            )
            shard = Shard.create(path, PARTITION, identity)
            applier = Applier(TOPICS, partitions=1, retain_ended_us=retain)
            projections.append(Projection(name, path, shard, applier, {EVENTS: 0, EFFECTS: 0}))
        samples: list[dict[str, Any]] = []
        uploaded = 0
        for hour in range(days * 24):
            uris = [await store.put(os.urandom(PAYLOAD_BYTES)) for _ in range(runs_per_hour)]
            uploaded += runs_per_hour * PAYLOAD_BYTES
            records = hour_of_runs(hour, runs_per_hour, steps, shared_uri, uris)
            sample: dict[str, Any] = {'hour': hour, 'uploaded_bytes': uploaded}
            for p in projections:
                batch = []
                for topic, key, value in records:
                    assert murmur2_partition(key, 1) == PARTITION
                    batch.append(SourceRecord(topic, PARTITION, p.offsets[topic], key, value))
                    p.offsets[topic] += 1
                cpu = time.process_time()
                txn, _ = p.applier.stage(p.shard, batch)
                txn.commit()
                cpu = time.process_time() - cpu
                sample[f'{p.name}.apply_per_cpu_s'] = round(len(batch) / cpu) if cpu else None
                sample[f'{p.name}.live_bytes'] = live_bytes(p.shard)
            retained = projections[1]
            if hour % 6 == 5:
                retained.shard.flush()
                reader = ProjectionReader.open(retained.path)
                try:
                    report = await sweep_media(
                        reader, store, grace=timedelta(hours=2), now=datetime.now(UTC) + timedelta(hours=3)
                    )
                finally:
                    reader.close()
                sample['swept_bytes'] = report.deleted_bytes
            sample['bucket_bytes'] = sum([p.size async for p in store.payloads()])
            for p in projections:
                p.shard.flush()
                sample[f'{p.name}.disk_bytes'] = await asyncio.to_thread(dir_bytes, p.path)
            samples.append(sample)
            if hour % 12 == 11:
                say(
                    f'  day {(hour + 1) / 24:4.1f}: projection {sample["keep-all.live_bytes"] / 1e6:7.1f} MB '
                    f'kept all, {sample["retain-1d.live_bytes"] / 1e6:7.1f} MB retaining 1 day; bucket '
                    f'{sample["bucket_bytes"] / 1e6:6.1f} MB of {uploaded / 1e6:6.1f} MB uploaded'
                )
        for p in projections:
            p.shard.close()
        return {
            'days': days,
            'runs_per_hour': runs_per_hour,
            'steps': steps,
            'records_per_run': len(hour_of_runs(0, 1, steps, shared_uri, [shared_uri])),
            'payload_bytes': PAYLOAD_BYTES,
            'samples': samples,
        }
    finally:
        await asyncio.to_thread(stack.stop)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog='python -m bench.retention_soak', description=__doc__.split('\n')[0]
    )
    parser.add_argument('--days', type=int, default=5)
    parser.add_argument('--runs-per-hour', type=int, default=30)
    parser.add_argument('--steps', type=int, default=8)
    parser.add_argument('--out', type=Path, default=Path('bench/results/retention-soak.json'))
    parser.add_argument(
        '--plot', type=Path, metavar='PNG', help='also draw the figures (bench/.venv-harness)'
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix='stepstream-soak-') as workdir:
        started = time.perf_counter()
        result = asyncio.run(soak(args.days, args.runs_per_hour, args.steps, Path(workdir)))
        result['wall_s'] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    last = result['samples'][-1]
    say(f'wrote {args.out} ({result["wall_s"]} s); last hour: {json.dumps(last)}')
    if args.plot is not None:
        from bench.harness_env import REPO, ensure

        subprocess.run(
            [str(ensure()), '-m', 'bench.plot_retention', str(args.out), str(args.plot)], cwd=REPO, check=True
        )
        say(f'drew {args.plot}')


if __name__ == '__main__':
    main()
