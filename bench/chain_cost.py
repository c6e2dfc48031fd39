"""What the hash chain costs a step, natively: time inside `chain_hash` over the capability's CPU.

```sh
.venv/bin/python -m bench.chain_cost            # N=200 steps of workload 1, 5 repeats
.venv/bin/python -m bench.chain_cost 200 9
```

`bench.instructions` counts under valgrind, whose CPU model hides the SHA extensions this VM's
CPU has, so OpenSSL hashes there with its generic code and the chain's share looks larger than it
is. Here the same workload runs natively: `none` (no persistence) and `memory` (`StepPersistence`
on `InMemoryLog`, as `bench.agent_cpu`), and in `memory` every `chain_hash` the writer calls is
timed. Printed: the capability's CPU per step (memory - none), the hashing per step, its share,
and the records and bytes hashed per step. Medians over interleaved repeats.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time

import stepstream.producer._run as writer_module
from bench.workload import timed_run
from stepstream.media import DiskMediaStore
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.schemas import chain_hash


class _Timed:
    """`chain_hash` with its calls, bytes and time counted."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.ns = 0

    def __call__(self, value: bytes) -> str:
        start = time.perf_counter_ns()
        digest = chain_hash(value)
        self.ns += time.perf_counter_ns() - start
        self.calls += 1
        self.bytes += len(value)
        return digest


async def measure(n: int, repeats: int) -> dict[str, float]:
    """Per step: the capability's CPU (ms), the time in `chain_hash` (ms), records and bytes hashed."""
    added, hashing, records, hashed = [], [], [], []
    await timed_run(5)  # imports and first-use paths, untimed
    with tempfile.TemporaryDirectory() as media:
        for _ in range(repeats):
            none = (await timed_run(n)).cpu_s
            timed = _Timed()
            writer_module.chain_hash = timed  # type: ignore[assignment]
            try:
                persisted = StepPersistence(
                    log=InMemoryLog(), agent_name='bench', media_store=DiskMediaStore(media)
                )
                memory = (await timed_run(n, [persisted])).cpu_s
            finally:
                writer_module.chain_hash = chain_hash
            added.append((memory - none) * 1000 / n)
            hashing.append(timed.ns / 1e6 / n)
            records.append(timed.calls / n)
            hashed.append(timed.bytes / n)
    capability, chain = statistics.median(added), statistics.median(hashing)
    return {
        'capability_ms_per_step': round(capability, 4),
        'chain_hash_ms_per_step': round(chain, 4),
        'share': round(chain / capability, 4),
        'records_per_step': round(statistics.median(records), 2),
        'bytes_hashed_per_step': round(statistics.median(hashed)),
    }


def main() -> None:
    """Print the figures as JSON."""
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    print(json.dumps(asyncio.run(measure(n, repeats)), indent=2))


if __name__ == '__main__':
    main()
