"""The apply path's cost of a retention policy whose period is never reached (the hooks alone).

    .venv/bin/python -m bench.retention_cost [RECORDS] [--rounds N]

The synthetic 50-step runs of `bench.apply_rate` (no media references), applied in batches of
5,000 into a fresh RocksDB shard, without a policy and with one of 10,000 days (every hook runs:
the clock, the end index, the media check; nothing expires), alternating within each round so
both share the machine's state. Rates per CPU second, medians over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from bench.apply_rate import BATCH, PARTITIONS, workload
from stepstream.projector._apply import Applier
from stepstream.storage import Shard


def rate(settings_topics: tuple[str, str], records: list, retain_us: int | None) -> float:
    applier = Applier(settings_topics, partitions=PARTITIONS, retain_ended_us=retain_us)
    with tempfile.TemporaryDirectory() as path:
        db = Shard.open(path, create=True)
        try:
            cpu = time.process_time()
            for i in range(0, len(records), BATCH):
                txn, _ = applier.stage(db, records[i : i + BATCH])
                txn.commit()
            cpu = time.process_time() - cpu
        finally:
            db.close()
    return len(records) / cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        prog='python -m bench.retention_cost', description=__doc__.split('\n')[0]
    )
    parser.add_argument('records', type=int, nargs='?', default=200_000)
    parser.add_argument('--rounds', type=int, default=5)
    args = parser.parse_args()
    settings, records = workload(args.records)
    topics = (settings.topics.step_events_topic, settings.topics.tool_effects_topic)
    off, on = [], []
    for n in range(args.rounds):
        order = [(off, None), (on, 10_000 * 86_400_000_000)]
        for figures, retain in order if n % 2 == 0 else reversed(order):
            figures.append(rate(topics, records, retain))
        print(f'round {n + 1}: no policy {off[-1]:,.0f}/CPU s, policy {on[-1]:,.0f}/CPU s', flush=True)
    a, b = statistics.median(off), statistics.median(on)
    print(
        f'{len(records):,} records, {args.rounds} rounds: no policy {a:,.0f}, policy {b:,.0f} records/CPU s '
        f'({(b - a) / a:+.1%})'
    )


if __name__ == '__main__':
    main()
