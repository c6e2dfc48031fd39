"""`hand_batches`: one hand-over of the queue to the producer, a batch per partition where it pays.

A partition with nothing of this log's unacknowledged gets the hand-over's records as one
batch (`create_batch`/`send_batch`): one future per batch, not per record, whose
acknowledgement resolves each record's own (`_Batch.done`). So does a partition whose
last send was another run's: runs share it, so the log is busy, and a batch costs a
fraction of the producer's path per record. Such a batch waits for the producer's batch
ahead of it to leave (`send_batch` does), so these go last; durability points that arrive
meanwhile queue their records for the hand-over's next round, in fewer, larger batches.
A partition whose last send is this run's own (a record of the same step sent when its
linger ended) gets the records one by one (`Sender.hand`), joining the producer's batch still
waiting there: a batch would leave one round trip later, in a batch of its own (more
framing bytes for a lone run, decision 0034). A record of a run with kept records is
kept behind them. A batch the producer does not take in time (one deadline for the
hand-over's batches) is kept record by record, like a record the broker did not take,
and so is every batch after it. Cancelled (the waiting caller was) or failed before the
producer took them: the records not handed yet go back to the front of the queue, in
order.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from stepstream.errors import SchemaRegistryError, StepStreamError
from stepstream.kafka_client import AUTHORIZATION_ERRORS
from stepstream.producer._protocol import Ack
from stepstream.producer._sender import TOPIC_ATTRIBUTES, Outgoing, Sender, settle
from stepstream.telemetry import ack_latency, records_appended

if TYPE_CHECKING:
    from aiokafka.producer.message_accumulator import BatchBuilder

Entry = tuple[int, Outgoing, Ack]
"""A record of a hand-over: its place in the queue, the record, and its writer's acknowledgement."""


class _Batch:
    """Records of one hand-over for one partition, given to the producer as one batch.

    It reports to the `Sender` through its interface (`opened`, `track`, `untrack`, `closed`,
    `keep`, `refused`, `wrote`), and writes no state of the sender's or the log's.
    """

    __slots__ = ('builder', 'entries', 'partition', 'sender', 'sent_at', 'step_events', 'topic')

    def __init__(self, sender: Sender, topic: str, partition: int, builder: BatchBuilder) -> None:
        self.sender = sender
        self.topic = topic
        self.partition = partition
        self.builder = builder
        self.step_events = topic == sender.topics.step_events_topic
        self.entries: list[Entry] = []
        self.sent_at = 0.0

    def add(self, index: int, out: Outgoing, ack: Ack, key: bytes, value: bytes) -> bool:
        """Append a record; False when the batch is full (the record goes to a new one)."""
        if self.builder.append(timestamp=None, key=key, value=value, headers=out.headers) is None:
            return False
        self.entries.append((index, out, ack))
        return True

    def sent(self, future: asyncio.Future[RecordMetadata]) -> None:
        """The producer took the batch: its acknowledgement settles each record's."""
        self.sent_at = time.perf_counter()
        records_appended.add(len(self.entries), TOPIC_ATTRIBUTES[self.step_events])
        self.sender.track(future, [out for _index, out, _ack in self.entries])
        self.sender.opened((self.topic, self.partition), self.entries[-1][1].record.run_id)
        future.add_done_callback(self.done)

    def keep(self) -> None:
        """The producer did not take the batch in time: keep its records for a resend, in order."""
        for _index, out, ack in self.entries:
            self.sender.keep(out).add_done_callback(functools.partial(settle, ack))

    def done(self, future: asyncio.Future[RecordMetadata]) -> None:
        """Resolve each record's acknowledgement as the batch's resolved (offsets from its base)."""
        sender = self.sender
        sender.closed((self.topic, self.partition))
        sender.untrack(future)
        if future.cancelled():
            for _index, out, ack in self.entries:
                sender.keep(out)
                ack.cancel()
            return
        exc = future.exception()
        if exc is not None:
            denied = isinstance(exc, AUTHORIZATION_ERRORS)
            if denied:  # no ACL to write: sending again cannot help; every later wait raises this
                sender.refused(exc)
            for _index, out, ack in self.entries:
                if not denied:
                    sender.keep(out)
                ack.set_exception(copy.copy(exc))
                ack.exception()  # retrieved: nobody may wait for it, and its record is kept and resent
            return
        base = future.result()
        latency = time.perf_counter() - self.sent_at
        tp = base.topic_partition
        for offset, (_index, _out, ack) in enumerate(self.entries, base.offset):
            if not ack.done():
                ack.set_result(
                    RecordMetadata(
                        base.topic,
                        base.partition,
                        tp,
                        offset,
                        base.timestamp,
                        base.timestamp_type,
                        base.log_start_offset,
                    )
                )
            ack_latency.record(latency)
        sender.wrote(tp, base.offset + len(self.entries))


def _append_order(entry: Entry) -> int:
    return entry[0]


class _HandOver:
    """One hand-over's records: placed in batches or sent one by one, then given to the producer."""

    def __init__(self, sender: Sender) -> None:
        self.sender = sender
        self.batches: list[_Batch] = []
        self.behind: list[_Batch] = []  # for partitions with another run's send open
        self.open_batches: dict[tuple[str, int], _Batch | None] = {}
        self.singles: list[Entry] = []
        self.handed = 0  # of `singles`
        self.submitted = 0  # of `batches`

    def _new_batch(self, topic: str, partition: int) -> _Batch:
        assert self.sender.producer is not None
        return _Batch(self.sender, topic, partition, self.sender.producer.create_batch())

    def _batch_for(self, out: Outgoing) -> _Batch | None:
        """The partition's batch of this hand-over, None when its records go one by one."""
        tp = out.tp
        if tp not in self.open_batches:
            sender = self.sender
            if not sender.open_sends.get(tp):
                new = self.open_batches[tp] = self._new_batch(out.topic, out.partition)
                self.batches.append(new)
            elif sender.last_sender.get(tp) != out.record.run_id:
                new = self.open_batches[tp] = self._new_batch(out.topic, out.partition)
                self.behind.append(new)
            else:
                self.open_batches[tp] = None
        return self.open_batches[tp]

    async def place(self, queued: list[tuple[Outgoing, Ack]]) -> None:
        """Put each record in its partition's batch, with the singles, or behind its run's kept ones."""
        sender = self.sender
        framing = sender.framing
        for index, (out, ack) in enumerate(queued):
            record = out.record
            if sender.kept and record.run_id in sender.kept:  # behind its run's kept records
                sender.keep(out).add_done_callback(functools.partial(settle, ack))
                continue
            batch = self._batch_for(out)
            if batch is None:
                self.singles.append((index, out, ack))
                continue
            if framing.registry is None:
                value = out.value
            else:
                try:
                    value = await framing.confluent(record, out.value, out.topic)
                except SchemaRegistryError:
                    sender.keep(out).add_done_callback(functools.partial(settle, ack))
                    continue
            if not batch.add(index, out, ack, out.key, value):  # full: the rest goes in a new batch
                batch = self.open_batches[out.tp] = self._new_batch(out.topic, out.partition)
                (self.behind if sender.open_sends.get(out.tp) else self.batches).append(batch)
                if not batch.add(index, out, ack, out.key, value):  # never: an empty batch takes any record
                    raise StepStreamError(
                        f'the producer refused a {len(value)}-byte record in an empty batch'
                    )

    async def hand_singles(self) -> None:
        sender = self.sender
        try:
            # One deadline for the hand-over's records (asyncio.timeout: no task, one timer).
            async with asyncio.timeout(sender.kafka.ack_timeout_s):
                for _i, out, ack in self.singles:
                    await sender.hand(out, ack, deadline=False)
                    self.handed += 1
        except TimeoutError:
            # The record the producer did not take, and every one behind it: never ahead of it.
            for _i, out, ack in self.singles[self.handed :]:
                sender.keep(out).add_done_callback(functools.partial(settle, ack))
            self.handed = len(self.singles)

    async def submit_batches(self) -> None:
        # `behind` last: each waits for the producer's batch ahead of it on its partition to
        # leave. A batch whose records were all kept (no schema id yet) is not handed over.
        self.batches, self.behind = [batch for batch in (*self.batches, *self.behind) if batch.entries], []
        producer = self.sender.producer
        assert producer is not None
        try:
            # One deadline for the hand-over's batches (asyncio.timeout: no task, one timer).
            async with asyncio.timeout(self.sender.kafka.ack_timeout_s):
                for batch in self.batches:
                    future = await producer.send_batch(batch.builder, batch.topic, partition=batch.partition)
                    batch.sent(future)
                    self.submitted += 1
        except (KafkaError, TimeoutError):
            # The batch the producer did not take, and every one behind it: never ahead of it.
            for batch in self.batches[self.submitted :]:
                batch.keep()
            self.submitted = len(self.batches)

    def unsent(self) -> list[tuple[Outgoing, Ack]]:
        """The records placed and not given to the producer yet, in append order."""
        batches = [*self.batches[self.submitted :], *self.behind]
        entries = sorted(
            [*self.singles[self.handed :], *(e for b in batches for e in b.entries)], key=_append_order
        )
        return [(out, ack) for _i, out, ack in entries]


async def hand_batches(
    sender: Sender,
    queued: list[tuple[Outgoing, Ack]],
    requeue: Callable[[list[tuple[Outgoing, Ack]]], None],
) -> None:
    """Give queued records to the producer (see the module docstring); `requeue` takes back the unsent.

    On any failure or cancellation before the producer took them, the records not handed yet go
    to `requeue`, in order, and the error is raised again.
    """
    assert sender.producer is not None
    hand_over = _HandOver(sender)
    try:
        await hand_over.place(queued)
        await hand_over.hand_singles()
        await hand_over.submit_batches()
    except BaseException:
        requeue(hand_over.unsent())
        raise
