"""Rebuilding a projection from offset zero into a fresh directory (`stepstream rebuild`)."""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from aiokafka.structs import TopicPartition

from stepstream.errors import StepStreamError, UsageError
from stepstream.projector._options import Rebuilding
from stepstream.projector._projector import Projector
from stepstream.settings import Settings, check_count
from stepstream.storage import check_projection, read_projection_identity, shard_paths
from stepstream.topics import Position, ensure_topics

Progress = Callable[[int, int], None]
"""Called with (records consumed, records to consume) as the rebuild advances."""


async def rebuild(
    settings: Settings,
    into: str | Path,
    *,
    max_snapshots_per_run: int | None = None,
    like: str | Path | None = None,
    on_progress: Progress | None = None,
    timeout: float = 3600.0,
    jobs: int = 1,
    partitions: Collection[int] | None = None,
) -> Position:
    """Replay both topics from offset zero into `into`; returns the end reached.

    `into` must be new or empty, or an unfinished rebuild, which is resumed. Until the rebuild
    reaches the log's end (taken when it starts; records appended later are not waited for) the
    projection says it is `rebuilding`. `like` copies the options of an existing projection.
    `jobs` rebuilds the shards in that many processes (each takes every `jobs`-th partition);
    `partitions` rebuilds only those shards (what each job does).
    """
    try:
        check_count(jobs, '--jobs')
        check_count(max_snapshots_per_run, 'max_snapshots_per_run', optional=True)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if like is not None:
        identity = await asyncio.to_thread(read_projection_identity, check_projection(like, create=False))
        if identity is None:
            raise UsageError(f'{like} is not a stepstream projection, so there are no options to copy')
        if max_snapshots_per_run is not None and max_snapshots_per_run != identity.max_snapshots_per_run:
            raise UsageError(
                f'--like {like} has max_snapshots_per_run={identity.max_snapshots_per_run}, '
                f'but {max_snapshots_per_run} was given: give one or the other'
            )
        max_snapshots_per_run = identity.max_snapshots_per_run
        retain = identity.retain_ended_us
        if settings.projection.retain_ended_us is not None and settings.projection.retain_ended_us != retain:
            raise UsageError(
                f'--like {like} has the retention policy retain_ended_us={retain}, but '
                f'STEPSTREAM_RETAIN_ENDED_DAYS={settings.projection.retain_ended_days} was given: '
                'give one or the other'
            )
        settings = settings.replace(retain_ended_days=None if retain is None else retain / 86_400_000_000)
    target = check_projection(into, create=True)
    if partitions is None and shard_paths(target):
        existing = await asyncio.to_thread(read_projection_identity, target)
        if existing is None or existing.state != 'rebuilding':
            raise UsageError(f'{target} is not empty: rebuild into a new directory, then swap it in')
    if jobs > 1:
        return await _rebuild_in_processes(
            settings, target, jobs, max_snapshots_per_run, on_progress, timeout
        )
    async with Projector(
        settings,
        db_path=target,
        create_topics=False,
        rebuilding=Rebuilding(partitions=partitions),
        max_snapshots_per_run=max_snapshots_per_run,
    ) as projector:
        end = await projector.end_position()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            # The high watermark learnt from fetches can move the end on (see end_position).
            for tp, offset in (await projector.end_position()).items():
                end[tp] = max(end.get(tp, 0), offset)
            total = sum(end.values())
            applied = projector.applied
            done = sum(min(applied.get(tp, 0), offset) for tp, offset in end.items())
            if on_progress is not None:
                on_progress(done, total)
            if done >= total:
                projector.mark_rebuilt()
                return end
            if loop.time() > deadline:
                raise TimeoutError(f'rebuild reached {done} of {total} records within {timeout:g}s')
            try:
                await projector.wait_for(end, timeout=0.5)
            except TimeoutError:
                continue


async def _rebuild_in_processes(
    settings: Settings,
    target: Path,
    jobs: int,
    max_snapshots_per_run: int | None,
    on_progress: Progress | None,
    timeout: float,
) -> Position:
    """Run one rebuild per share of the partitions in its own process; one combined progress."""
    layout = await ensure_topics(settings, create=False)
    shares = [list(range(job, layout.partitions, jobs)) for job in range(min(jobs, layout.partitions))]
    context = multiprocessing.get_context('spawn')  # no forked event loop or RocksDB handles
    reports: Any = context.Queue()
    workers = [
        context.Process(
            target=_rebuild_worker,
            args=(job, settings, str(target), share, max_snapshots_per_run, timeout, reports),
            name=f'stepstream-rebuild-{job}',
        )
        for job, share in enumerate(shares)
    ]
    for worker in workers:
        worker.start()
    progress = {job: (0, 0) for job in range(len(workers))}
    ends: dict[int, list[tuple[str, int, int]]] = {}
    try:
        while len(ends) < len(workers):
            try:
                job, kind, payload = await asyncio.to_thread(reports.get, True, 0.5)
            except queue.Empty:
                dead = [w for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise StepStreamError(
                        f'rebuild job {dead[0].name} ended with exit code {dead[0].exitcode}; '
                        'run the rebuild again to resume it'
                    ) from None
                continue
            if kind == 'progress':
                progress[job] = payload
                if on_progress is not None:
                    on_progress(sum(d for d, _ in progress.values()), sum(t for _, t in progress.values()))
            elif kind == 'error':
                raise StepStreamError(f'rebuild job {job} failed: {payload}')
            else:
                ends[job] = payload
    finally:
        for worker in workers:
            if worker.is_alive() and len(ends) < len(workers):
                worker.terminate()
            await asyncio.to_thread(worker.join)
    return {TopicPartition(t, p): offset for end in ends.values() for t, p, offset in end}


def _rebuild_worker(
    job: int,
    settings: Settings,
    target: str,
    share: list[int],
    max_snapshots_per_run: int | None,
    timeout: float,
    reports: Any,
) -> None:
    """One process of a parallel rebuild: rebuild `share` and report progress and the end."""

    def progress(done: int, total: int) -> None:
        reports.put((job, 'progress', (done, total)))

    try:
        end = asyncio.run(
            rebuild(
                settings,
                target,
                partitions=share,
                max_snapshots_per_run=max_snapshots_per_run,
                on_progress=progress,
                timeout=timeout,
            )
        )
    except Exception as exc:
        reports.put((job, 'error', f'{type(exc).__name__}: {exc}'))
        sys.exit(1)
    reports.put((job, 'end', [(tp.topic, tp.partition, offset) for tp, offset in end.items()]))


def progress_bar(width: int = 40) -> Progress:
    """A `Progress` callback that draws a bar on stderr."""

    def draw(done: int, total: int) -> None:
        share = done / total if total else 1.0
        filled = int(share * width)
        sys.stderr.write(f'\r[{"#" * filled}{"." * (width - filled)}] {done}/{total} records ({share:.0%})')
        if done >= total:
            sys.stderr.write('\n')
        sys.stderr.flush()

    return draw
