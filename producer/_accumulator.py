"""`Accumulator`: the log's own queue, where records linger until a hand-over gives them to the producer.

A record waits up to `linger_ms` here, so that the records of a step leave together; a durability
point has the queue handed over at the event loop's next turn (`hand_over_soon`), together with
the records of every other durability point reached in this one; `flush` and `close` hand it
over at once (`hand_over(settled=True)`). The hand-over itself (batches, the producer) is the
`hand` the accumulator is given.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from stepstream.producer._protocol import Ack
from stepstream.producer._sender import Outgoing

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
