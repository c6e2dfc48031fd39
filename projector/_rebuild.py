"""Rebuilding a projection from offset zero into a fresh directory (`stepstream rebuild`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from stepstream.errors import StepStreamError
from stepstream.projector._projector import Projector
from stepstream.settings import Settings
from stepstream.topics import Position

Progress = Callable[[int, int], None]
"""Called with (records consumed, records to consume) as the rebuild advances."""


async def rebuild(
    settings: Settings,
    into: str | Path,
    *,
    max_snapshots_per_run: int | None = None,
    on_progress: Progress | None = None,
    timeout: float = 3600.0,
) -> Position:
    """Replay both topics from offset zero into the empty directory `into`; returns the end reached.

    The log's end is taken when the rebuild starts; records appended later are not waited for.
    """
    target = Path(into)
    if await asyncio.to_thread(_has_files, target):
        raise StepStreamError(f'{target} is not empty: rebuild into a new directory, then swap it in')
    async with Projector(
        settings,
        db_path=target,
        create_topics=False,
        commit_group_offsets=False,
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
                return end
            if loop.time() > deadline:
                raise TimeoutError(f'rebuild reached {done} of {total} records within {timeout:g}s')
            try:
                await projector.wait_for(end, timeout=0.5)
            except TimeoutError:
                continue


def _has_files(path: Path) -> bool:
    return path.exists() and any(path.iterdir())


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
