"""`InMemoryLog`: a `StepLog` in this process, for tests of the capability's rules without a broker.

It keeps the rules a Kafka log has and the capability relies on: records of a run keep their
order in one partition number of each topic; a record is refused before it is sent exactly as
`EventLog` refuses it; an acknowledgement resolves only after the record is stored, and not at
all while acknowledgements are held (`hold_acks`), so a durability point waits, and fails with
`StepStreamUnavailable` after `settings.ack_timeout_s`, as it does when a broker is away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

from aiokafka.structs import RecordMetadata, TopicPartition

from stepstream.producer._liveness import CLOSED_WHILE_OPEN, Liveness
from stepstream.producer._protocol import (
    MAX_RECORD_BYTES,
    Ack,
    await_acks,
    encode_record,
    record_headers,
    topic_of,
)
from stepstream.schemas import LogRecord
from stepstream.settings import Settings
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
        self.settings = settings or Settings()
        self.max_record_bytes = max_record_bytes
        self.records: list[StoredRecord] = []
        """Every stored record, in the order they were stored."""
        self._written: Position = {}
        self._next_offset: dict[TopicPartition, int] = {}
        self._routes: dict[tuple[type, str], tuple[str, TopicPartition, bytes]] = {}
        """Topic, partition and key of a run's records of one type: the same for every record of it."""
        self._unresolved: list[tuple[Ack, TopicPartition, int]] = []
        """Stored records whose acknowledgement this loop turn resolves (one callback for all)."""
        self._turn_waiters: list[asyncio.Future[None]] = []
        """Durability points waiting for this loop turn's acknowledgements (`wait_acked`)."""
        self._held: list[tuple[Ack, TopicPartition, int]] = []
        self._holding = False
        self._watchers: list[asyncio.Future[None]] = []
        """Resolved when the next record is stored (`wait_for_record`)."""
        self.liveness = Liveness(self, self.settings.heartbeat_interval_s, bind_on_first_open=True)
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

        The records stored in one loop turn are acknowledged together, in order, by one callback.
        """
        route = self._routes.get((type(record), record.run_id))
        if route is None:
            topic, key = topic_of(record, self.settings), record.run_id.encode()
            route = (topic, TopicPartition(topic, murmur2_partition(key, self.settings.partitions)), key)
            self._routes[type(record), record.run_id] = route
        topic, tp, key = route
        offset = self._next_offset.get(tp, 0)
        self._next_offset[tp] = offset + 1
        self.records.append(
            StoredRecord(topic, tp.partition, offset, key, value, record_headers(record), record)
        )
        loop = asyncio.get_running_loop()
        ack: Ack = loop.create_future()
        if self._holding:
            self._held.append((ack, tp, offset))
        else:
            if not self._unresolved:
                loop.call_soon(self._resolve_stored)
            self._unresolved.append((ack, tp, offset))
        if self._watchers:
            watchers, self._watchers = self._watchers, []
            for watcher in watchers:
                if not watcher.done():
                    watcher.set_result(None)
        return ack

    def _resolve_stored(self) -> None:
        unresolved, self._unresolved = self._unresolved, []
        self._resolve(unresolved)
        waiters, self._turn_waiters = self._turn_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _resolve(self, stored: list[tuple[Ack, TopicPartition, int]]) -> None:
        written = self._written
        for ack, tp, offset in stored:
            if not ack.done():
                ack.set_result(RecordMetadata(tp.topic, tp.partition, tp, offset, -1, 0, -1))
                if offset + 1 > written.get(tp, 0):
                    written[tp] = offset + 1

    def hold_acks(self) -> None:
        """Store records but acknowledge none until `release_acks` (a broker that does not answer)."""
        self._holding = True

    def release_acks(self) -> None:
        """Acknowledge every held record, in order, and acknowledge new ones again."""
        self._holding = False
        held, self._held = self._held, []
        self._resolve(held)

    async def wait_for_record(self, predicate: Callable[[LogRecord], bool]) -> StoredRecord:
        """The first stored record `predicate(record)` holds for, waiting until one is stored."""
        seen = 0
        while True:
            for stored in self.records[seen:]:
                if predicate(stored.record):
                    return stored
            seen = len(self.records)
            stored_next = asyncio.get_running_loop().create_future()
            self._watchers.append(stored_next)
            await stored_next

    async def wait_acked(self, acks: Iterable[Ack], *, timeout: float | None = None) -> None:
        """Wait for the acknowledgements; `StepStreamUnavailable` after the timeout.

        While no acknowledgement is held, every one still pending is of a record stored in this
        loop turn, which the turn's one callback acknowledges: the wait is one future, not a
        callback and a timer per record as `await_acks` needs.
        """
        acks = acks if isinstance(acks, list) else list(acks)
        if self._unresolved and not self._held and not all(ack.done() for ack in acks):
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._turn_waiters.append(waiter)
            await waiter
        await await_acks(self.settings, acks, timeout)  # at once when all are done; the rules' checks

    async def flush(self, *, timeout: float | None = None) -> Position:
        """Wait until every stored record is acknowledged; the position written."""
        await self.wait_acked([ack for ack, _tp, _offset in self._held], timeout=timeout)
        await asyncio.sleep(0)  # acknowledgements scheduled for this loop turn
        return dict(self._written)

    async def close(self) -> None:
        """End the runs still open (`run_cancelled`), as `EventLog.close` does, and stop their heartbeats."""
        await self.liveness.close_runs(CLOSED_WHILE_OPEN)
        await self.liveness.stop()
