"""`Accumulator`: the log's own queue, where records linger until a hand-over gives them to the producer.

And `Crossing`: how records appended on other threads' loops reach it (decision 0052).

A record waits up to `linger_ms` here, so that the records of a step leave together; a durability
point has the queue handed over at the event loop's next turn (`hand_over_soon`), together with
the records of every other durability point reached in this one; `flush` and `close` hand it
over at once (`hand_over(settled=True)`). The hand-over itself (batches, the producer) is the
`hand` the accumulator is given.

The accumulator lives on the log's loop. A record appended on another thread's loop crosses to it
through the log's inbox (`Crossing.append`), in the order each thread appended, so a run's records
keep their order, and joins the same queue; its acknowledgement crosses back through a mailbox of
the appending loop, which completes the caller's own future as the log's resolves.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable

from stepstream.errors import StepStreamError
from stepstream.producer._protocol import Ack, Mailbox, loop_gone
from stepstream.producer._sender import Outgoing, settle

Queued = list[tuple[Outgoing, Ack]]
"""Records appended and not handed over yet, each with the acknowledgement its writer waits on."""

logger = logging.getLogger('stepstream.producer')


class Accumulator:
    """Queues records for `linger_ms` and hands them over, in call order, one hand-over at a time."""

    def __init__(self, linger_ms: int, hand: Callable[[Queued], Awaitable[None]]) -> None:
        self.linger_ms = linger_ms
        self._hand = hand
        self.queued: Queued = []
        """Appended, not yet handed to the producer, in call order (see `EventLog`'s `linger_ms`)."""
        self._handing: asyncio.Future[None] | None = None
        """Set while a hand-over runs (see `hand_over`)."""
        self._linger_timer: asyncio.TimerHandle | None = None
        self._soon: asyncio.Handle | None = None
        """Set while a hand-over is due at the loop's next turn (`hand_over_soon`)."""
        self._linger_tasks: set[asyncio.Task[None]] = set()

    def append(self, out: Outgoing) -> Ack:
        """Queue a record; the acknowledgement the hand-over resolves."""
        ack: Ack = asyncio.get_running_loop().create_future()
        self.queued.append((out, ack))
        self._arm_linger()
        return ack

    def requeue(self, entries: Queued) -> None:
        """Put records a hand-over did not give the producer back at the front of the queue, in order."""
        self.queued[:0] = entries
        self._arm_linger()

    def stop(self) -> None:
        """Cancel the hand-overs due (the log is closing)."""
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None

    def hand_over_if_queued(self) -> None:
        """`hand_over_soon` if anything is queued (a request from another loop, which cannot look)."""
        if self.queued:
            self.hand_over_soon()

    def _arm_linger(self) -> None:
        if self._linger_timer is None:
            loop = asyncio.get_running_loop()
            self._linger_timer = loop.call_later(self.linger_ms / 1000, self._linger_over)

    def hand_over_soon(self) -> None:
        """Hand the queue over at the loop's next turn, for every durability point reached in this one.

        Runs woken together (by one acknowledgement) reach their durability points in the same
        turn of the event loop; one hand-over then gives the producer all their records, in one
        batch per partition, instead of one hand-over per run. The wait costs one loop turn.
        """
        if self._soon is None:
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
            self._soon = asyncio.get_running_loop().call_soon(self._linger_over)

    def _linger_over(self) -> None:
        self._linger_timer = None
        self._soon = None
        if self.queued:
            task = asyncio.create_task(self._hand_over_lingered(), name='stepstream-linger')
            self._linger_tasks.add(task)
            task.add_done_callback(self._linger_tasks.discard)

    async def _hand_over_lingered(self) -> None:
        try:
            await self.hand_over()
        except Exception as exc:  # the records stay queued for the next hand-over
            logger.warning('stepstream: handing queued records to the producer failed: %r', exc)

    async def hand_over(self, *, settled: bool = False) -> None:
        """Hand every queued record to the producer, in order, without waiting for the broker.

        One hand-over runs at a time and drains the queue, records queued while it runs
        included, so a caller that finds one running leaves the work to it: a durability point
        then waits for its acknowledgements only; `settled` (flush, close) also waits until
        every record queued is with the producer (or kept for a resend). No lock: 256 runs
        queueing on one would each wait a turn of the event loop.
        """
        while self._handing is not None:
            if not settled:
                return
            await asyncio.shield(self._handing)
        if not self.queued:
            return
        self._handing = asyncio.get_running_loop().create_future()
        try:
            while self.queued:
                queued, self.queued = self.queued, []
                if self._linger_timer is not None:
                    self._linger_timer.cancel()
                    self._linger_timer = None
                await self._hand(queued)
        finally:
            handing, self._handing = self._handing, None
            handing.set_result(None)


class Crossing:
    """Records from other threads' loops into the accumulator, and their acknowledgements back.

    Both ways, a crossing wakes the other loop only when someone waits there: each wake-up of a
    loop on another thread is a system call and a handover of the GIL, which busy threads hold
    for up to its switch interval. A record waits in the log's inbox until a durability point of
    its loop asks for a hand-over, or `linger_ms` has passed there (so a step's records and its
    durability point cross together); an acknowledgement waits in its loop's outbox until a
    durability point there waits for it, or `linger_ms` has passed on the log's loop (a caller
    may await an acknowledgement itself). A loop that stops sooner leaves its records to the next
    hand-over, `flush` or `close`; a run never does, since every run ends at a durability point.
    """

    def __init__(self, accumulator: Accumulator) -> None:
        self.accumulator = accumulator
        self.inbox: Mailbox | None = None
        """Records and hand-over requests from other loops, run on the log's loop (`bind`)."""
        self._callers = threading.local()
        """Per thread, `_Caller`: the loop it appends from (a thread runs one at a time)."""
        self._stopped = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cross to `loop` (the log's, from its start)."""
        self.inbox = Mailbox(loop)
        self._stopped = False

    def stop(self) -> None:
        """The log is closing: records that reach it from now on are refused."""
        self._stopped = True

    def append(self, out: Outgoing) -> Ack:
        """Queue a record from a loop other than the log's; its acknowledgement, of the caller's loop.

        The record is queued on the log's loop after every record this thread appended before
        it. Refused (`loop_gone`, saying what to do) when the log's loop no longer runs: nothing
        would ever send the record.
        """
        inbox = self._running_inbox()
        caller = self._caller()
        ack: Ack = caller.outbox.loop.create_future()
        linger_ms = self.accumulator.linger_ms
        if linger_ms <= 0:
            try:
                inbox.post(self._take, out, ack, caller)
            except RuntimeError:  # closed just now
                raise loop_gone(inbox.loop) from None
            return ack
        inbox.put(self._take, out, ack, caller)
        if caller.lingering is None:  # the first of a burst: it leaves after `linger_ms` at the latest
            caller.lingering = caller.outbox.loop.call_later(linger_ms / 1000, self._lingered, caller)
        return ack

    def wait_from_here(self, acks: list[Ack]) -> _Caller:
        """A durability point of this loop waits for `acks`: take those come so far, ask for a hand-over.

        Until the caller lowers `waiting` again, acknowledgements wake this loop as they come.
        Refused (`loop_gone`) when the log's loop no longer runs.
        """
        inbox = self._running_inbox()
        caller = self._caller()
        caller.waiting += 1
        if caller.lingering is not None:  # its records go with this hand-over: no timer wakes the loop
            caller.lingering.cancel()
            caller.lingering = None
        caller.outbox.run()  # those that came while nobody here waited
        if not all(ack.done() for ack in acks):
            with contextlib.suppress(RuntimeError):  # closed just now: the wait says so
                inbox.post(self.accumulator.hand_over_if_queued)
        return caller

    def take_posted(self) -> None:
        """Queue now what other loops posted and the log's loop has not run yet (flush, close)."""
        if self.inbox is not None:
            self.inbox.run()

    @property
    def untaken(self) -> int:
        """Records and requests other loops posted that the log's loop has not run yet."""
        return 0 if self.inbox is None else self.inbox.waiting

    def _running_inbox(self) -> Mailbox:
        inbox = self.inbox
        assert inbox is not None
        if not inbox.loop.is_running():
            raise loop_gone(inbox.loop)
        return inbox

    def _caller(self) -> _Caller:
        here = asyncio.get_running_loop()
        caller: _Caller | None = getattr(self._callers, 'caller', None)
        if caller is None or caller.outbox.loop is not here:
            caller = self._callers.caller = _Caller(here)
        return caller

    def _lingered(self, caller: _Caller) -> None:
        """On the caller's loop: its records waited `linger_ms`; hand them over unless they left."""
        caller.lingering = None
        if self.inbox is not None and self.inbox.waiting:
            with contextlib.suppress(RuntimeError):  # the log's loop closed: its waits say so
                self.inbox.post(self.accumulator.hand_over_if_queued)

    def _take(self, out: Outgoing, ack: Ack, caller: _Caller) -> None:
        """On the log's loop: queue a record from `caller`'s loop."""
        if self._stopped:  # the log closed while the record was on its way
            error = StepStreamError('the EventLog was closed before this record reached it')
            with contextlib.suppress(RuntimeError):
                caller.outbox.post(_fail, ack, error)
            return
        accumulator = self.accumulator
        accumulator.append(out).add_done_callback(functools.partial(self._acknowledged, caller, ack))
        if accumulator.linger_ms <= 0:
            accumulator.hand_over_soon()

    def _acknowledged(self, caller: _Caller, ack: Ack, resolved: Ack) -> None:
        """On the log's loop: a record from `caller`'s loop resolved; resolve its acknowledgement there."""
        outbox = caller.outbox
        outbox.put(settle, ack, resolved)
        try:
            if caller.waiting:
                outbox.wake()
            elif not caller.relaying:  # nobody waits there yet: within `linger_ms`, unless one does
                caller.relaying = True
                asyncio.get_running_loop().call_later(
                    self.accumulator.linger_ms / 1000, self._relay_lingered, caller
                )
        except RuntimeError:  # the caller's loop is closed: nobody waits
            pass

    @staticmethod
    def _relay_lingered(caller: _Caller) -> None:
        caller.relaying = False
        with contextlib.suppress(RuntimeError):
            caller.outbox.wake()


class _Caller:
    """A loop other than the log's that appends (one per thread at a time): its mailbox and timers."""

    __slots__ = ('lingering', 'outbox', 'relaying', 'waiting')

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.outbox = Mailbox(loop)
        """Acknowledgements of its records, resolved on it."""
        self.lingering: asyncio.TimerHandle | None = None
        """The timer of its loop that will hand its records over, while one will."""
        self.relaying = False
        """Set while a timer of the log's loop will wake it for acknowledgements nobody waited for."""
        self.waiting = 0
        """Its durability points waiting now: acknowledgements wake it at once."""


def _fail(ack: Ack, error: BaseException) -> None:
    if not ack.done():
        ack.set_exception(error)
        ack.exception()  # retrieved: a caller that does not wait for it is not told twice
