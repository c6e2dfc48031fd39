"""Waiting in tests: `until` a condition holds (async or sync), and `wait_applied` on a projection.

Every wait polls the state it waits for (or wakes on an event that says it changed) and fails
after a timeout naming what it waited for and the last reading; none sleeps a fixed time in
place of checking.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from stepstream.readmodel import ProjectionReader
from stepstream.topics import Position

T = TypeVar('T')


async def until(
    check: Callable[[], T | Awaitable[T]],
    what: str,
    timeout: float = 60.0,
    *,
    holds: Callable[[T], bool] = bool,
    every: float = 0.05,
    wake: asyncio.Event | None = None,
    describe: Callable[[], str] | None = None,
) -> T:
    """Call `check` (a function or a coroutine function) until `holds` its reading; return that.

    `holds` is truthiness unless given. Reads every `every` seconds, or, with `wake`, whenever that
    event is set (whoever changes the state sets it). After `timeout` seconds fails naming `what`
    ("waited 60s for `what`"), the last reading and what `describe` says of the state then.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if wake is not None:
            wake.clear()  # before the read: a change made after it sets the event again
        reading = check()
        last = await reading if inspect.isawaitable(reading) else reading
        if holds(last):
            return last
        if loop.time() > deadline:
            state = f'; {describe()}' if describe is not None else ''
            raise AssertionError(f'waited {timeout:g}s for {what}; last read {last!r}{state}')
        if wake is None:
            await asyncio.sleep(every)  # a poll of the state waited on, not a wait for an outcome
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), max(every, deadline - loop.time()))


def until_sync(check: Callable[[], T], what: str, timeout: float = 60.0, *, every: float = 0.2) -> T:
    """`until` for a test without an event loop: call `check` until it returns something truthy.

    For checks that run a process or make an HTTP call, hence the longer default interval.
    """
    deadline = time.monotonic() + timeout
    while not (last := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f'waited {timeout:g}s for {what}; last read {last!r}')
        time.sleep(every)  # a poll of the state waited on, not a wait for an outcome
    return last


async def wait_applied(db_path: Path, position: Position, timeout: float = 120.0) -> None:
    """Until the projection at `db_path` has applied every partition of `position` (a log's end).

    Reads the shards' stored offsets as any reader does, so it waits on a projector in another
    process too; fails naming both positions after `timeout` seconds.
    """
    reader = ProjectionReader.open(db_path)

    async def applied() -> dict[tuple[str, int], int]:
        return (await reader.status()).offsets

    def caught_up(offsets: dict[tuple[str, int], int]) -> bool:
        return all(offsets.get((tp.topic, tp.partition), 0) >= end for tp, end in position.items())

    try:
        await until(applied, f'the projector to apply {position}', timeout, holds=caught_up, every=0.1)
    finally:
        reader.close()
