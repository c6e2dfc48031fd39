"""What erasure (crypto-shredding, decision 0033) costs the capability per step: off versus on.

`python -m bench.erasure_cost [--steps 200] [--repeats 7] [--output-bytes 200]` runs the agent of
`bench.capability_cost` (a tool call per turn) under `StepPersistence` on an `InMemoryLog`, once as
it is (erasure off: the log has no sealer) and once with a `Sealer` on the log (erasure on: every
snapshot's tail and patch sealed with AES-256-GCM, the conversation's key made once; its key record
is acknowledged at once, no broker), alternating, and prints the median CPU time per step of each.
`--output-bytes` is the size of each tool return (what a snapshot's tail carries); payloads at or
above the media threshold would be sealed and uploaded too, which this leaves out.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from pydantic_ai import Agent
from pydantic_ai.usage import UsageLimits

from bench.capability_cost import _model
from stepstream.erasure import new_kek
from stepstream.media import DiskMediaStore
from stepstream.producer import StepPersistence
from stepstream.producer._memory import InMemoryLog
from stepstream.producer._sealing import Sealer


async def _acknowledged(key: bytes, value: bytes) -> None:
    return None


async def _cpu_per_step(steps: int, sealed: bool, output_bytes: int, media: Path) -> float:
    log = InMemoryLog()
    if sealed:
        log.sealer = Sealer(new_kek(), _acknowledged)  # type: ignore[attr-defined]
    persistence = StepPersistence(log=log, agent_name='bench', media_store=DiskMediaStore(media))
    agent = Agent(_model(steps), capabilities=[persistence])
    filler = 'x' * output_bytes

    @agent.tool_plain
    def step(n: int) -> str:
        return f'step {n} {filler}'

    started = time.process_time()
    await agent.run('go', usage_limits=UsageLimits(request_limit=None), conversation_id='bench')
    return (time.process_time() - started) / steps


async def main(steps: int, repeats: int, output_bytes: int) -> None:
    """Print the median CPU per step with erasure off and on, and the difference."""
    with tempfile.TemporaryDirectory() as tmp:
        await _cpu_per_step(20, False, output_bytes, Path(tmp))  # warm imports and caches
        await _cpu_per_step(20, True, output_bytes, Path(tmp))
        off, on = [], []
        for _ in range(repeats):
            off.append(await _cpu_per_step(steps, False, output_bytes, Path(tmp)))
            on.append(await _cpu_per_step(steps, True, output_bytes, Path(tmp)))
    a, b = statistics.median(off), statistics.median(on)
    print(
        f'steps={steps} repeats={repeats} output_bytes={output_bytes}: erasure off {a * 1e3:.3f} ms/step, '
        f'on {b * 1e3:.3f} ms/step, added {(b - a) * 1e3:.3f} ms/step CPU ({(b - a) / a:+.1%})'
    )


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--steps', type=int, default=200)
    parser.add_argument('--repeats', type=int, default=7)
    parser.add_argument('--output-bytes', type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.repeats, args.output_bytes))
