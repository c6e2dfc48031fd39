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
`git show`, beside today's keys and state modules, and REV's own store module when it had one)
in each round, right after today's or (every other round) right before it, so that before and
after share a machine state and a ceiling, and neither always finds the caches both use warm.
Each rate is given in wall time and in CPU time (the process's, RocksDB's threads included): on
a machine other work shares, CPU time is the steadier figure. Since issue 34 split the rules out
of `_apply.py` (`_checks`, `_step_events`, `_tool_effects`, `_usage`), `--baseline` compares the
`Applier` class alone, over today's rules; to compare the whole apply path, run this module from
both checkouts laid out as installed (`bench.interleave.installed_layout`), in turns.
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
from stepstream.schemas import STEP_EVENT_SCHEMA, TOOL_EFFECT_SCHEMA
from stepstream.storage import Shard
from stepstream.topics import murmur2_partition

PARTITIONS = 3
BATCH = 5000
HEADER = 10
"""The single-object header: the `C3 01` marker and the 8-byte schema fingerprint."""


def workload(total: int, conversation_id: str | None = None) -> tuple[Settings, list[SourceRecord]]:
    """About `total` records of 50-step runs, placed in partitions and offsets as Kafka would."""
    settings = Settings(topic_prefix='bench')
    topics = {settings.topics.step_events_topic: EVENTS, settings.topics.tool_effects_topic: EFFECTS}
    offsets: dict[tuple[int, int], int] = {}
    records = []
    for wire in many_runs(settings, 'apply', total, 50, conversation_id=conversation_id):
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
    source = _git_show(repo, rev, 'projector/_apply.py')
    assert source is not None, f'no projector/_apply.py at {rev}'
    store = _git_show(repo, rev, 'projector/_store.py')  # before the Shard type (decision 0029)
    if store is not None and b'stepstream.projector._store' in source:
        _load(scratch, 'stepstream.projector._store', f'store_{rev}.py', store)
    return _load(scratch, f'stepstream.projector._apply_{rev}', f'apply_{rev}.py', source)


def _git_show(repo: Path, rev: str, path: str) -> bytes | None:
    shown = subprocess.run(['git', 'show', f'{rev}:{path}'], cwd=repo, capture_output=True)
    return shown.stdout if shown.returncode == 0 else None


def _load(scratch: Path, name: str, file: str, source: bytes) -> ModuleType:
    path = scratch / file
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def open_target(path: str, applier_type: Any) -> Any:
    """A fresh store for `applier_type`: a `Shard`, or a raw RocksDB for an applier from before it."""
    if applier_type is Applier or 'stepstream.projector._store' not in sys.modules:
        return Shard.open(path, create=True)
    return sys.modules['stepstream.projector._store'].open_db(path)


def apply_rate(
    settings: Settings, records: list[Any], batch: int, applier_type: Any = Applier
) -> tuple[float, float]:
    """Records/s staged and committed into a fresh RocksDB, `batch` records per transaction:
    per wall-clock second and per CPU second."""
    applier = applier_type(
        (settings.topics.step_events_topic, settings.topics.tool_effects_topic), partitions=PARTITIONS
    )
    with tempfile.TemporaryDirectory() as path:
        db = open_target(path, applier_type)
        try:
            start, cpu = time.perf_counter(), time.process_time()
            for i in range(0, len(records), batch):
                txn, _ = applier.stage(db, records[i : i + batch])
                txn.commit()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        finally:
            db.close()
    return len(records) / elapsed, len(records) / cpu


def main() -> None:
    parser = argparse.ArgumentParser(prog='python -m bench.apply_rate', description=__doc__.split('\n')[0])
    parser.add_argument('records', type=int, nargs='?', default=200_000)
    parser.add_argument('--rounds', type=int, default=3, help='ceiling + apply pairs (default 3)')
    parser.add_argument('--batch', type=int, default=BATCH, help=f'records per batch (default {BATCH})')
    parser.add_argument('--baseline', metavar='REV', help='also measure the apply module at git revision REV')
    parser.add_argument(
        '--conversation', metavar='ID', help='every run in this one conversation (its upkeep measured)'
    )
    args = parser.parse_args()
    settings, records = workload(args.records, args.conversation)
    rounds, before, cpu_now, cpu_before = [], [], [], []
    with tempfile.TemporaryDirectory() as scratch:
        old = baseline_module(args.baseline, Path(scratch)) if args.baseline else None
    old_records = [old.SourceRecord(*vars_of(r)) for r in records] if old else []
    for n in range(1, args.rounds + 1):
        ceiling = decode_ceiling(records)
        # Which goes first alternates: the first warms caches both share (`_keys.encode_text`).
        if old is not None and n % 2 == 0:
            old_rate, old_cpu = apply_rate(settings, old_records, args.batch, old.Applier)
        rate, cpu_rate = apply_rate(settings, records, args.batch)
        rounds.append((rate, ceiling))
        cpu_now.append(cpu_rate)
        line = (
            f'round {n}: {len(records)} records applied at {rate:,.0f} records/s '
            f'({cpu_rate:,.0f} per CPU second); '
            f'decode ceiling {ceiling:,.0f} records/s; apply/ceiling {rate / ceiling:.2f}'
        )
        if old is not None:
            if n % 2:
                old_rate, old_cpu = apply_rate(settings, old_records, args.batch, old.Applier)
            before.append((old_rate, ceiling))
            cpu_before.append(old_cpu)
            line += (
                f'; at {args.baseline}: {old_rate:,.0f} records/s ({old_rate / ceiling:.2f}, '
                f'{old_cpu:,.0f} per CPU second)'
            )
        print(line, flush=True)
    print(summary('apply', rounds) + f'; {statistics.median(cpu_now):,.0f} records per CPU second median')
    if before:
        print(
            summary(f'at {args.baseline}', before)
            + f'; {statistics.median(cpu_before):,.0f} records per CPU second median'
        )


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
