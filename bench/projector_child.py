"""A projector in its own process, as deployed: started by the benchmarks, stopped through stdin.

Reads `STEPSTREAM_*` settings from the environment and the RocksDB path from argv. Prints
`ready` once it consumes; then reads one JSON line from stdin, the position to reach
(`[[topic, partition, offset], ...]`, from `EventLog.flush()`), waits until it is applied,
prints one JSON line with what it applied, and exits.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from aiokafka.structs import TopicPartition

from stepstream import Settings
from stepstream.projector import Projector


async def main(db_path: str) -> None:
    settings = Settings.from_env()
    async with Projector(settings, db_path=db_path) as projector:
        print('ready', flush=True)
        cpu0 = time.process_time()
        line = await asyncio.to_thread(sys.stdin.readline)
        position = {TopicPartition(t, p): offset for t, p, offset in json.loads(line)}
        t0 = time.perf_counter()
        await projector.wait_for(position, timeout=300)
        report = {
            'records_applied': projector.records_applied,
            'duplicates_ignored': projector.duplicates_ignored,
            'dead_lettered': projector.dead_lettered,
            'log_records': sum(position.values()),
            'catch_up_s': time.perf_counter() - t0,
            'cpu_s': time.process_time() - cpu0,
        }
    print(json.dumps(report), flush=True)


if __name__ == '__main__':
    asyncio.run(main(sys.argv[1]))
