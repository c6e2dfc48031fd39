"""Writer liveness: an open run's writer proves on the log that it is alive, and ends what it can.

A run whose process was SIGKILLed never writes its end, and from the log alone it looks like a
run that is merely quiet (a model thinking, a tool taking a minute). So while a run is open, its
writer keeps a record on the run's partition at least every `interval_s`: its ordinary records
when it is busy, and a small `run_heartbeat` event when it has been quiet. Readers call a
`running` run whose newest record is a few intervals old `stale`, and its unended tool calls
`unknown_after_crash` rather than `in_flight` (docs/decisions/0026-writer-liveness.md).

One `Liveness` per log serves every run of the process: one timer, one pass over the open runs
per half interval, and one heartbeat per quiet run, all handed to the log together (the log's
linger queue puts them in one produce request per partition). A heartbeat takes no `seq`, so a
run re-executed by a durable-execution engine can send its own without colliding with the
records its first attempt wrote.

A process that stops cleanly writes the ends it can: `close_runs` appends `run_cancelled` for
every open run (not for runs under a durable-execution engine, which owns their fate and
recovers them), and `EventLog` calls it on `close` and on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from stepstream.schemas import StepEvent

Ack = asyncio.Future[Any]
"""A queued record's acknowledgement (a `StepLog`'s `Ack`, whose result is the record's metadata)."""


class BeatingLog(Protocol):
    """What liveness needs of a log (every `StepLog` is one): queue a heartbeat, flush, its `liveness`."""

    liveness: Liveness

    def encode(self, record: StepEvent) -> bytes:
        """The record's bytes."""
        ...

    async def send(self, record: StepEvent, value: bytes) -> Ack:
        """Queue an encoded record; its acknowledgement, not awaited."""
        ...

    async def flush(self, *, timeout: float | None = None) -> object:
        """Wait until everything queued so far is acknowledged."""
        ...


logger = logging.getLogger('stepstream.producer')

CLOSED_WHILE_OPEN = 'the process closed its EventLog while the run was open'
"""The error of the `run_cancelled` a log writes, on close, for a run still open."""

TERMINATED_WHILE_OPEN = 'the process received SIGTERM while the run was open'
"""The error of the `run_cancelled` written for a run still open when its process is terminated."""

YIELD_EVERY = 256
"""Heartbeats sent between two yields to the event loop, so 10,000 quiet runs do not stall it."""


class OpenRun:
    """One open run as the liveness keeper sees it: when it last appended, and how to speak for it.

    `heartbeat()` makes the run's `run_heartbeat` record; `end(reason)` appends the run's
    `run_cancelled` for a process that stops while the run is open (a no-op under a
    durable-execution engine). The run sets `last_append` (`time.monotonic()`) whenever it appends.
    """

    __slots__ = ('end', 'heartbeat', 'last_append', 'run_id')

    def __init__(
        self,
        run_id: str,
        heartbeat: Callable[[], StepEvent],
        end: Callable[[str], Awaitable[None]],
    ) -> None:
        self.run_id = run_id
        self.heartbeat = heartbeat
        self.end = end
        self.last_append = time.monotonic()


class Liveness:
    """Keeps the open runs of one log alive on the log: a heartbeat for each run quiet for an interval.

    ```python
    handle = log.liveness.open('run-1', heartbeat=make_heartbeat, end=end_run)
    handle.last_append = time.monotonic()   # on every record the run appends
    log.liveness.close(handle)              # once the run's end is appended
    ```
    """

    def __init__(self, log: BeatingLog, interval_s: float, *, bind_on_first_open: bool = False) -> None:
        """`interval_s` 0 (or less) sends no heartbeats; runs are still ended by `close_runs`.

        The keeper times on the loop it is bound to (`bind`, which `EventLog.start` calls);
        `bind_on_first_open` binds it to the loop of the first run instead (a log with no start).
        """
        self._log = log
        self._bind_on_first_open = bind_on_first_open
        self.interval_s = interval_s
        self._runs: dict[OpenRun, None] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.sent = 0
        """Heartbeats handed to the log so far (for tests and benchmarks)."""

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Keep time on `loop` only: the loop the log sends on (a Temporal workflow has its own)."""
        self._loop = loop

    @property
    def open_runs(self) -> int:
        """How many runs are open."""
        return len(self._runs)

    def open(
        self, run_id: str, *, heartbeat: Callable[[], StepEvent], end: Callable[[str], Awaitable[None]]
    ) -> OpenRun | None:
        """Register an open run; its handle, or None where this loop cannot keep time for it.

        A run hooked from an event loop other than the log's (a durable-execution engine's
        deterministic workflow loop), or before the log started, gets no heartbeats: no timer may
        run in such a loop.
        """
        loop = asyncio.get_running_loop()
        if self._loop is None and self._bind_on_first_open:
            self._loop = loop
        if loop is not self._loop:
            return None
        run = OpenRun(run_id, heartbeat, end)
        self._runs[run] = None
        if self.interval_s > 0 and (self._ticker is None or self._ticker.done()):
            self._ticker = loop.create_task(self._tick(), name='stepstream-heartbeats')
        return run

    def close(self, run: OpenRun | None) -> None:
        """The run's end is appended (or it will never write again): no more heartbeats for it."""
        if run is not None:
            self._runs.pop(run, None)

    async def beat(self, now: float | None = None) -> int:
        """Send a heartbeat for every open run that appended nothing for an interval; how many.

        `now` (`time.monotonic()` by default) lets a test judge quietness without waiting.
        A heartbeat counts as the run's append: the next one is an interval later at the soonest.
        """
        now = time.monotonic() if now is None else now
        due = [run for run in self._runs if now - run.last_append >= self.interval_s]
        sent = 0
        for i, run in enumerate(due):
            if i and i % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            if run not in self._runs:
                continue  # it ended while we yielded
            record = run.heartbeat()
            try:
                ack = await self._log.send(record, self._log.encode(record))
            except Exception as exc:  # the log is closing, or refused: the next beat tries again
                logger.debug('stepstream: no heartbeat for run %r: %r', run.run_id, exc)
                continue
            ack.add_done_callback(_retrieved)
            run.last_append = now
            sent += 1
        self.sent += sent
        return sent

    async def close_runs(self, reason: str) -> int:
        """Append the end of every open run (`run_cancelled`, with `reason`); how many were open.

        The records are queued, not waited for: the caller flushes the log. Runs under a
        durable-execution engine write nothing here (their engine recovers them).
        """
        runs, self._runs = list(self._runs), {}
        for run in runs:
            try:
                await run.end(reason)
            except Exception as exc:
                logger.warning('stepstream: could not record the end of run %r: %r', run.run_id, exc)
        return len(runs)

    async def stop(self) -> None:
        """Stop the timer (the runs stay registered)."""
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker

    async def _tick(self) -> None:
        """Every half interval, a heartbeat for each run quiet for a whole one; ends with the last run."""
        while self._runs:
            await asyncio.sleep(self.interval_s / 2)
            try:
                await self.beat()
            except Exception as exc:  # never let the timer die: a later beat may succeed
                logger.warning('stepstream: sending heartbeats failed: %r', exc)


def _retrieved(ack: Ack) -> None:
    """Nobody waits for a heartbeat: mark its outcome seen (a lost one is replaced by the next)."""
    if not ack.cancelled():
        ack.exception()


_watched: dict[asyncio.AbstractEventLoop, set[BeatingLog]] = {}
"""The logs whose open runs SIGTERM ends, by the loop they run on."""
_terminating: set[asyncio.Task[None]] = set()


def watch_sigterm(log: BeatingLog) -> bool:
    """End `log`'s open runs when the process gets SIGTERM, then let SIGTERM end the process.

    Only where nobody else handles SIGTERM (its handler is the default) or where we already do,
    and from the main thread: a server framework with its own graceful shutdown closes the log
    itself. Returns whether the log is watched.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:
        if current is not signal.SIG_DFL:
            return False
        signal.signal(signal.SIGTERM, _on_sigterm)
    _watched.setdefault(asyncio.get_running_loop(), set()).add(log)
    return True


def unwatch_sigterm(log: BeatingLog) -> None:
    """Stop watching `log`; with no log left, SIGTERM gets its default action back (if still ours)."""
    for loop, logs in list(_watched.items()):
        logs.discard(log)
        if not logs or loop.is_closed():
            del _watched[loop]
    if not _watched and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _on_sigterm(signum: int, frame: object) -> None:
    """The signal handler: hand the work to each watched log's loop (a handler must not block)."""
    watched = [(loop, logs) for loop, logs in _watched.items() if loop.is_running()]
    _watched.clear()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    if not watched:
        os.kill(os.getpid(), signal.SIGTERM)
        return
    for loop, logs in watched:
        loop.call_soon_threadsafe(_start_terminating, loop, logs)


def _start_terminating(loop: asyncio.AbstractEventLoop, logs: set[BeatingLog]) -> None:
    task = loop.create_task(_terminate(logs), name='stepstream-sigterm')
    _terminating.add(task)
    task.add_done_callback(_terminating.discard)


async def _terminate(logs: set[BeatingLog]) -> None:
    """Write the ends of the open runs, wait (within each log's timeout) for them, then die of SIGTERM."""
    try:
        for log in logs:
            if await log.liveness.close_runs(TERMINATED_WHILE_OPEN):
                with contextlib.suppress(Exception):
                    await log.flush()
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
