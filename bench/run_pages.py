"""How long a page of runs takes on a projection of many runs (issue 35), from a reader to a group.

```sh
.venv/bin/python -m bench.run_pages 100000            # build a projection of 100,000 runs, time pages
.venv/bin/python -m bench.run_pages 100000 --keep /tmp/pages-100k   # keep it, and reuse it next time
.venv/bin/python -m bench.run_pages 100000 --keep /tmp/pages-100k --json pages.json   # figures as JSON too
```

The projection is built through the projector's own `Applier`, not through Kafka: synthetic
one-tool-call runs (`bench.synthetic.many_runs`, about ten records each), placed in three
partitions as the producer's partitioner puts them and applied in batches of 5,000 into one
RocksDB shard per partition, as a projector writes them. Their run ids differ and their times
are the template's (one `started_at` for all: the index orders them by run id), which changes
no walk's length; every run has completed, under one agent name.

Four groups of figures over the same shards, each the median of 15 after one warm-up (of 5 for
a whole process):

- reader: `ProjectionReader.list_runs` in this process (what the API's `/api/runs` asks for).
- HTTP: the service (`serve.app_for`, uvicorn in this event loop) over a reader of the three
  shards, asked with an `httpx.AsyncClient`: the JSON API and the explorer's pages, end to end.
  Its broker is an address that refuses connections, so the status pages time a refused broker.
- CLI: `stepstream runs --json` (the newest page), its `main` called in this process with stdout
  to a buffer, then as a whole process (interpreter start-up included); and its output's size.
  It reads a copy of the shards (hard links) given the identity a projector writes: opening
  three RocksDB secondaries is most of it, and grows with the shards' files. Then the same
  command asked of the service (`STEPSTREAM_SERVE_URL`, a service in a thread), as it runs when a
  stack is up (decision 0042).
- two members: two services of one group in this loop, member A holding shards 0 and 1 and
  member B shard 2, each with a `Membership` filled by hand; member A is asked, and merges its
  page with B's. The merged first page is checked against the 50 newest runs, drawn from both.

Every HTTP request must be answered 200, or the run stops. The first line says which stepstream
it imported, so the same command on an older checkout (`PYTHONPATH=<checkout laid out as
installed>`) gives its figures on the same files. `--json PATH` writes every figure as one
object, `{"group: name": ms}` (the CLI's output size in bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import json
import logging
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx

import stepstream
from bench.synthetic import many_runs
from stepstream import Settings
from stepstream.cli import main as cli_main
from stepstream.projector import Membership
from stepstream.projector._apply import EFFECTS, EVENTS, Applier, SourceRecord
from stepstream.readmodel import ProjectionReader
from stepstream.serve import app_for, listen, running, url_of
from stepstream.storage import MEDIA_INDEX_VERSION, RUN_INDEX_VERSION, Identity, Shard, shard_path
from stepstream.topics import murmur2_partition

PARTITIONS = 3
ROUNDS = 15
"""Timings per figure: their median is steady to a few tenths of a millisecond on a shared VM."""
BATCH = 5000
RECORDS_PER_RUN = 10
"""About what a one-tool-call synthetic run writes (`bench.synthetic.plan_run(..., 1)`)."""
OUTPUT_BYTES = 'stepstream runs --json output size (bytes, not ms)'
"""The one figure that is no time."""


def build(root: Path, runs: int) -> None:
    """A projection of about `runs` runs under `root`, one shard per partition."""
    settings = Settings(topic_prefix='pages')
    apply_wires(root, settings, many_runs(settings, 'pages', runs * RECORDS_PER_RUN, 1))


def apply_wires(root: Path, settings: Settings, wires: Iterable[Any]) -> None:
    """Apply `wires` (records as sent: topic, key, value) into new shards under `root`, as a projector would.

    Each record goes to the partition the producer's partitioner gives its key, at the next offset
    there, and each partition's records are applied by the projector's `Applier` in batches of `BATCH`.
    """
    topics = {settings.topics.step_events_topic: EVENTS, settings.topics.tool_effects_topic: EFFECTS}
    applier = Applier(
        (settings.topics.step_events_topic, settings.topics.tool_effects_topic), partitions=PARTITIONS
    )
    shards = {p: Shard.open(root / str(p), create=True) for p in range(PARTITIONS)}
    pending: dict[int, list[SourceRecord]] = {p: [] for p in range(PARTITIONS)}
    offsets: dict[tuple[int, int], int] = {}

    def flush(partition: int) -> None:
        txn, _ = applier.stage(shards[partition], pending[partition])
        txn.commit()
        pending[partition].clear()

    try:
        for wire in wires:
            topic, partition = topics[wire.topic], murmur2_partition(wire.key, PARTITIONS)
            offset = offsets.get((topic, partition), 0)
            offsets[(topic, partition)] = offset + 1
            pending[partition].append(SourceRecord(topic, partition, offset, wire.key, wire.value))
            if len(pending[partition]) >= BATCH:
                flush(partition)
        for partition in pending:
            flush(partition)
    finally:
        for shard in shards.values():
            shard.close()


async def timed_ms(call: Callable[[], Awaitable[Any]], rounds: int = ROUNDS) -> float:
    """The median wall time of `call`, in milliseconds, after one warm-up, in the running loop."""
    await call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        await call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def median_ms(call: Callable[[], Awaitable[Any]], rounds: int = ROUNDS) -> float:
    """The median wall time of `call`, in milliseconds, after one warm-up (`timed_ms` in a new loop)."""
    return asyncio.run(timed_ms(call, rounds))


def sync_median_ms(call: Callable[[], object], rounds: int = ROUNDS) -> float:
    """`median_ms` for a blocking `call`."""
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(root: Path) -> dict[str, float]:
    """Each request's median over the projection at `root`."""
    shards = {p: Shard.open(root / str(p)) for p in range(PARTITIONS)}
    reader = ProjectionReader(shards, partitions=PARTITIONS)
    try:
        cursor = asyncio.run(reader.list_runs(newest_first=True, limit=1000))[-1].run_id  # the 1,000th
        agent = asyncio.run(reader.list_runs(limit=1))[0].agent_name
        requests: dict[str, Callable[[], Awaitable[Any]]] = {
            'first page, newest first (51 runs)': lambda: reader.list_runs(newest_first=True, limit=51),
            'first page, oldest first (51 runs)': lambda: reader.list_runs(limit=51),
            'the page after the 1,000th newest': lambda: reader.list_runs(
                newest_first=True, after=cursor, limit=51
            ),
            'conversation filter, none match': lambda: reader.list_runs(conversation_id='nope', limit=51),
            'status=failed, none match': lambda: reader.list_runs(
                status='failed', newest_first=True, limit=51
            ),
            'status=completed, first page (every run matches)': lambda: reader.list_runs(
                status='completed', newest_first=True, limit=51
            ),
            'status=stale, none (no run is running)': lambda: reader.list_runs(
                status='stale', newest_first=True, limit=51
            ),
            'agent_name=nope, none match': lambda: reader.list_runs(
                agent_name='nope', newest_first=True, limit=51
            ),
            'agent_name of every run, first page': lambda: reader.list_runs(
                agent_name=agent, newest_first=True, limit=51
            ),
            'agent_name of every run and status=failed, none match': lambda: reader.list_runs(
                agent_name=agent, status='failed', newest_first=True, limit=51
            ),
            'status=running, none (no run is live)': lambda: reader.list_runs(
                status='running', newest_first=True, limit=51
            ),
            'counts (runs per status and agent, calls in doubt)': reader.counts,
        }
        return {name: median_ms(call) for name, call in requests.items()}
    finally:
        for shard in shards.values():
            shard.close()


def open_shards(root: Path) -> dict[int, Shard]:
    """The projection's shards at `root`, opened as their projector opens them."""
    return {p: Shard.open(root / str(p)) for p in range(PARTITIONS)}


@contextlib.contextmanager
def refusing_address() -> Iterator[str]:
    """A loopback address whose connections are refused: the broker of a service that has none."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(('127.0.0.1', 0))  # bound and never listening: a connection is refused at once
    try:
        yield f'127.0.0.1:{sock.getsockname()[1]}'
    finally:
        sock.close()


async def http_figures(base: str, requests: dict[str, tuple[str, dict[str, str]]]) -> dict[str, float]:
    """Each `GET base+path?params` request's median, refusing to time one that is not answered 200."""
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:

        async def get(path: str, params: dict[str, str]) -> httpx.Response:
            response = await http.get(path, params=params)
            if response.status_code != 200:
                raise RuntimeError(
                    f'GET {path} {params} answered {response.status_code}: {response.text[:500]}'
                )
            return response

        return {name: await timed_ms(functools.partial(get, *request)) for name, request in requests.items()}


async def _serve(root: Path) -> dict[str, float]:
    shards = open_shards(root)
    reader = ProjectionReader(shards, partitions=PARTITIONS)
    try:
        cursor = (await reader.list_runs(newest_first=True, limit=1000))[-1].run_id
        requests = {
            'GET /api/runs (first page, newest first, 50 runs)': ('/api/runs', {}),
            "GET / (the explorer's runs page, HTML)": ('/', {}),
            'GET /api/runs?status=failed (none match)': ('/api/runs', {'status': 'failed'}),
            'GET /api/runs?agent_name=nope': ('/api/runs', {'agent_name': 'nope'}),
            'GET /api/runs?conversation_id=nope': ('/api/runs', {'conversation_id': 'nope'}),
            'GET /api/runs?parent_run_id=nope': ('/api/runs', {'parent_run_id': 'nope'}),
            'GET /api/runs?after= the 1,000th newest': ('/api/runs', {'after': cursor}),
            'GET /api/counts': ('/api/counts', {}),
            'GET /api/status (no broker: connection refused)': ('/api/status', {}),
            'GET /status (explorer; no broker: connection refused)': ('/status', {}),
        }
        with refusing_address() as broker:
            settings = Settings(topic_prefix='pages', bootstrap_servers=broker)
            async with running(app_for(settings, reader=reader), port=0) as served:
                return await http_figures(served.url, requests)
    finally:
        for shard in shards.values():
            shard.close()


def measure_http(root: Path) -> dict[str, float]:
    """Each request's median over HTTP, asked of the service (`app_for`) over the shards at `root`."""
    return asyncio.run(_serve(root))


@contextlib.contextmanager
def as_projection(root: Path) -> Iterator[Path]:
    """The shards at `root` as a directory the CLI opens, for as long as the block lasts.

    `build` writes bare shards (`root/0`, ...); `ProjectionReader.open` reads `shard-NNNN`
    directories that carry an identity. So each shard is copied (a RocksDB checkpoint: hard links)
    and the copy given the identity a projector writes into a shard it makes.
    """
    with tempfile.TemporaryDirectory(prefix='pages-cli-') as scratch:
        projection = Path(scratch)
        for partition, shard in open_shards(root).items():
            try:
                shard.checkpoint(shard_path(projection, partition))
            finally:
                shard.close()
            copy = Shard.open(shard_path(projection, partition), partition=partition)
            try:
                copy.write_identity(
                    Identity(
                        format=Identity.FORMAT,
                        topic_prefix='pages',
                        cluster='bench',
                        max_snapshots_per_run=None,
                        partitions=PARTITIONS,
                        partition=partition,
                        media_index=MEDIA_INDEX_VERSION,
                        run_index=RUN_INDEX_VERSION,
                    )
                )
            finally:
                copy.close()
        yield projection


def measure_cli(root: Path) -> dict[str, float]:
    """`stepstream runs --json` over the projection at `root`: in this process, and as a process.

    The figures are in milliseconds but for the output's size, in bytes.
    """
    os.environ.pop('STEPSTREAM_SERVE_URL', None)  # the CLI would ask that service instead
    with as_projection(root) as projection, tempfile.TemporaryDirectory() as no_stack:
        # An empty --stack-dir: no stack's service answers for the projection either.
        argv = ['runs', '--json', '--db-path', str(projection), '--stack-dir', no_stack]

        def in_process() -> str:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = cli_main(argv)
            if code != 0:
                raise RuntimeError(f'stepstream {" ".join(argv)} exited {code}')
            return out.getvalue()

        def as_process() -> None:
            subprocess.run([sys.executable, '-m', 'stepstream.cli', *argv], check=True, capture_output=True)

        text = in_process()
        shown = len(json.loads(text)) if text.lstrip().startswith('[') else None
        if shown is not None and shown != 50:
            raise RuntimeError(f'stepstream runs --json printed {shown} runs, not the first page of 50')
        figures = {
            'stepstream runs --json, in-process (stdout to a StringIO)': sync_median_ms(in_process),
            'stepstream runs --json, a whole process (interpreter start-up included)': sync_median_ms(
                as_process, rounds=5
            ),
            OUTPUT_BYTES: len(text.encode()),
        }
        with serving_in_thread(root) as url:  # as with a stack up: the CLI asks its service
            os.environ['STEPSTREAM_SERVE_URL'] = url
            try:
                if in_process() != text:
                    raise RuntimeError('the service answered stepstream runs --json with another page')
                figures['stepstream runs --json, in-process, asked of the service'] = sync_median_ms(
                    in_process
                )
                figures['stepstream runs --json, a whole process, asked of the service'] = sync_median_ms(
                    as_process, rounds=5
                )
            finally:
                os.environ.pop('STEPSTREAM_SERVE_URL', None)
        return figures


@contextlib.contextmanager
def serving_in_thread(root: Path) -> Iterator[str]:
    """The service over the shards at `root`, in a thread of its own, for as long as the block lasts."""
    ready: queue.Queue[tuple[str, asyncio.AbstractEventLoop, asyncio.Event]] = queue.Queue()

    async def serve() -> None:
        shards = open_shards(root)
        stop = asyncio.Event()
        try:
            with refusing_address() as broker:
                settings = Settings(topic_prefix='pages', bootstrap_servers=broker)
                reader = ProjectionReader(shards, partitions=PARTITIONS)
                async with running(app_for(settings, reader=reader), port=0) as served:
                    ready.put((served.url, asyncio.get_running_loop(), stop))
                    await stop.wait()
        finally:
            for shard in shards.values():
                shard.close()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    url, loop, stop = ready.get(timeout=60)
    try:
        yield url
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=60)


async def _members(root: Path) -> dict[str, float]:
    shards = open_shards(root)
    everything = ProjectionReader(shards, partitions=PARTITIONS)
    # As `stepstream serve --group` listens. Its sockets are made with protocol 0, so asyncio sets
    # no TCP_NODELAY on the connections they accept: each answer waits about 40 ms (Nagle's
    # algorithm against delayed ACKs), and a merged list pays that on both hops.
    sock_a, sock_b = listen('127.0.0.1', 0), listen('127.0.0.1', 0)
    url_a, url_b = url_of(sock_a), url_of(sock_b)
    routes: dict[int, str | None] = {0: url_a, 1: url_a, 2: url_b}
    a = Membership(endpoint=url_a, routes=routes, own=frozenset({0, 1}), partitions=PARTITIONS)
    b = Membership(endpoint=url_b, routes=routes, own=frozenset({2}), partitions=PARTITIONS)
    reader_a = ProjectionReader({0: shards[0], 1: shards[1]}, partitions=PARTITIONS, scope=lambda: a.own)
    reader_b = ProjectionReader({2: shards[2]}, partitions=PARTITIONS, scope=lambda: b.own)
    try:
        newest = [r.run_id for r in await everything.list_runs(newest_first=True, limit=1000)]
        with refusing_address() as broker:
            settings = Settings(topic_prefix='pages', bootstrap_servers=broker)
            async with (
                running(app_for(settings, reader=reader_a, membership=a), sock=sock_a),
                running(app_for(settings, reader=reader_b, membership=b), sock=sock_b),
                httpx.AsyncClient(timeout=60) as http,
            ):
                page = (await http.get(f'{url_a}/api/runs')).raise_for_status().json()['runs']
                merged = [r['run_id'] for r in page]
                held = {murmur2_partition(run_id.encode(), PARTITIONS) in a.own for run_id in merged}
                if merged != newest[:50] or held != {True, False}:
                    raise RuntimeError(
                        f'member A gave {len(merged)} runs, not the 50 newest drawn from both members'
                    )
                return await http_figures(
                    url_a,
                    {
                        'GET /api/runs of member A (first page, merged)': ('/api/runs', {}),
                        'GET /api/runs?status=failed of member A (none match)': (
                            '/api/runs',
                            {'status': 'failed'},
                        ),
                        "GET / of member A (the explorer's runs page)": ('/', {}),
                        'GET /api/runs?after= the 1,000th newest, of member A': (
                            '/api/runs',
                            {'after': newest[-1]},
                        ),
                    },
                )
    finally:
        for shard in shards.values():
            shard.close()


def measure_members(root: Path) -> dict[str, float]:
    """Requests asked of member A of a group of two: A serves shards 0 and 1, B serves shard 2.

    Each member's `Membership` is filled by hand (no broker, no consumer group), so member A
    merges its own page with the one it asks of B, as a group's member does.
    """
    return asyncio.run(_members(root))


def main() -> None:
    """Build (or reuse) a projection of the given size and print each request's median."""
    parser = argparse.ArgumentParser(prog='python -m bench.run_pages', description=__doc__.split('\n')[0])
    parser.add_argument('runs', type=int)
    parser.add_argument('--keep', type=Path, help='build the projection here, or reuse the one there')
    parser.add_argument('--json', type=Path, metavar='PATH', help='also write every figure here, {name: ms}')
    args = parser.parse_args()
    print(f'stepstream from {Path(stepstream.__file__).parent}')
    # The status pages ask a broker that refuses them: aiokafka logs each try, and asyncio each
    # consumer the service leaves unclosed when its start fails (serve/_broker.py `_read_dlq`).
    logging.getLogger('aiokafka').setLevel(logging.CRITICAL)
    logging.getLogger('asyncio').setLevel(logging.CRITICAL)
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        if not (root / '0').exists():
            start = time.perf_counter()
            build(root, args.runs)
            print(f'built {args.runs} runs in {time.perf_counter() - start:.0f} s')
        groups = {
            'reader': ('ProjectionReader.list_runs, in this process', measure),
            'HTTP': ('the service over the three shards, asked with httpx', measure_http),
            'CLI': ('stepstream runs --json, the newest page', measure_cli),
            'two members': ('member A (shards 0, 1) merging member B (shard 2)', measure_members),
        }
        for group, (what, measured) in groups.items():
            print(f'{group}: {what}')
            for name, value in measured(root).items():
                print(f'  {name}: {value:.0f}' if name == OUTPUT_BYTES else f'  {name}: {value:.1f} ms')
                figures[f'{group}: {name}'] = value
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + '\n')


if __name__ == '__main__':
    main()
