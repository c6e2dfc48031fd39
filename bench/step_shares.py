"""What two parts of the capability cost a step, natively: the hash chain and the request definitions.

```sh
.venv/bin/python -m bench.step_shares            # N=200 steps of workload 1, 5 repeats
.venv/bin/python -m bench.step_shares 200 9
```

`bench.instructions` counts under valgrind, whose CPU model hides the SHA extensions this VM's
CPU has, so OpenSSL hashes there with its generic code and the chain's share looks larger than it
is. Here the same workload runs natively: `none` (no persistence) and `memory` (`StepPersistence`
on `InMemoryLog`, as `bench.agent_cpu`), and in `memory` every `chain_hash` the writer calls is
timed, and so is every `definitions_of` (a model request's tools, output and settings as
canonical JSON, issue 38) with its fingerprint. Printed: the capability's CPU per step (memory -
none), each part's time per step and share, and the records and bytes hashed per step. Medians
over interleaved repeats, with the garbage collector off (a collection would be charged to
whichever call allocated when it ran).
"""

from __future__ import annotations

import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import stepstream.producer._capability as capability_module
import stepstream.producer._definitions as definitions_module
import stepstream.producer._run as writer_module
from bench.workload import timed_run
from stepstream.media import DiskMediaStore
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.schemas import chain_hash


class _Timed:
    """A function with its calls, bytes (of its first argument, when it has a length) and time counted."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls = 0
        self.bytes = 0
        self.ns = 0

    def __call__(self, value: Any) -> Any:
        start = time.perf_counter_ns()
        out = self.fn(value)
        self.ns += time.perf_counter_ns() - start
        self.calls += 1
        self.bytes += len(value) if isinstance(value, bytes) else 0
        return out


async def measure(n: int, repeats: int) -> dict[str, float]:
    """Per step: the capability's CPU (ms), the chain's and the definitions' time (ms), records hashed."""
    added: list[float] = []
    hashing: list[float] = []
    defining: list[float] = []
    records: list[float] = []
    hashed: list[float] = []
    await timed_run(5)  # imports and first-use paths, untimed
    gc.disable()  # a collection lands in whichever call allocates: it would be charged to a part
    with tempfile.TemporaryDirectory() as media:
        for _ in range(repeats):
            none = (await timed_run(n)).cpu_s
            chain = _Timed(chain_hash)
            definitions = _Timed(definitions_module.definitions_of)
            stamp = _Timed(definitions_module.fingerprint)
            writer_module.chain_hash = chain  # type: ignore[assignment]
            capability_module.definitions_of = definitions  # type: ignore[assignment]
            definitions_module.fingerprint = stamp  # type: ignore[assignment]
            try:
                persisted = StepPersistence(
                    log=InMemoryLog(), agent_name='bench', media_store=DiskMediaStore(media)
                )
                memory = (await timed_run(n, [persisted])).cpu_s
            finally:
                writer_module.chain_hash = chain_hash
                capability_module.definitions_of = definitions.fn
                definitions_module.fingerprint = stamp.fn
            added.append((memory - none) * 1000 / n)
            hashing.append(chain.ns / 1e6 / n)
            defining.append((definitions.ns + stamp.ns) / 1e6 / n)
            records.append(chain.calls / n)
            hashed.append(chain.bytes / n)
    gc.enable()
    capability = statistics.median(added)
    chained, defined = statistics.median(hashing), statistics.median(defining)
    return {
        'capability_ms_per_step': round(capability, 4),
        'chain_hash_ms_per_step': round(chained, 4),
        'chain_share': round(chained / capability, 4),
        'definitions_ms_per_step': round(defined, 4),
        'definitions_share': round(defined / capability, 4),
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
