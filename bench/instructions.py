"""The capability's cost per step in instructions: a figure this VM's CPU-time noise does not move.

```sh
.venv/bin/python -m bench.instructions                    # this tree
.venv/bin/python -m bench.instructions /tmp/before        # and a checkout of an earlier commit
.venv/bin/python -m bench.instructions --kafka            # also the Kafka path, gzip and plain
```

CPU time per step moves by 10-20 % from one process to the next on a shared VM, more than most
changes to the hot path (docs/benchmarks/history/issue-27.md). Valgrind counts the instructions a
process executes instead, and those barely vary. Each tree runs two processes under
`valgrind --tool=callgrind`, with the same imports and a warm-up run of 3 steps: `none` runs
workload 1 twice for 100 steps without persistence, `memory` runs it with `StepPersistence` on
an `InMemoryLog`. The difference between the two, divided by the 203 steps (the warm-up's
included), is what the capability adds to a step; import and compile costs are the same in
both and cancel. Instructions are a proxy for CPU time, not a measure of it: memory stalls and
cache misses are not counted. A tree's two processes run at once and take two to four minutes.

`--kafka` adds three processes that write to an embedded Tansu the parent starts: `eventlog`
(`EventLog` as configured by default, gzip), `eventlog-plain` (the same without compression) and
`raw-plain` (`RawLog`: aiokafka's `send` per record and nothing else, no compression). Every
process of that mode opens its log before its warm-up, used or not, so connecting and creating
topics cancel too. `eventlog - memory` is what the Kafka path (our `EventLog`, aiokafka, the
codec, the event loop's work for them) adds over the in-memory log; `eventlog - eventlog-plain`
is the codec's share; `eventlog-plain - raw-plain` is what `EventLog` costs over a log that is
only aiokafka. A count on a live broker varies more than one in memory: how records meet in
batches, and how often the loop wakes while a durability point waits, depend on timing, and the
same commit's `eventlog-plain` counted 11.27 G and 11.48 G (1 M a step) at two loads of the
machine. Before and after of one variant therefore run side by side, and a difference of a few
tenths of a million a step between two runs is noise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.interleave import HERE, installed_layout

WARM_UP, STEPS, RUNS = 3, 100, 2


KAFKA_VARIANTS = {'eventlog': 'gzip', 'eventlog-plain': None, 'raw-plain': None}
"""The `--kafka` processes and their codec (`raw-plain` is `RawLog`, the others `EventLog`)."""


class RawLog:
    """The thinnest `StepLog` on aiokafka: `send` per record, a wait on its futures, nothing else.

    For counting only: no linger, no batches, no resend, no heartbeats. What a log costs that
    is nothing but aiokafka's public per-record API, as `bench.send_path`'s `raw` variant is for
    the send path alone.
    """

    def __init__(self, settings: Any) -> None:
        """A log on `settings`' broker; `start()` connects."""
        from stepstream.producer._liveness import Liveness

        self.settings = settings
        self.liveness = Liveness(self, 0, bind_on_first_open=True)
        self.sealer = None
        self.producer: Any = None

    async def start(self) -> None:
        """Create the topics and connect a producer configured as `EventLog`'s (acks=all, no codec)."""
        from aiokafka import AIOKafkaProducer

        from stepstream.topics import ensure_topics

        await ensure_topics(self.settings)
        self.producer = AIOKafkaProducer(bootstrap_servers=self.settings.kafka.bootstrap_servers, acks='all')
        await self.producer.start()

    async def stop(self) -> None:
        """Flush and disconnect."""
        await self.producer.stop()

    def encode(self, record: Any) -> bytes:
        """The record's bytes, with the log's rules (`encode_record`)."""
        from stepstream.producer._protocol import MAX_RECORD_BYTES, encode_record

        return encode_record(record, MAX_RECORD_BYTES)

    async def send(self, record: Any, value: bytes) -> Any:
        """aiokafka's `send`: its future is the acknowledgement."""
        from stepstream.producer._protocol import record_headers, topic_of

        return await self.producer.send(
            topic_of(record, self.settings), value, key=record.run_id.encode(), headers=record_headers(record)
        )

    async def append(self, record: Any) -> Any:
        """`send(record, encode(record))`."""
        return await self.send(record, self.encode(record))

    async def wait_acked(self, acks: Any, *, timeout: float | None = None) -> None:
        """Wait for the futures (`await_acks`)."""
        from stepstream.producer._protocol import await_acks

        await await_acks(self.settings.kafka, acks, timeout)

    async def flush(self, *, timeout: float | None = None) -> Any:
        """aiokafka's flush."""
        await self.producer.flush()
        return {}


async def child(variant: str, kafka: bool) -> None:
    """One process's work: a warm-up run, then `RUNS` runs of `STEPS` steps."""
    from bench.common import fresh
    from bench.workload import timed_run
    from stepstream import Settings
    from stepstream.media import DiskMediaStore
    from stepstream.producer import EventLog, InMemoryLog, StepPersistence

    async with contextlib.AsyncExitStack() as stack:
        media = stack.enter_context(tempfile.TemporaryDirectory())
        log: Any = None
        if kafka:
            settings = fresh(Settings.from_env(), f'instr-{variant}')
            if variant == 'raw-plain':
                log = RawLog(settings)
                await log.start()
                stack.push_async_callback(log.stop)
            else:
                codec = KAFKA_VARIANTS.get(variant, 'gzip')
                log = await stack.enter_async_context(EventLog(settings, compression_type=codec))

        def capabilities() -> list[StepPersistence[None]]:
            if variant == 'none':
                return []
            if variant in KAFKA_VARIANTS:
                assert log is not None
                return [StepPersistence(log=log, agent_name='bench')]
            return [StepPersistence(log=InMemoryLog(), agent_name='bench', media_store=DiskMediaStore(media))]

        await timed_run(WARM_UP, capabilities())
        for _ in range(RUNS):
            await timed_run(STEPS, capabilities())


def instructions(pythonpath: str, bootstrap: str | None, variant: str) -> int:
    """Instructions executed by one `child` process under callgrind (on `bootstrap`'s broker if given)."""
    env = {**os.environ, 'PYTHONPATH': pythonpath, 'PYTHONHASHSEED': '0'}
    if bootstrap is not None:
        env['STEPSTREAM_BOOTSTRAP_SERVERS'] = bootstrap
    with tempfile.TemporaryDirectory() as empty:  # not a checkout: its folders would shadow the layout
        done = subprocess.run(
            [
                'valgrind',
                '--tool=callgrind',
                f'--callgrind-out-file={empty}/callgrind.out',
                sys.executable,
                '-m',
                'bench.instructions',
                '--child',
                variant,
                *(['--kafka'] if bootstrap is not None else []),
            ],
            cwd=empty,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
    found = re.search(r'Collected : (\d+)', done.stderr)
    if found is None:
        raise RuntimeError(f'callgrind printed no count:\n{done.stderr[-2000:]}')
    return int(found.group(1))


async def count(trees: dict[str, Path], kafka: bool) -> None:
    """Count every tree's processes, two at a time, and print what each layer adds per step.

    The trees' processes of one variant run side by side, so that before and after meet
    the same load on the machine, which moves a count on a live broker (see the docstring).
    """
    variants = ['none', 'memory', *(KAFKA_VARIANTS if kafka else ())]
    jobs = [(name, variant) for variant in variants for name in trees]
    steps = WARM_UP + STEPS * RUNS
    async with contextlib.AsyncExitStack() as stack:
        bootstrap = None
        if kafka:
            from stepstream.embedded import EmbeddedStack

            bootstrap = (await stack.enter_async_context(EmbeddedStack())).settings.kafka.bootstrap_servers
        paths = {name: f'{installed_layout(tree)}{os.pathsep}{HERE}' for name, tree in trees.items()}
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(2) as pool:  # two processes at once, one core each
            counted = await asyncio.gather(
                *(loop.run_in_executor(pool, instructions, paths[name], bootstrap, v) for name, v in jobs)
            )
    for name in trees:
        got = {v: n for (tree, v), n in zip(jobs, counted, strict=True) if tree == name}

        def added(variant: str, over: str, got: dict[str, int] = got) -> str:
            return f'{(got[variant] - got[over]) / steps / 1e6:.2f} M'

        print(
            f'{name}: ' + ', '.join(f'{v} {n:,}' for v, n in got.items()) + ' instructions; '
            f'the capability adds {added("memory", "none")} per step',
            flush=True,
        )
        if kafka:
            print(
                f'{name}: on Kafka, persistence adds {added("eventlog", "none")} per step; the Kafka '
                f'path adds {added("eventlog", "memory")} over the in-memory log, of which the codec '
                f'{added("eventlog", "eventlog-plain")}; without the codec, EventLog adds '
                f'{added("eventlog-plain", "raw-plain")} over a log that is only aiokafka (`RawLog`), '
                f'which adds {added("raw-plain", "memory")} over the in-memory log',
                flush=True,
            )


def main() -> None:
    """Print each tree's instructions per step added by the capability (and by Kafka: `--kafka`)."""
    args = sys.argv[1:]
    if args[:1] == ['--child']:
        asyncio.run(child(args[1], '--kafka' in args))
        return
    if shutil.which('valgrind') is None:
        raise SystemExit('bench.instructions needs valgrind (Debian: apt-get install valgrind)')
    kafka = '--kafka' in args
    args = [a for a in args if a != '--kafka']
    trees = {'this tree': HERE}
    if args:
        trees = {'before': Path(args[0]).resolve(), 'after': HERE}
    asyncio.run(count(trees, kafka))


if __name__ == '__main__':
    main()
