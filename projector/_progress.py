"""`AppliedPosition`: how far a projector has applied each partition, and waiting for a position.

The projector advances it after each committed batch; `wait_for` (reading your writes, `catch_up`,
`rebuild`) waits on it. When the projector's loop stops on an error, `fail` wakes every waiter
with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiokafka.structs import TopicPartition

from stepstream.errors import StepStreamError
from stepstream.topics import Position


class AppliedPosition:
    """For each partition, the offset just past the last applied record; waiters wake on change.

    Each waiter is a future with the position it waits for; `advance` resolves those it
    reaches, so a waiter resumes in the loop's next turn (no lock to take back, no task per
    wait: reading your writes pays one wake-up; docs/benchmarks/history/issue-27.md, "Issue 27,
    third pass").
    """

    def __init__(self) -> None:
        """Nothing applied yet."""
        self._applied: Position = {}
        self._waiters: list[tuple[Position, asyncio.Future[None]]] = []
        self.failure: BaseException | None = None
        """Why the projector stopped, once it did on an error (raised to every waiter)."""

    @property
    def position(self) -> Position:
        """A copy of the applied position."""
        return dict(self._applied)

    def get(self, tp: TopicPartition) -> int | None:
        """The applied offset of one partition, None when nothing of it is known."""
        return self._applied.get(tp)

    def start_at(self, offsets: Position) -> None:
        """Where an opened shard's partitions stand (its stored offsets)."""
        self._applied.update(offsets)

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Partitions whose shard moved away."""
        for tp in tps:
            self._applied.pop(tp, None)

    async def advance(self, offsets: Position) -> None:
        """A batch is committed up to `offsets`: wake the waiters it brings to their position."""
        self._applied.update(offsets)
        if self._waiters:
            waiting = []
            for position, woken in self._waiters:
                if woken.done():
                    continue
                if self.reached(position):
                    _wake(woken)
                else:
                    waiting.append((position, woken))
            self._waiters = waiting

    async def fail(self, exc: BaseException) -> None:
        """The projector stopped on `exc`: every waiter raises it."""
        self.failure = exc
        waiters, self._waiters = self._waiters, []
        for _, woken in waiters:
            _wake(woken)

    def reached(self, position: Position) -> bool:
        """Whether every partition of `position` is applied up to its offset."""
        return all(self._applied.get(tp, 0) >= offset for tp, offset in position.items())

    async def wait_for(self, position: Position, timeout: float) -> None:
        """Return once every record up to `position` is applied; `TimeoutError` naming what lags."""
        if self.reached(position):
            return
        if self.failure is None:
            loop = asyncio.get_running_loop()
            woken: asyncio.Future[None] = loop.create_future()
            entry = (dict(position), woken)
            self._waiters.append(entry)
            timer = loop.call_later(timeout, _wake, woken)
            try:
                await woken
            finally:
                timer.cancel()
                if entry in self._waiters:
                    self._waiters.remove(entry)
            if self.reached(position):
                return
        if self.failure is not None:
            raise StepStreamError(f'the projector stopped on an error: {self.failure!r}')
        behind = {
            f'{tp.topic}[{tp.partition}]': (self._applied.get(tp, 0), off)
            for tp, off in position.items()
            if self._applied.get(tp, 0) < off
        }
        raise TimeoutError(
            f'projection did not reach the position within {timeout:g}s: (applied, wanted) {behind}'
        )


def _wake(woken: asyncio.Future[None]) -> None:
    """Resolve a waiter's future unless it is resolved (or cancelled) already."""
    if not woken.done():
        woken.set_result(None)
