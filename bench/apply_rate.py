"""The projector's apply rate without Kafka: records staged and committed per second.

    .venv/bin/python -m bench.apply_rate [RECORDS]

Feeds the synthetic 50-step runs of workload 3 (`bench.synthetic.many_runs`) to the apply rules
in batches of 5,000 into a fresh RocksDB, so the figure is the apply path alone: decode, rules,
state, one `WriteBatch` per batch.
"""

from __future__ import annotations

import sys
import tempfile
import time

from bench.synthetic import many_runs
from stepstream import Settings
from stepstream.projector._apply import EFFECTS, EVENTS, Applier, SourceRecord
from stepstream.projector._store import open_db
from stepstream.topics import murmur2_partition

PARTITIONS = 3
BATCH = 5000


def main(total: int) -> None:
    settings = Settings(topic_prefix='bench')
    topics = {settings.step_events_topic: EVENTS, settings.tool_effects_topic: EFFECTS}
    offsets: dict[tuple[int, int], int] = {}
    records = []
    for wire in many_runs(settings, 'apply', total, 50):
        topic, partition = topics[wire.topic], murmur2_partition(wire.key, PARTITIONS)
        offset = offsets.get((topic, partition), 0)
        offsets[(topic, partition)] = offset + 1
        records.append(SourceRecord(topic, partition, offset, wire.key, wire.value))
    applier = Applier((settings.step_events_topic, settings.tool_effects_topic), partitions=PARTITIONS)
    with tempfile.TemporaryDirectory() as path:
        db = open_db(path)
        start = time.perf_counter()
        for i in range(0, len(records), BATCH):
            txn, _ = applier.stage(db, records[i : i + BATCH])
            txn.commit()
        elapsed = time.perf_counter() - start
        db.close()
    print(f'{len(records)} records applied in {elapsed:.1f} s: {len(records) / elapsed:,.0f} records/s')


if __name__ == '__main__':
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000)
