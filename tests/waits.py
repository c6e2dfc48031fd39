"""Waiting on the projection: until a projector (in this process or another) has applied a position."""

from __future__ import annotations

import asyncio
from pathlib import Path

from stepstream.projector import ProjectionReader
from stepstream.topics import Position


async def wait_applied(db_path: Path, position: Position, timeout: float = 120.0) -> None:
    """Until the projection at `db_path` has applied every partition of `position` (a log's end).

    Reads the shards' stored offsets as any reader does, so it waits on a projector in another
    process too; fails naming both positions after `timeout` seconds.
    """
    reader = ProjectionReader.open(db_path)
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            applied = (await reader.status()).offsets
            if all(applied.get((tp.topic, tp.partition), 0) >= end for tp, end in position.items()):
                return
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f'the projector never caught up: {applied} vs {position}')
            await asyncio.sleep(0.1)  # a poll of stored offsets, not a wait for an outcome
    finally:
        reader.close()
