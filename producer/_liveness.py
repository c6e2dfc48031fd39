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

Runs on other threads' loops are kept too (decision 0052): the keeper's timer runs on the log's
loop and sends their heartbeats there (a heartbeat takes no `seq`, so it needs no place among the
run's records), while a run's end is appended on the run's own loop, in order with its other
records; a run whose loop no longer runs has its end appended on the closing loop.
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

from stepstream.producer._engines import in_temporal_workflow
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
    `loop` is the loop the run appends from, where its end is appended.
    """

    __slots__ = ('end', 'heartbeat', 'last_append', 'loop', 'run_id')

    def __init__(
        self,
        run_id: str,
        heartbeat: Callable[[], StepEvent],
        end: Callable[[str], Awaitable[None]],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.run_id = run_id
        self.heartbeat = heartbeat
        self.end = end
        self.loop = loop
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

        The keeper times on the loop it is bound to (`bind`, which `EventLog.start` calls), for
        runs of every loop. `bind_on_first_open` is for a log with no loop of its own (no start):
        each run's own loop keeps time for the runs opened on it, from the first.
        """
        self._log = log
        self._own_loops = bind_on_first_open
        self.interval_s = interval_s
        self._runs: dict[OpenRun, None] = {}
        self._lock = threading.Lock()
        """Runs open and close on any thread: `_runs` and `_kept` change under it."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kept: dict[asyncio.AbstractEventLoop, int] = {}
        """Per keeping loop, the open runs it keeps time for: its timer ends with the last."""
        self._tickers: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}
        self.sent = 0
        """Heartbeats handed to the log so far (for tests and benchmarks)."""

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Keep time on `loop` only: the loop the log sends on (a Temporal workflow has its own)."""
        self._loop = loop
        self._own_loops = False

    @property
    def open_runs(self) -> int:
        """How many runs are open."""
        return len(self._runs)

    def open(
        self, run_id: str, *, heartbeat: Callable[[], StepEvent], end: Callable[[str], Awaitable[None]]
    ) -> OpenRun | None:
        """Register an open run; its handle, or None where no loop can keep time for it.

        A run on another thread's loop is kept by the log's loop, which must be running. A run
        hooked before the log started, or from a Temporal workflow's deterministic loop (whose
        writes its engine journals), gets no heartbeats.
        """
        loop = asyncio.get_running_loop()
        keeper = loop if self._own_loops else self._loop
        if keeper is not loop and (keeper is None or not keeper.is_running() or in_temporal_workflow()):
            return None
        run = OpenRun(run_id, heartbeat, end, loop)
        with self._lock:
            self._runs[run] = None
            self._kept[keeper] = self._kept.get(keeper, 0) + 1
        if self.interval_s > 0:
            if keeper is loop:
                self._start_ticker()
            else:
                with contextlib.suppress(RuntimeError):  # the keeper's loop closed just now
                    keeper.call_soon_threadsafe(self._start_ticker)
        return run

    def close(self, run: OpenRun | None) -> None:
        """The run's end is appended (or it will never write again): no more heartbeats for it.

        The timer of its keeping loop stops with the last run it keeps (a worker's loop, which
        `run_sync` stops once its run returns, must not keep one pending).
        """
        if run is None:
            return
        keeper = self._keeper_of(run)
        with self._lock:
            if self._runs.pop(run, self) is self or keeper is None:
                return  # ended by `close_runs` already
            left = self._kept.get(keeper, 1) - 1
            if left > 0:
                self._kept[keeper] = left
                return
            self._kept.pop(keeper, None)
        if keeper is asyncio._get_running_loop():
            self._stop_idle_ticker()
        else:
            with contextlib.suppress(RuntimeError):  # the keeper's loop is closed: so is its timer
                keeper.call_soon_threadsafe(self._stop_idle_ticker)

    def _keeper_of(self, run: OpenRun) -> asyncio.AbstractEventLoop | None:
        return run.loop if self._own_loops else self._loop

    def _start_ticker(self) -> None:
        """Start this loop's timer unless it runs (on the keeping loop, where runs start and stop it)."""
        loop = asyncio.get_running_loop()
        ticker = self._tickers.get(loop)
        if self._kept.get(loop) and (ticker is None or ticker.done()):
            self._tickers[loop] = loop.create_task(self._tick(loop), name='stepstream-heartbeats')

    def _stop_idle_ticker(self) -> None:
        """Cancel this loop's timer if it keeps no open run (on the keeping loop)."""
        loop = asyncio.get_running_loop()
        if not self._kept.get(loop):
            ticker = self._tickers.pop(loop, None)
            if ticker is not None:
                ticker.cancel()

    async def beat(self, now: float | None = None, *, only: asyncio.AbstractEventLoop | None = None) -> int:
        """Send a heartbeat for every open run that appended nothing for an interval; how many.

        `now` (`time.monotonic()` by default) lets a test judge quietness without waiting; `only`
        limits the pass to the runs one loop keeps. A heartbeat counts as the run's append: the
        next one is an interval later at the soonest. A run on another loop is read from here
        (its heartbeat names its next `seq`, which any record at about that time could take).
        """
        now = time.monotonic() if now is None else now
        due = [
            run
            for run in list(self._runs)
            if now - run.last_append >= self.interval_s and (only is None or self._keeper_of(run) is only)
        ]
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

    async def close_runs(self, reason: str, *, timeout_s: float = 10.0) -> int:
        """Append the end of every open run (`run_cancelled`, with `reason`); how many were open.

        The records are queued, not waited for: the caller flushes the log. Runs under a
        durable-execution engine write nothing here (their engine recovers them). A run on
        another loop appends its end there, so that it follows the run's other records; its
        loop gets `timeout_s` to do so (a loop busy in blocking code may not), and a run whose
        loop no longer runs appends it here.
        """
        with self._lock:
            runs, self._runs, self._kept = list(self._runs), {}, {}
        here = asyncio.get_running_loop()
        elsewhere: list[tuple[OpenRun, asyncio.AbstractEventLoop]] = []
        for run in runs:
            loop = run.loop
            if loop is not None and loop is not here and loop.is_running():
                elsewhere.append((run, loop))
                continue
            try:
                await run.end(reason)
            except Exception as exc:
                logger.warning('stepstream: could not record the end of run %r: %r', run.run_id, exc)
        await asyncio.gather(*(self._end_there(run, loop, reason, timeout_s) for run, loop in elsewhere))
        return len(runs)

    @staticmethod
    async def _end_there(
        run: OpenRun, loop: asyncio.AbstractEventLoop, reason: str, timeout_s: float
    ) -> None:
        """Append the run's end on its own loop (another thread's), after the records it appended."""
        try:
            ending = _as_coroutine(run.end(reason))
            try:
                future = asyncio.run_coroutine_threadsafe(ending, loop)
            except RuntimeError:  # its loop closed just now: nothing appends for it there any more
                await ending
                return
            await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except Exception as exc:
            logger.warning('stepstream: could not record the end of run %r: %r', run.run_id, exc)

    async def stop(self) -> None:
        """Stop the timers (the runs stay registered), from any loop."""
        here = asyncio.get_running_loop()
        tickers, self._tickers = self._tickers, {}
        for loop, ticker in tickers.items():
            if loop is here:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
            else:
                with contextlib.suppress(RuntimeError):  # its loop is closed: the timer is gone with it
                    loop.call_soon_threadsafe(ticker.cancel)

    async def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every half interval, a heartbeat for each run quiet for a whole one; ends with the last run."""
        while self._kept.get(loop):
            await asyncio.sleep(self.interval_s / 2)
            try:
                await self.beat(only=loop)
            except Exception as exc:  # never let the timer die: a later beat may succeed
                logger.warning('stepstream: sending heartbeats failed: %r', exc)


async def _as_coroutine(ending: Awaitable[None]) -> None:
    await ending


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
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set a handler; ours stays, and finds nothing to end
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
