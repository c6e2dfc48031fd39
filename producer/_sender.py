"""`Sender`: gives records to the producer, keeps the ones the broker did not take, and sends them again.

The sender owns what `EventLog` has handed to aiokafka: the sends not acknowledged yet, per
partition the sends open and the run that sent last (the hand-over's batching reads them), the
records kept for a resend, in each run's `seq` order, the position acknowledged, and the refusal
of a broker that denies the write. The hand-over (`_batches`) gives it batches through `opened`,
`track`, `untrack`, `closed`, `keep`, `refused` and `wrote`; nothing else writes its state.

`connect` makes and starts the producer a sender sends with; `send_key` sends a conversation key
(erasure on), and `untaken` says what a flush raises when the broker did not take its records.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import time
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata, TopicPartition

from stepstream.errors import SchemaRegistryError, StepStreamError
from stepstream.kafka_client import AUTHORIZATION_ERRORS, access_denied, client_options, connection_error
from stepstream.producer._framing import Framing
from stepstream.producer._protocol import Ack
from stepstream.schemas import UNCHAINED_KINDS, LogRecord, StepEvent
from stepstream.settings import KafkaSettings, Settings, TopicSettings
from stepstream.telemetry import ack_latency, failed, records_appended
from stepstream.topics import Position, unavailable

RESEND_BACKOFF_S = 0.5
"""How long the log waits before it tries again to send records the broker did not take."""

TOPIC_ATTRIBUTES = {True: {'stepstream.topic': 'step-events'}, False: {'stepstream.topic': 'tool-effects'}}
"""The telemetry attributes of a record, by whether it is a step event."""

logger = logging.getLogger('stepstream.producer')


class Outgoing:
    """A record on its way to the broker, with its bytes and headers.

    Made once, in the writer's context, when the record is appended: the `traceparent` header
    names the span active then, not the one of whichever task hands the record over or resends it.
    """

    __slots__ = ('headers', 'key', 'partition', 'record', 'topic', 'tp', 'value')

    def __init__(
        self,
        record: LogRecord,
        value: bytes,
        headers: list[tuple[str, bytes]],
        key: bytes,
        topic: str,
        partition: int,
    ) -> None:
        self.record = record
        self.value = value
        self.headers = headers
        self.key = key
        self.topic = topic
        self.partition = partition
        self.tp = (topic, partition)


class Kept:
    """A record the broker has not taken yet, and the acknowledgement its writer may wait on."""

    __slots__ = ('ack', 'out', 'resending')

    def __init__(self, out: Outgoing, ack: Ack) -> None:
        self.out = out
        self.ack = ack
        self.resending: Ack | None = None
        """The producer's future of the last resend while it is open: the record is not sent twice."""

    @property
    def record(self) -> LogRecord:
        return self.out.record

    def __lt__(self, other: Kept) -> bool:
        return self.record.seq < other.record.seq


class Sender:
    """Hands records to one producer, keeps and resends the ones the broker did not take."""

    def __init__(self, kafka: KafkaSettings, topics: TopicSettings, framing: Framing) -> None:
        self.kafka = kafka
        self.topics = topics
        self.framing = framing
        self.producer: AIOKafkaProducer | None = None
        """Set while the log is started: aiokafka binds a producer to the running loop."""
        self.written: Position = {}
        """The acknowledged position: per partition, the offset after the last record taken."""
        self.pending: dict[asyncio.Future[RecordMetadata], list[Outgoing]] = {}
        """Handed to the producer, not acknowledged yet: a record's or a batch's future, and its records."""
        self.kept: dict[str, list[Kept]] = {}
        """Per run, in `seq` order: records to send again (see the module docstring of `_log`)."""
        self._kept_changed = asyncio.Event()
        self.open_sends: dict[tuple[str, int], int] = {}
        """Per partition: sends (a record's or a batch's) not acknowledged yet (see `hand_batches`)."""
        self.last_sender: dict[tuple[str, int], str] = {}
        """Per partition: the run whose record was given to the producer last (see `hand_batches`)."""
        self.denied: StepStreamError | None = None
        """Set when the broker refused a write for lack of an ACL; raised by every later wait."""
        self._resender: asyncio.Task[None] | None = None

    def start(self, producer: AIOKafkaProducer) -> None:
        """Send through `producer` from now on, and resend kept records in the background."""
        self.producer = producer
        self._resender = asyncio.create_task(self._resend_kept(), name='stepstream-resend')

    async def stop_resending(self, timeout: float) -> None:
        """Give the kept records up to `timeout` to be taken, then stop the resender."""
        resender, self._resender = self._resender, None
        if resender is not None:
            if self.kept:
                self._kept_changed.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_kept_sent(), timeout)
            resender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await resender

    def detach(self) -> AIOKafkaProducer | None:
        """The producer, which the sender no longer sends through (the log stops it)."""
        producer, self.producer = self.producer, None
        return producer

    async def send_key(self, topic: str, key: bytes, value: bytes) -> None:
        """Send a conversation key record (erasure on) and wait for the broker, within the ack timeout."""
        producer = self.producer
        assert producer is not None
        try:
            async with asyncio.timeout(self.kafka.ack_timeout_s):
                await producer.send_and_wait(topic, value, key=key)
        except (KafkaError, TimeoutError) as exc:
            error = unavailable(self.kafka, 'did not acknowledge a conversation key', exc)
            failed(error)
            raise error from exc

    def untaken(self, timeout: float | None) -> StepStreamError:
        """What a flush raises when the records it waits for are not all taken in time.

        `timeout` is the one the caller gave (None: the ack timeout, not repeated in the message).
        Records waiting for a schema id the registry did not give say so.
        """
        if self.framing.failure is not None:
            return SchemaRegistryError(str(self.framing.failure))
        waited = '' if timeout is None else f' (waited {timeout:g}s)'
        return unavailable(self.kafka, f'did not take {self.waiting()} record(s){waited}')

    def unsent(self) -> list[LogRecord]:
        """Records handed over and not acknowledged, then records kept for a resend."""
        pending = [out.record for outs in self.pending.values() for out in outs]
        return [*pending, *(k.record for entries in self.kept.values() for k in entries)]

    def warn_lost(self, queued: list[LogRecord], why: str) -> None:
        """Log the records the broker never took (`queued`, then the sender's unsent), by run and seq."""
        # Records still kept for a resend, and (an idempotent producer retries on its own, so its
        # sends never fail) records whose sends were still open when the producer stopped.
        lost: dict[str, list[int]] = {}
        for record in [*queued, *self.unsent()]:
            if not (isinstance(record, StepEvent) and record.kind in UNCHAINED_KINDS):  # takes no seq
                lost.setdefault(record.run_id, []).append(record.seq)
        lost = {run_id: sorted(set(seqs)) for run_id, seqs in lost.items()}
        if lost:
            logger.warning(
                'stepstream: Kafka at %s did not take %d record(s) before the log closed%s (run_id: seqs) %s',
                self.kafka.bootstrap_servers,
                sum(len(seqs) for seqs in lost.values()),
                why,
                lost,
            )

    def waiting(self) -> int:
        """How many records the broker has not taken yet (handed over or kept)."""
        return sum(len(outs) for outs in self.pending.values()) + sum(
            len(kept) for kept in self.kept.values()
        )

    async def settled(self) -> None:
        """Wait until no record is handed over unacknowledged or kept."""
        while self.pending or self.kept:
            # A send that fails moves its record to the kept ones, so look again until none is left.
            await asyncio.wait([*self.pending, *(k.ack for kept in self.kept.values() for k in kept)])

    def opened(self, tp: tuple[str, int], run_id: str) -> None:
        """Count a send (a record's or a batch's) as open on `tp`; its done callback calls `closed`."""
        self.open_sends[tp] = self.open_sends.get(tp, 0) + 1
        self.last_sender[tp] = run_id

    def closed(self, tp: tuple[str, int]) -> None:
        left = self.open_sends[tp] - 1
        if left:
            self.open_sends[tp] = left
        else:
            del self.open_sends[tp]

    def track(self, future: asyncio.Future[RecordMetadata], outs: list[Outgoing]) -> None:
        """The producer took `outs` as one send: pending until `future` is done (then `untrack`)."""
        self.pending[future] = outs

    def untrack(self, future: asyncio.Future[RecordMetadata]) -> None:
        del self.pending[future]

    def refused(self, exc: BaseException | None) -> None:
        """No ACL to write: sending again cannot help; every later wait raises this."""
        self.denied = self.denied or self.no_write(exc)

    def wrote(self, tp: TopicPartition, end: int) -> None:
        """The broker took records up to `end` (the offset after the last) on `tp`."""
        if end > self.written.get(tp, 0):
            self.written[tp] = end

    def no_write(self, exc: BaseException | None) -> StepStreamError:
        assert exc is not None
        topics = f'{self.topics.step_events_topic} and {self.topics.tool_effects_topic}'
        return access_denied(
            self.kafka,
            f'write to {topics}',
            exc,
            fix=f'grant it WRITE on {topics} (the producer ACL), or use the producer principal',
        )

    async def hand(self, out: Outgoing, ack: Ack | None = None, *, deadline: bool = True) -> Ack:
        """Give one record to the producer (or keep it for a resend); the producer's future.

        `ack`, when given, is the record's own acknowledgement, resolved as that one resolves.
        `deadline=False` for a caller that holds a deadline of its own over several records.
        """
        if self.kept and out.record.run_id in self.kept:
            kept = self.keep(out)  # behind the run's earlier records, never ahead of them
        else:
            try:
                if deadline:
                    # asyncio.timeout, not wait_for: no extra task per record on the hot path.
                    async with asyncio.timeout(self.kafka.ack_timeout_s):
                        sent = await self.send(out, functools.partial(self._handed, out, ack))
                else:
                    sent = await self.send(out, functools.partial(self._handed, out, ack))
            except (KafkaError, TimeoutError, SchemaRegistryError):
                kept = self.keep(out)
            else:
                self.pending[sent] = [out]
                return sent
        if ack is not None:
            kept.add_done_callback(functools.partial(settle, ack))
        return kept

    def _handed(self, out: Outgoing, ack: Ack | None, sent: Ack) -> None:
        """A record `hand` gave the producer was acknowledged, failed or cancelled."""
        del self.pending[sent]
        if not sent.cancelled() and isinstance(sent.exception(), AUTHORIZATION_ERRORS):
            # No ACL to write: sending again cannot help. Every later wait raises this.
            self.denied = self.denied or self.no_write(sent.exception())
        elif sent.cancelled() or sent.exception() is not None:
            self.keep(out)  # sent again; the waiter learns of the failure now (`settle`)
        else:
            self._record_position(sent.result())
        if ack is not None:
            settle(ack, sent)

    async def send(self, out: Outgoing, then: Callable[[Ack], None]) -> Ack:
        """Give a record to the producer; `then(future)` runs once the producer's future is done.

        One callback per record: it closes the record's open send on its partition, records the
        acknowledgement's latency and calls `then`.
        """
        assert self.producer is not None
        topic, tp = out.topic, out.tp
        framing = self.framing
        value = (
            out.value if framing.registry is None else await framing.confluent(out.record, out.value, topic)
        )
        sent_at = time.perf_counter()
        sent: Ack = await self.producer.send(
            topic, value, key=out.key, headers=out.headers, partition=out.partition
        )
        self.opened(tp, out.record.run_id)
        records_appended.add(1, TOPIC_ATTRIBUTES[isinstance(out.record, StepEvent)])
        sent.add_done_callback(functools.partial(self._sent, tp, sent_at, then))
        return sent

    def _sent(self, tp: tuple[str, int], sent_at: float, then: Callable[[Ack], None], sent: Ack) -> None:
        self.closed(tp)
        if not sent.cancelled() and sent.exception() is None:
            ack_latency.record(time.perf_counter() - sent_at)
        then(sent)

    def keep(self, out: Outgoing) -> Ack:
        """Keep a record the broker did not take, in its run's `seq` order, and wake the resender.

        Only the same record is kept once: records may share a `seq` (an operator's resolution
        names the seq of the transition it answers), and each must reach the log.
        """
        kept = self.kept.setdefault(out.record.run_id, [])
        for other in kept:
            if other.record == out.record:
                return other.ack
        entry = Kept(out, asyncio.get_running_loop().create_future())
        bisect.insort(kept, entry)
        self._kept_changed.set()
        return entry.ack

    async def _resend_kept(self) -> None:
        """Send kept records again, run by run in `seq` order, until the broker takes them."""
        while True:
            await self._kept_changed.wait()
            self._kept_changed.clear()
            while self.kept:
                if not await self._resend_once():
                    await asyncio.sleep(RESEND_BACKOFF_S)

    async def _resend_once(self) -> bool:
        """One pass over the kept records, all runs at once; True when the broker took all of them."""
        await asyncio.gather(*(self._resend_run(run_id) for run_id in list(self.kept)))
        return not self.kept

    async def _resend_run(self, run_id: str) -> None:
        sent: list[Ack] = []
        try:
            async with asyncio.timeout(self.kafka.ack_timeout_s):
                for entry in list(self.kept.get(run_id, ())):
                    if entry.resending is not None and not entry.resending.done():
                        sent.append(entry.resending)  # still on its way from an earlier pass
                        continue
                    ack = entry.resending = await self.send(
                        entry.out, functools.partial(self._on_resent, entry)
                    )
                    sent.append(ack)
                if sent:
                    await asyncio.wait(sent)
        except (KafkaError, TimeoutError, OSError, SchemaRegistryError) as exc:
            logger.debug('stepstream: resending records of run %r failed (%r); retrying', run_id, exc)

    def _on_resent(self, entry: Kept, ack: Ack) -> None:
        if ack.cancelled() or ack.exception() is not None:
            return  # still kept: the next pass sends it again
        self._record_position(ack.result())
        kept = self.kept.get(entry.record.run_id)
        if kept is not None and entry in kept:
            kept.remove(entry)
            if not kept:
                del self.kept[entry.record.run_id]
        if not entry.ack.done():
            entry.ack.set_result(ack.result())

    async def _all_kept_sent(self) -> None:
        while self.kept:
            await asyncio.gather(*(k.ack for kept in list(self.kept.values()) for k in kept))

    def _record_position(self, meta: RecordMetadata) -> None:
        tp = meta.topic_partition
        if meta.offset + 1 > self.written.get(tp, 0):
            self.written[tp] = meta.offset + 1


def settle(ack: Ack, sent: Ack) -> None:
    """Resolve a queued record's acknowledgement as the producer's (or the resend's) resolved."""
    if ack.done():
        return
    if sent.cancelled():
        ack.cancel()
    elif (exc := sent.exception()) is not None:
        ack.set_exception(exc)
        ack.exception()  # retrieved: nobody may wait for it, and its record is kept and resent
    else:
        ack.set_result(sent.result())


async def connect(
    settings: Settings, *, compression_type: str | None, enable_idempotence: bool, max_record_bytes: int
) -> AIOKafkaProducer:
    """The started aiokafka producer of an `EventLog`, on the running loop: what a `Sender` sends with.

    Every send waits for all in-sync replicas (acks=all); the log lingers itself, so the producer
    does not. A broker that does not accept the connection in time raises what
    `connection_error` says of it (a refused password, an untrusted CA, nothing listening).
    """
    producer = AIOKafkaProducer(
        **client_options(settings.kafka),
        acks='all',
        linger_ms=0,  # the log lingers itself, and sends at once at a durability point
        compression_type=compression_type,
        enable_idempotence=enable_idempotence,
        max_request_size=max_record_bytes + 64 * 1024,
        request_timeout_ms=max(1000, int(settings.kafka.ack_timeout_s * 1000)),
        client_id='stepstream-producer',
    )
    try:
        await asyncio.wait_for(producer.start(), settings.kafka.ack_timeout_s)
        # aiokafka's metadata covers every topic until the producer first sends to a topic it
        # did not know when it started (the key topic, made later); from then on it covers only
        # the topics named that way. A batch waiting for a topic that fell out had no leader,
        # and failed with NotLeaderForPartitionError when it expired (decision 0040). Naming
        # the log's own topics now keeps them in.
        async with asyncio.timeout(settings.kafka.ack_timeout_s):
            for topic in (settings.topics.step_events_topic, settings.topics.tool_effects_topic):
                await producer.client.add_topic(topic)
    except (KafkaError, OSError, TimeoutError) as exc:
        await producer.stop()
        raise await connection_error(settings.kafka, 'did not accept a producer connection', exc) from exc
    return producer
