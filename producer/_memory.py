"""`InMemoryLog`: a `StepLog` in this process, for tests of the capability's rules without a broker.

It keeps the rules a Kafka log has and the capability relies on: records of a run keep their
order in one partition number of each topic; a record is refused before it is sent exactly as
`EventLog` refuses it; an acknowledgement resolves only after the record is stored, and not at
all while acknowledgements are held (`hold_acks`), so a durability point waits, and fails with
`StepStreamUnavailable` after `settings.kafka.ack_timeout_s`, as it does when a broker is away.

Like `EventLog`, it serves every thread and event loop at once (decision 0052): records are stored
in one order under a lock, each loop's records of one turn are acknowledged by that loop at the
turn's end (an acknowledgement is a future of the appending loop), and `flush`, `release_acks`,
`wait_for_record` and `close` work from any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

from aiokafka.structs import RecordMetadata, TopicPartition

from stepstream.kafka_client import unavailable
from stepstream.producer._liveness import CLOSED_WHILE_OPEN, Liveness
from stepstream.producer._protocol import (
    MAX_RECORD_BYTES,
    Ack,
    all_done,
    await_acks,
    encode_record,
    record_headers,
    topic_of,
    wake,
)
from stepstream.schemas import LogRecord
from stepstream.settings import Settings, check_count
from stepstream.topics import Position, murmur2_partition

if TYPE_CHECKING:
    from stepstream.producer._sealing import Sealer


class StoredRecord(NamedTuple):
    """One record as the in-memory log holds it (a tuple: made once per record, cheaply)."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    record: LogRecord


Stored = tuple[Ack, TopicPartition, int]
"""A stored record's acknowledgement, partition and offset."""


class InMemoryLog:
    """A `StepLog` that stores records in lists: the fast test tier for `StepPersistence`.

    ```python
    log = InMemoryLog()
    agent = Agent(model, capabilities=[StepPersistence(log=log, media_store=DiskMediaStore(tmp))])
    await agent.run('go')
    [r.record.kind for r in log.records]   # run_started, model_request_started, ...
    ```
    """

    def __init__(self, settings: Settings | None = None, *, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        """An empty log; `settings` gives topic names, the partition count and the ack timeout."""
        check_count(max_record_bytes, 'max_record_bytes')
        self.settings = settings or Settings()
        self.max_record_bytes = max_record_bytes
        self.records: list[StoredRecord] = []
        """Every stored record, in the order they were stored."""
        self._lock = threading.Lock()
        """Records are stored, and acknowledged, from any thread: one order, one position."""
        self._written: Position = {}
        self._next_offset: dict[TopicPartition, int] = {}
        self._routes: dict[tuple[type, str], tuple[str, TopicPartition, bytes]] = {}
        """Topic, partition and key of a run's records of one type: the same for every record of it."""
        self._turns: dict[asyncio.AbstractEventLoop, list[Stored]] = {}
        """Per loop, what it stored in its current turn, acknowledged at the turn's end (one callback)."""
        self._turn_waiters: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
        """Per loop, durability points and flushes (of any loop) waiting for its turn's end."""
        self._held: list[Stored] = []
        self._holding = False
        self._released: list[asyncio.Future[None]] = []
        """Flushes waiting for the held acknowledgements (`release_acks`)."""
        self._watchers: list[asyncio.Future[None]] = []
        """Resolved when the next record is stored (`wait_for_record`)."""
        self.liveness = Liveness(self, self.settings.liveness.heartbeat_interval_s, bind_on_first_open=True)
        """Heartbeats of the open runs, as `EventLog` sends them (`beat(now=...)` runs one pass)."""
        self.sealer: Sealer | None = None
        """Erasure's sealer when a test sets one (`EventLog` makes one when erasure is on)."""

    def encode(self, record: LogRecord) -> bytes:
        """The record's bytes, or the error that refuses it (the same rules as `EventLog.encode`)."""
        return encode_record(record, self.max_record_bytes)

    async def append(self, record: LogRecord) -> Ack:
        """Store one record; its acknowledgement (not awaited)."""
        return await self.send(record, self.encode(record))

    async def send(self, record: LogRecord, value: bytes) -> Ack:
        """Store a record encoded by `encode`; it is acknowledged on the next loop turn, or when released.

        The records a loop stores in one turn are acknowledged together, in order, by one callback.
        """
        route = self._routes.get((type(record), record.run_id))
        if route is None:
            topic, key = topic_of(record, self.settings.topics), record.run_id.encode()
            route = (
                topic,
                TopicPartition(topic, murmur2_partition(key, self.settings.topics.partitions)),
                key,
            )
            self._routes[type(record), record.run_id] = route
        topic, tp, key = route
        headers = record_headers(record)
        loop = asyncio.get_running_loop()
        ack: Ack = loop.create_future()
        lock = self._lock
        lock.acquire()  # not `with`: twice the cost, on every record (bench.instructions)
        try:
            offset = self._next_offset.get(tp, 0)
            self._next_offset[tp] = offset + 1
            self.records.append(StoredRecord(topic, tp.partition, offset, key, value, headers, record))
            if self._holding:
                self._held.append((ack, tp, offset))
            else:
                turn = self._turns.get(loop)
                if turn is None:
                    turn = self._turns[loop] = []
                    loop.call_soon(self._end_turn, loop)
                turn.append((ack, tp, offset))
            watchers = None
            if self._watchers:
                watchers, self._watchers = self._watchers, []
        finally:
            lock.release()
        if watchers is not None:
            for watcher in watchers:
                wake(watcher)
        return ack

    def _end_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop's turn is over: acknowledge what it stored in it, then wake who waits for that."""
        lock = self._lock
        lock.acquire()
        try:
            self._resolve(self._turns.pop(loop))
            waiters = self._turn_waiters.pop(loop, None)
        finally:
            lock.release()
        if waiters is not None:
            for waiter in waiters:
                if waiter.get_loop() is not loop:
                    wake(waiter)  # a flush on another loop
                elif not waiter.done():
                    waiter.set_result(None)

    def _resolve(self, stored: list[Stored]) -> None:
        """Acknowledge `stored` (on their loop, under the lock) and move the position."""
        written = self._written
        for ack, tp, offset in stored:
            if not ack.done():
                ack.set_result(RecordMetadata(tp.topic, tp.partition, tp, offset, -1, 0, -1))
            if offset + 1 > written.get(tp, 0):
                written[tp] = offset + 1

    def _taken(self, stored: list[Stored]) -> None:
        """Move the position past `stored` (under the lock); their loop acknowledges them later."""
        written = self._written
        for _ack, tp, offset in stored:
            if offset + 1 > written.get(tp, 0):
                written[tp] = offset + 1

    def _resolve_there(self, stored: list[Stored]) -> None:
        with self._lock:
            self._resolve(stored)

    def hold_acks(self) -> None:
        """Store records but acknowledge none until `release_acks` (a broker that does not answer)."""
        with self._lock:
            self._holding = True

    def release_acks(self) -> None:
        """Acknowledge every held record, in order, and acknowledge new ones again (from any thread).

        Each acknowledgement resolves on its own loop: at once for this loop's, at their loop's next
        turn for another's.
        """
        with self._lock:
            self._holding = False
            held, self._held = self._held, []
            released, self._released = self._released, []
            self._taken(held)  # the position moves now
            by_loop: dict[asyncio.AbstractEventLoop, list[Stored]] = {}
            for entry in held:
                by_loop.setdefault(entry[0].get_loop(), []).append(entry)
            here = asyncio._get_running_loop()
            if here in by_loop:
                self._resolve(by_loop.pop(here))
        for loop, entries in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for those
                loop.call_soon_threadsafe(self._resolve_there, entries)
        for waiter in released:
            wake(waiter)

    async def wait_for_record(self, predicate: Callable[[LogRecord], bool]) -> StoredRecord:
        """The first stored record `predicate(record)` holds for, waiting until one is stored."""
        seen = 0
        while True:
            for stored in self.records[seen:]:
                if predicate(stored.record):
                    return stored
            seen = len(self.records)
            stored_next = asyncio.get_running_loop().create_future()
            with self._lock:
                if len(self.records) > seen:
                    continue  # stored meanwhile, by another thread
                self._watchers.append(stored_next)
            await stored_next

    async def wait_acked(self, acks: Iterable[Ack], *, timeout: float | None = None) -> None:
        """Wait for the acknowledgements (of this loop's records); `StepStreamUnavailable` after the timeout.

        While no acknowledgement is held, every one still pending is of a record this loop stored
        in this turn, which the turn's one callback acknowledges: the wait is one future, not a
        callback and a timer per record as `await_acks` needs.
        """
        acks = acks if isinstance(acks, list) else list(acks)
        loop = asyncio.get_running_loop()
        if loop in self._turns and not self._held and not all(ack.done() for ack in acks):
            waiter: asyncio.Future[None] = loop.create_future()  # the turn is this loop's: it ends later
            self._turn_waiters.setdefault(loop, []).append(waiter)
            await waiter
        await await_acks(self.settings.kafka, acks, timeout)  # at once when all are done; the rules' checks

    async def flush(self, *, timeout: float | None = None) -> Position:
        """Wait until every record stored so far, by any loop, is acknowledged; the position written.

        Raises `StepStreamUnavailable` when records are still held (`hold_acks`) after the timeout.
        """
        here = asyncio.get_running_loop()
        waiters: list[asyncio.Future[None]] = []
        with self._lock:
            if self._held:
                waiters.append(here.create_future())
                self._released.append(waiters[-1])
            for loop, turn in list(self._turns.items()):
                if loop is here:
                    continue  # ends at this turn's end (below)
                if loop.is_running():
                    waiters.append(here.create_future())
                    self._turn_waiters.setdefault(loop, []).append(waiters[-1])
                else:  # its loop stopped: stored and taken, acknowledged to its writer when it runs again
                    self._taken(turn)
        if waiters:
            limit = self.settings.kafka.ack_timeout_s if timeout is None else timeout
            await all_done(waiters, limit)
            if not all(waiter.done() for waiter in waiters):
                others = sum(len(turn) for loop, turn in list(self._turns.items()) if loop is not here)
                raise unavailable(
                    self.settings.kafka, f'did not acknowledge {len(self._held) + others} record(s)'
                )
        await asyncio.sleep(0)  # acknowledgements scheduled for this loop turn
        with self._lock:
            return dict(self._written)

    async def close(self) -> None:
        """End the runs still open (`run_cancelled`), as `EventLog.close` does, and stop their heartbeats.

        From any loop: a run open on another thread's loop appends its end there.
        """
        await self.liveness.close_runs(CLOSED_WHILE_OPEN, timeout_s=self.settings.kafka.ack_timeout_s)
        await self.liveness.stop()
