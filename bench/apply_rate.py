"""The projector's apply rate without Kafka, beside the decode ceiling measured in the same run.

    .venv/bin/python -m bench.apply_rate [RECORDS] [--rounds N] [--batch SIZE] [--baseline REV]

Feeds the synthetic 50-step runs of workload 3 (`bench.synthetic.many_runs`) to the apply rules
in batches of 5,000 into a fresh RocksDB, so the figure is the apply path alone: decode, rules,
state, one `WriteBatch` per batch.

The ceiling is fastavro decoding the same records and nothing else (each record's body read
with its writer schema, as `stepstream.schemas.decode` does before building the record types).
No apply path that decodes every record can go faster, and the machine's speed moves both
figures together, so the ratio is what to compare between runs. Each round measures the
ceiling, then the apply; the last line gives medians and ranges over the rounds.

`--baseline REV` also measures `projector/_apply.py` as it was at git revision REV (loaded from
`git show`, beside today's keys, state and store modules) in each round, right after today's,
so that before and after share a machine state and a ceiling.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from fastavro import schemaless_reader

from bench.synthetic import many_runs
from stepstream import Settings
from stepstream.projector._apply import EFFECTS, EVENTS, Applier, SourceRecord
from stepstream.projector._store import open_db
from stepstream.schemas import STEP_EVENT_SCHEMA, TOOL_EFFECT_SCHEMA
from stepstream.topics import murmur2_partition

PARTITIONS = 3
BATCH = 5000
HEADER = 10
"""The single-object header: the `C3 01` marker and the 8-byte schema fingerprint."""


def workload(total: int) -> tuple[Settings, list[SourceRecord]]:
    """About `total` records of 50-step runs, placed in partitions and offsets as Kafka would."""
    settings = Settings(topic_prefix='bench')
    topics = {settings.step_events_topic: EVENTS, settings.tool_effects_topic: EFFECTS}
    offsets: dict[tuple[int, int], int] = {}
    records = []
    for wire in many_runs(settings, 'apply', total, 50):
        topic, partition = topics[wire.topic], murmur2_partition(wire.key, PARTITIONS)
        offset = offsets.get((topic, partition), 0)
        offsets[(topic, partition)] = offset + 1
        records.append(SourceRecord(topic, partition, offset, wire.key, wire.value))
    return settings, records


def decode_ceiling(records: list[SourceRecord]) -> float:
    """Records/s for fastavro alone: each body read with its writer schema, nothing else."""
    writers = {schema.fingerprint: schema.parsed for schema in (STEP_EVENT_SCHEMA, TOOL_EFFECT_SCHEMA)}
    values = [r.value for r in records if r.value is not None]
    start = time.perf_counter()
    for value in values:
        schemaless_reader(io.BytesIO(value[HEADER:]), writers[value[2:HEADER]], None)
    return len(values) / (time.perf_counter() - start)


def baseline_module(rev: str, scratch: Path) -> ModuleType:
    """`stepstream.projector._apply` as it was at git revision `rev`, as a separate module."""
    repo = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ['git', 'show', f'{rev}:projector/_apply.py'], cwd=repo, check=True, capture_output=True
    ).stdout
    path = scratch / f'apply_{rev}.py'
    path.write_bytes(source)
    name = f'stepstream.projector._apply_{rev}'
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def apply_rate(settings: Settings, records: list[Any], batch: int, applier_type: Any = Applier) -> float:
    """Records/s staged and committed into a fresh RocksDB, `batch` records per transaction."""
    applier = applier_type((settings.step_events_topic, settings.tool_effects_topic), partitions=PARTITIONS)
    with tempfile.TemporaryDirectory() as path:
        db = open_db(path)
        try:
            start = time.perf_counter()
            for i in range(0, len(records), batch):
                txn, _ = applier.stage(db, records[i : i + batch])
                txn.commit()
            elapsed = time.perf_counter() - start
        finally:
            db.close()
    return len(records) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(prog='python -m bench.apply_rate', description=__doc__.split('\n')[0])
    parser.add_argument('records', type=int, nargs='?', default=200_000)
    parser.add_argument('--rounds', type=int, default=3, help='ceiling + apply pairs (default 3)')
    parser.add_argument('--batch', type=int, default=BATCH, help=f'records per batch (default {BATCH})')
    parser.add_argument('--baseline', metavar='REV', help='also measure the apply module at git revision REV')
    args = parser.parse_args()
    settings, records = workload(args.records)
    rounds, before = [], []
    with tempfile.TemporaryDirectory() as scratch:
        old = baseline_module(args.baseline, Path(scratch)) if args.baseline else None
    old_records = [old.SourceRecord(*vars_of(r)) for r in records] if old else []
    for n in range(1, args.rounds + 1):
        ceiling = decode_ceiling(records)
        rate = apply_rate(settings, records, args.batch)
        rounds.append((rate, ceiling))
        line = (
            f'round {n}: {len(records)} records applied at {rate:,.0f} records/s; '
            f'decode ceiling {ceiling:,.0f} records/s; apply/ceiling {rate / ceiling:.2f}'
        )
        if old is not None:
            before.append((apply_rate(settings, old_records, args.batch, old.Applier), ceiling))
            line += f'; at {args.baseline}: {before[-1][0]:,.0f} records/s ({before[-1][0] / ceiling:.2f})'
        print(line, flush=True)
    print(summary('apply', rounds))
    if before:
        print(summary(f'at {args.baseline}', before))


def vars_of(record: SourceRecord) -> tuple[int, int, int, bytes | None, bytes | None]:
    """A source record's fields, to build the baseline module's own `SourceRecord`."""
    return (record.topic, record.partition, record.offset, record.key, record.value)


def summary(what: str, rounds: list[tuple[float, float]]) -> str:
    """Medians and ranges over the rounds: the rate, the ceiling and their ratio."""
    rates, ceilings = [r for r, _ in rounds], [c for _, c in rounds]
    ratios = [r / c for r, c in rounds]
    return (
        f'{len(rounds)} rounds, {what}: {statistics.median(rates):,.0f} records/s median '
        f'({min(rates):,.0f}-{max(rates):,.0f}); decode ceiling {statistics.median(ceilings):,.0f} '
        f'({min(ceilings):,.0f}-{max(ceilings):,.0f}); apply/ceiling {statistics.median(ratios):.2f} '
        f'median ({min(ratios):.2f}-{max(ratios):.2f})'
    )


if __name__ == '__main__':
    main()
