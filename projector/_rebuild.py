"""Rebuilding a projection from offset zero into a fresh directory (`stepstream rebuild`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from stepstream.errors import UsageError
from stepstream.projector._projector import Projector
from stepstream.projector._store import check_directory, read_identity_file
from stepstream.settings import Settings
from stepstream.topics import Position

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
) -> Position:
    """Replay both topics from offset zero into `into`; returns the end reached.

    `into` must be new or empty, or an unfinished rebuild, which is resumed. Until the rebuild
    reaches the log's end (taken when it starts; records appended later are not waited for) the
    projection says it is `rebuilding`. `like` copies the options of an existing projection.
    """
    if like is not None:
        identity = await asyncio.to_thread(read_identity_file, check_directory(like, create=False))
        if identity is None:
            raise UsageError(f'{like} is not a stepstream projection, so there are no options to copy')
        if max_snapshots_per_run is not None and max_snapshots_per_run != identity.max_snapshots_per_run:
            raise UsageError(
                f'--like {like} has max_snapshots_per_run={identity.max_snapshots_per_run}, '
                f'but {max_snapshots_per_run} was given: give one or the other'
            )
        max_snapshots_per_run = identity.max_snapshots_per_run
    target = check_directory(into, create=True)
    if (target / 'CURRENT').exists():
        existing = await asyncio.to_thread(read_identity_file, target)
        if existing is None or existing.state != 'rebuilding':
            raise UsageError(f'{target} is not empty: rebuild into a new directory, then swap it in')
    async with Projector(
        settings,
        db_path=target,
        create_topics=False,
        commit_group_offsets=False,
        send_dead_letters=False,
        rebuilding=True,
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


def progress_bar(width: int = 40) -> Progress:
    """A `Progress` callback that draws a bar on stderr."""
    import sys

    def draw(done: int, total: int) -> None:
        share = done / total if total else 1.0
        filled = int(share * width)
        sys.stderr.write(f'\r[{"#" * filled}{"." * (width - filled)}] {done}/{total} records ({share:.0%})')
        if done >= total:
            sys.stderr.write('\n')
        sys.stderr.flush()

    return draw
