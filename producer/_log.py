"""`EventLog`: the one Kafka producer a process shares among all its agents and runs.

It only appends. A record waits up to `linger_ms` in the log's own queue, so that the records of
a step leave together (one produce request, one compressed batch per partition); a caller that
reaches a durability point (a tool about to run, a snapshot, the end of a run) has everything
queued handed to the producer at the event loop's next turn, together with the records of every
other durability point reached in this one, and waits for the acknowledgements of exactly the
records it wrote, with a timeout. Order is kept per partition throughout.

A record the broker did not take (it was away, or the send expired) is not dropped: the log keeps
it, holds every later record of the same run behind it, and sends them again, in `seq` order, as
soon as the broker answers, for as long as the log is open. That is how a run that failed because
the broker went away still ends with its `run_failed` once the broker is back.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import functools
import logging
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Self

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from stepstream.erasure import ensure_key_topic, key_topic
from stepstream.errors import MediaUnavailable, SchemaRegistryError, StepStreamError, StepStreamUnavailable
from stepstream.kafka_client import AUTHORIZATION_ERRORS, access_denied, client_options, connection_error
from stepstream.media import S3MediaStore
from stepstream.producer._liveness import CLOSED_WHILE_OPEN, Liveness, unwatch_sigterm, watch_sigterm
from stepstream.producer._protocol import (
    MAX_RECORD_BYTES,
    Ack,
    await_acks,
    encode_record,
    record_headers,
    topic_of,
)
from stepstream.schema_registry import SchemaRegistry
from stepstream.schemas import LogRecord, StepEvent, schema_of, subject_of, to_confluent
from stepstream.settings import Settings
from stepstream.telemetry import ack_latency, records_appended
from stepstream.topics import Position, ensure_topics, murmur2_partition, supports_idempotence, unavailable

if TYPE_CHECKING:
    from aiokafka.producer.message_accumulator import BatchBuilder

    from stepstream.producer._sealing import Sealer

Serializer = Callable[[LogRecord, int], bytes]
"""`(record, max_record_bytes) -> value`: encodes a record, or refuses it before it is sent."""

Partitioner = Callable[[bytes, int], int]
"""`(key, partition count) -> partition`: the same number on both topics for one run."""

Headers = Callable[[LogRecord], list[tuple[str, bytes]]]
"""`record -> headers` of the Kafka record."""

RESEND_BACKOFF_S = 0.5
"""How long the log waits before it tries again to send records the broker did not take."""

logger = logging.getLogger('stepstream.producer')


class _Outgoing:
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


class _Kept:
    """A record the broker has not taken yet, and the acknowledgement its writer may wait on."""

    __slots__ = ('ack', 'out', 'resending')

    def __init__(self, out: _Outgoing, ack: Ack) -> None:
        self.out = out
        self.ack = ack
        self.resending: Ack | None = None
        """The producer's future of the last resend while it is open: the record is not sent twice."""

    @property
    def record(self) -> LogRecord:
        return self.out.record

    def __lt__(self, other: _Kept) -> bool:
        return self.record.seq < other.record.seq


class _Batch:
    """Records of one hand-over for one partition, given to the producer as one batch."""

    __slots__ = ('builder', 'entries', 'log', 'partition', 'sent_at', 'topic')

    def __init__(self, log: EventLog, topic: str, partition: int, builder: BatchBuilder) -> None:
        self.log = log
        self.topic = topic
        self.partition = partition
        self.builder = builder
        self.entries: list[tuple[int, _Outgoing, Ack]] = []
        self.sent_at = 0.0

    def add(self, index: int, out: _Outgoing, ack: Ack, key: bytes, value: bytes) -> bool:
        """Append a record; False when the batch is full (the record goes to a new one)."""
        if self.builder.append(timestamp=None, key=key, value=value, headers=out.headers) is None:
            return False
        self.entries.append((index, out, ack))
        return True

    def sent(self, future: asyncio.Future[RecordMetadata]) -> None:
        """The producer took the batch: its acknowledgement settles each record's."""
        self.sent_at = time.perf_counter()
        records = len(self.entries)
        records_appended.add(records, _TOPIC_ATTRIBUTES[self.topic == self.log.settings.step_events_topic])
        self.log._pending[future] = [out for _index, out, _ack in self.entries]
        self.log._opened((self.topic, self.partition), self.entries[-1][1].record.run_id)
        future.add_done_callback(self.done)

    def keep(self) -> None:
        """The producer did not take the batch in time: keep its records for a resend, in order."""
        for _index, out, ack in self.entries:
            self.log._keep(out).add_done_callback(functools.partial(_settle, ack))

    def done(self, future: asyncio.Future[RecordMetadata]) -> None:
        """Resolve each record's acknowledgement as the batch's resolved (offsets from its base)."""
        log = self.log
        log._closed((self.topic, self.partition))
        del log._pending[future]
        if future.cancelled():
            for _index, out, ack in self.entries:
                log._keep(out)
                ack.cancel()
            return
        exc = future.exception()
        if exc is not None:
            denied = isinstance(exc, AUTHORIZATION_ERRORS)
            if denied:  # no ACL to write: sending again cannot help; every later wait raises this
                log._denied = log._denied or log._no_write(exc)
            for _index, out, ack in self.entries:
                if not denied:
                    log._keep(out)
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
        last = base.offset + len(self.entries)
        if last > log._written.get(tp, 0):
            log._written[tp] = last


def _append_order(entry: tuple[int, _Outgoing, Ack]) -> int:
    return entry[0]


class EventLog:
    """Appends stepstream records to Kafka; one instance per process.

    ```python
    async with EventLog(settings) as log:
        agent = Agent(model, capabilities=[StepPersistence(log=log)])
        ...
        position = await log.flush()   # everything written so far is acknowledged
    ```
    """

    def __init__(
        self,
        settings: Settings,
        *,
        create_topics: bool = True,
        linger_ms: int = 5,
        enable_idempotence: bool | None = None,
        max_record_bytes: int = MAX_RECORD_BYTES,
        compression_type: str | None = 'gzip',
        serializer: Serializer = encode_record,
        partitioner: Partitioner = murmur2_partition,
        headers: Headers = record_headers,
        end_runs_on_sigterm: bool = True,
    ) -> None:
        """Configure the log; nothing connects until `start()` (or `async with`).

        `linger_ms` (default 5, as Kafka's own producer since 4.0) is how long a record that no
        durability point waits for may stay queued before it is sent; a durability point (at the
        loop's next turn), `flush` and `close` send the queue at once, so a wait never pays the
        linger. 0 sends each record as it is appended.
        `enable_idempotence` (default None: on when the cluster grants producer ids, as Apache
        Kafka does and Tansu does not) makes the broker drop the duplicates a retried send would
        otherwise write. `compression_type` (default 'gzip', the codec that needs no
        extra package; 'lz4'/'zstd'/'snappy' with theirs; None for none) compresses each batch
        on the wire and in the log, which is kept forever (docs/decisions/0007-compression.md).
        `serializer`, `partitioner` and `headers` are the log's collaborators, as in aiokafka: by
        default the Avro codec with the id rules and the size limit, Kafka's murmur2 of the run
        id, and the kind, schema and trace headers. Media offload is not the log's business: the
        capability's snapshot writer moves large values before a record reaches the log.
        While a run is open the log keeps it alive on the log (`settings.heartbeat_interval_s`);
        `close` ends the runs still open as `cancelled`, and so does SIGTERM when
        `end_runs_on_sigterm` and nothing else handles that signal (docs/decisions/0026).
        """
        if settings.media_threshold_bytes >= max_record_bytes:
            raise ValueError(
                f'media_threshold_bytes ({settings.media_threshold_bytes}) must stay below the record limit '
                f'({max_record_bytes}): payloads under the threshold stay inline in records'
            )
        self.settings = settings
        self.serializer = serializer
        self.partitioner = partitioner
        self.headers = headers
        self.create_topics = create_topics
        self.max_record_bytes = max_record_bytes
        self.linger_ms = linger_ms
        self.compression_type = compression_type
        self.enable_idempotence = enable_idempotence
        self.end_runs_on_sigterm = end_runs_on_sigterm
        self.liveness = Liveness(self, settings.heartbeat_interval_s)
        """The open runs of this process, kept alive on the log by heartbeats."""
        self._producer: AIOKafkaProducer | None = None
        self._written: Position = {}
        self._pending: dict[asyncio.Future[RecordMetadata], list[_Outgoing]] = {}
        """Handed to the producer, not acknowledged yet: a record's or a batch's future, and its records."""
        self._kept: dict[str, list[_Kept]] = {}
        """Per run, in `seq` order: records to send again (see the module docstring)."""
        self._kept_changed = asyncio.Event()
        self._queued: list[tuple[_Outgoing, Ack]] = []
        """Appended, not yet handed to the producer, in call order (see `linger_ms`)."""
        self._handing: asyncio.Future[None] | None = None
        """Set while a hand-over runs (see `_hand_over`)."""
        self._open_sends: dict[tuple[str, int], int] = {}
        """Per partition: sends (a record's or a batch's) not acknowledged yet (see `_hand_batches`)."""
        self._last_sender: dict[tuple[str, int], str] = {}
        """Per partition: the run whose record was given to the producer last (see `_hand_batches`)."""
        self._linger_timer: asyncio.TimerHandle | None = None
        self._soon: asyncio.Handle | None = None
        """Set while a hand-over is due at the loop's next turn (`_hand_over_soon`)."""
        self._linger_tasks: set[asyncio.Task[None]] = set()
        self._resender: asyncio.Task[None] | None = None
        self._started = False
        self._start_lock = asyncio.Lock()
        self._partition_count = 0
        self._denied: StepStreamError | None = None
        """Set when the broker refused a write for lack of an ACL; raised by every later wait."""
        self._registry: SchemaRegistry | None = None
        """Set in registry mode (`schema_registry_url`): records leave in the Confluent wire format."""
        self._registry_failure: SchemaRegistryError | None = None
        """Why the registry last failed to give a schema id; None once it gives one."""
        self.sealer: Sealer | None = None
        """Set when erasure is on (`settings.erasure_key`): seals snapshot content (decision 0033)."""
        if settings.erasure_key is not None:
            from stepstream.producer._sealing import Sealer  # not at import: erasure is optional

            self.sealer = Sealer(settings.erasure_key.get_secret_value(), self._send_key)

    _shared: ClassVar[dict[Settings, EventLog]] = {}

    @classmethod
    def shared(cls, settings: Settings) -> EventLog:
        """The process's one `EventLog` for exactly these settings, started on first use.

        For capabilities built from a serialisable spec (`StepPersistence.from_spec`), which
        cannot be handed a live object. Close them all with `await EventLog.close_shared()`.

        Keyed by the whole `Settings`, not by servers and topics alone: a log connects as one
        principal (SASL user, client certificate) with one set of timeouts, so two specs that
        name the same cluster as different users must not write through one connection.
        """
        log = cls._shared.get(settings)
        if log is None:
            log = cls._shared[settings] = cls(settings)
        return log

    @classmethod
    async def close_shared(cls) -> None:
        """Flush and close every log made by `shared()`."""
        logs, cls._shared = list(cls._shared.values()), {}
        for log in logs:
            await log.close()

    async def start(self) -> None:
        """Connect, and create the topics if allowed and missing."""
        async with self._start_lock:
            if not self._started:
                await self._start()

    async def _start(self) -> None:
        layout = await ensure_topics(self.settings, create=self.create_topics, dlq=False)
        self._partition_count = layout.partitions
        if self.enable_idempotence is None:
            self.enable_idempotence = await supports_idempotence(self.settings)
        # aiokafka binds a producer to the running loop, so it is made here, not in __init__.
        producer = AIOKafkaProducer(
            **client_options(self.settings),
            acks='all',
            linger_ms=0,  # the log lingers itself, and sends at once at a durability point
            compression_type=self.compression_type,
            enable_idempotence=self.enable_idempotence,
            max_request_size=self.max_record_bytes + 64 * 1024,
            request_timeout_ms=max(1000, int(self.settings.ack_timeout_s * 1000)),
            client_id='stepstream-producer',
        )
        try:
            await asyncio.wait_for(producer.start(), self.settings.ack_timeout_s)
            # aiokafka's metadata covers every topic until the producer first sends to a topic it
            # did not know when it started (the key topic, made below); from then on it covers only
            # the topics named that way. A batch waiting for a topic that fell out had no leader,
            # and failed with NotLeaderForPartitionError when it expired (decision 0040). Naming
            # the log's own topics now keeps them in.
            async with asyncio.timeout(self.settings.ack_timeout_s):
                for topic in (self.settings.step_events_topic, self.settings.tool_effects_topic):
                    await producer.client.add_topic(topic)
        except (KafkaError, OSError, TimeoutError) as exc:
            await producer.stop()
            raise await connection_error(self.settings, 'did not accept a producer connection', exc) from exc
        try:
            await self._check_media_store()
            if self.sealer is not None and self.create_topics:
                await ensure_key_topic(self.settings)
        except BaseException:
            await producer.stop()
            raise
        self._producer = producer
        if self.settings.schema_registry_url is not None:
            self._registry = SchemaRegistry(self.settings)
        self._started = True
        self._resender = asyncio.create_task(self._resend_kept(), name='stepstream-resend')
        self.liveness.bind(asyncio.get_running_loop())
        if self.end_runs_on_sigterm:
            watch_sigterm(self)

    async def _send_key(self, key: bytes, value: bytes) -> None:
        """Append a conversation key record to the key topic and wait for the broker (erasure on)."""
        if self._producer is None:
            await self.start()
        assert self._producer is not None
        try:
            async with asyncio.timeout(self.settings.ack_timeout_s):
                await self._producer.send_and_wait(key_topic(self.settings), value, key=key)
        except (KafkaError, TimeoutError) as exc:
            raise unavailable(self.settings, 'did not acknowledge a conversation key', exc) from exc

    async def _check_media_store(self) -> None:
        """Find a wrong bucket or key now, not at the first large payload minutes into a run.

        The bucket checked is the one these settings name, which `StepPersistence` uses unless it
        is given a `media_store` of its own. Settings that name S3 (an endpoint, a key or a bucket
        of their own) must work: the start fails. Default settings on a machine without S3 only
        get a warning, since a run without payloads above the threshold never needs the store.
        """
        s, defaults = self.settings, Settings()
        configured = (
            s.s3_endpoint is not None or s.s3_access_key_id is not None or s.s3_bucket != defaults.s3_bucket
        )
        try:
            await S3MediaStore.from_settings(s).check()
        except MediaUnavailable as exc:
            if configured:
                raise
            logger.warning(
                'payloads of %d bytes or more will fail until S3 is set up: %s', s.media_threshold_bytes, exc
            )

    async def close(self) -> None:
        """Flush what is buffered (best effort within the timeout) and disconnect.

        Runs still open are ended first (`run_cancelled`: the process closed the log while they
        ran), except runs under a durable-execution engine, which their engine recovers.
        Records the broker has not taken by then (it is still away) are lost with the process;
        a warning names their runs.
        """
        unwatch_sigterm(self)
        if self._started:
            await self.liveness.close_runs(CLOSED_WHILE_OPEN)
        await self.liveness.stop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._hand_over(settled=True), self.settings.ack_timeout_s)
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        resender, self._resender = self._resender, None
        if resender is not None:
            if self._kept:
                self._kept_changed.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_kept_sent(), self.settings.ack_timeout_s)
            resender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await resender
        producer, self._producer = self._producer, None
        self._started = False
        registry, self._registry = self._registry, None
        if registry is not None:
            await registry.close()
        if producer is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(producer.stop(), self.settings.ack_timeout_s)
        # Records still kept for a resend, and (an idempotent producer retries on its own, so its
        # sends never fail) records whose sends were still open when the producer stopped.
        lost: dict[str, list[int]] = {}
        unsent = [out.record for out, _ack in self._queued]
        kept = [k.record for entries in self._kept.values() for k in entries]
        pending = [out.record for outs in self._pending.values() for out in outs]
        for record in [*unsent, *pending, *kept]:
            if not (isinstance(record, StepEvent) and record.kind == 'run_heartbeat'):  # takes no seq
                lost.setdefault(record.run_id, []).append(record.seq)
        lost = {run_id: sorted(set(seqs)) for run_id, seqs in lost.items()}
        if lost:
            logger.warning(
                'stepstream: Kafka at %s did not take %d record(s) before the log closed (run_id: seqs) %s',
                self.settings.bootstrap_servers,
                sum(len(seqs) for seqs in lost.values()),
                lost,
            )

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def append(self, record: LogRecord) -> Ack:
        """Queue one record; returns its acknowledgement without waiting for it.

        Records of one run go to one partition per topic (keyed by run_id), in call order.
        Raises `ValueError` for an id the projector would refuse (`stepstream.ids`) and
        `RecordTooLarge` for a record above the limit, before anything is sent.
        """
        return await self.send(record, self.encode(record))

    def encode(self, record: LogRecord) -> bytes:
        """The record's bytes, or the error that refuses it before it is sent.

        Raises `ValueError` for an id the projector would refuse (`stepstream.ids`) and
        `RecordTooLarge` for a record above the limit. Split from `send` so that a writer can
        give a record its `seq` only once it is accepted (a refused record leaves no gap).
        """
        return self.serializer(record, self.max_record_bytes)

    async def send(self, record: LogRecord, value: bytes) -> Ack:
        """Send a record encoded by `encode`; returns its acknowledgement without waiting for it.

        A record the broker does not take in time is kept and sent again (see the module
        docstring): its acknowledgement resolves when it is taken, and a durability point that
        waits for it longer than the timeout fails with `StepStreamUnavailable`.
        """
        if not self._started:
            if self not in self._shared.values():
                raise StepStreamError('EventLog is not started: use `async with EventLog(settings)` first')
            await self.start()
        assert self._producer is not None
        if self._denied is not None:
            raise self._denied
        key = record.run_id.encode()
        partition = self.partitioner(key, self._partition_count)
        out = _Outgoing(record, value, self.headers(record), key, topic_of(record, self.settings), partition)
        if self.linger_ms <= 0:
            return await self._hand(out)
        ack: Ack = asyncio.get_running_loop().create_future()
        self._queued.append((out, ack))
        self._arm_linger()
        return ack

    def _arm_linger(self) -> None:
        if self._linger_timer is None:
            loop = asyncio.get_running_loop()
            self._linger_timer = loop.call_later(self.linger_ms / 1000, self._linger_over)

    def _hand_over_soon(self) -> None:
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
        if self._queued:
            task = asyncio.create_task(self._hand_over_lingered(), name='stepstream-linger')
            self._linger_tasks.add(task)
            task.add_done_callback(self._linger_tasks.discard)

    async def _hand_over_lingered(self) -> None:
        try:
            await self._hand_over()
        except Exception as exc:  # the records stay queued for the next hand-over
            logger.warning('stepstream: handing queued records to the producer failed: %r', exc)

    async def _hand_over(self, *, settled: bool = False) -> None:
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
        if not self._queued:
            return
        self._handing = asyncio.get_running_loop().create_future()
        try:
            while self._queued:
                queued, self._queued = self._queued, []
                if self._linger_timer is not None:
                    self._linger_timer.cancel()
                    self._linger_timer = None
                await self._hand_batches(queued)
        finally:
            handing, self._handing = self._handing, None
            handing.set_result(None)

    async def _hand_batches(self, queued: list[tuple[_Outgoing, Ack]]) -> None:
        """Give queued records to the producer: a batch per partition, but for a run's own busy one.

        A partition with nothing of this log's unacknowledged gets the hand-over's records as one
        batch (`create_batch`/`send_batch`): one future per batch, not per record, whose
        acknowledgement resolves each record's own (`_Batch.done`). So does a partition whose
        last send was another run's: runs share it, so the log is busy, and a batch costs a
        fraction of the producer's path per record. Such a batch waits for the producer's batch
        ahead of it to leave (`send_batch` does), so these go last; durability points that arrive
        meanwhile queue their records for the hand-over's next round, in fewer, larger batches.
        A partition whose last send is this run's own (a record of the same step sent when its
        linger ended) gets the records one by one (`send`), joining the producer's batch still
        waiting there: a batch would leave one round trip later, in a batch of its own (more
        framing bytes for a lone run, decision 0034). A record of a run with kept records is
        kept behind them. A batch the producer does not take in time (one deadline for the
        hand-over's batches) is kept record by record, like a record the broker did not take,
        and so is every batch after it. Cancelled (the waiting caller was) or failed before the
        producer took them: the records not handed yet go back to the front of the queue, in
        order.
        """
        assert self._producer is not None
        batches: list[_Batch] = []
        behind: list[_Batch] = []  # for partitions with another run's send open
        open_batches: dict[tuple[str, int], _Batch | None] = {}
        singles: list[tuple[int, _Outgoing, Ack]] = []
        handed = 0  # of `singles`
        submitted = 0  # of `batches`
        try:
            for index, (out, ack) in enumerate(queued):
                record = out.record
                if self._kept and record.run_id in self._kept:  # behind its run's kept records
                    self._keep(out).add_done_callback(functools.partial(_settle, ack))
                    continue
                key, topic, partition, tp = out.key, out.topic, out.partition, out.tp
                if tp not in open_batches:
                    if not self._open_sends.get(tp):
                        batch = self._new_batch(topic, partition)
                        batches.append(batch)
                    elif self._last_sender.get(tp) != record.run_id:
                        batch = self._new_batch(topic, partition)
                        behind.append(batch)
                    else:
                        batch = None
                    open_batches[tp] = batch
                batch = open_batches[tp]
                if batch is None:
                    singles.append((index, out, ack))
                    continue
                if self._registry is None:
                    value = out.value
                else:
                    try:
                        value = await self._confluent(out, topic)
                    except SchemaRegistryError:
                        self._keep(out).add_done_callback(functools.partial(_settle, ack))
                        continue
                if not batch.add(index, out, ack, key, value):  # full: the rest goes in a new batch
                    batch = open_batches[tp] = self._new_batch(topic, partition)
                    (behind if self._open_sends.get(tp) else batches).append(batch)
                    if not batch.add(index, out, ack, key, value):  # never: an empty batch takes any record
                        raise StepStreamError(
                            f'the producer refused a {len(value)}-byte record in an empty batch'
                        )
            try:
                # One deadline for the hand-over's records (asyncio.timeout: no task, one timer).
                async with asyncio.timeout(self.settings.ack_timeout_s):
                    for _i, out, ack in singles:
                        await self._hand(out, ack, deadline=False)
                        handed += 1
            except TimeoutError:
                # The record the producer did not take, and every one behind it: never ahead of it.
                for _i, out, ack in singles[handed:]:
                    self._keep(out).add_done_callback(functools.partial(_settle, ack))
                handed = len(singles)
            # `behind` last: each waits for the producer's batch ahead of it on its partition to
            # leave. A batch whose records were all kept (no schema id yet) is not handed over.
            batches, behind = [batch for batch in (*batches, *behind) if batch.entries], []
            try:
                # One deadline for the hand-over's batches (asyncio.timeout: no task, one timer).
                async with asyncio.timeout(self.settings.ack_timeout_s):
                    for batch in batches:
                        future = await self._producer.send_batch(
                            batch.builder, batch.topic, partition=batch.partition
                        )
                        batch.sent(future)
                        submitted += 1
            except (KafkaError, TimeoutError):
                # The batch the producer did not take, and every one behind it: never ahead of it.
                for batch in batches[submitted:]:
                    batch.keep()
                submitted = len(batches)
        except BaseException:
            unsent = sorted(
                [*singles[handed:], *(e for b in [*batches[submitted:], *behind] for e in b.entries)],
                key=_append_order,
            )
            self._queued[:0] = [(out, ack) for _i, out, ack in unsent]
            self._arm_linger()
            raise

    def _new_batch(self, topic: str, partition: int) -> _Batch:
        assert self._producer is not None
        return _Batch(self, topic, partition, self._producer.create_batch())

    def _opened(self, tp: tuple[str, int], run_id: str) -> None:
        """Count a send (a record's or a batch's) as open on `tp`; its done callback calls `_closed`."""
        self._open_sends[tp] = self._open_sends.get(tp, 0) + 1
        self._last_sender[tp] = run_id

    def _closed(self, tp: tuple[str, int]) -> None:
        left = self._open_sends[tp] - 1
        if left:
            self._open_sends[tp] = left
        else:
            del self._open_sends[tp]

    async def _hand(self, out: _Outgoing, ack: Ack | None = None, *, deadline: bool = True) -> Ack:
        """Give one record to the producer (or keep it for a resend); the producer's future.

        `ack`, when given, is the record's own acknowledgement, resolved as that one resolves.
        `deadline=False` for a caller that holds a deadline of its own over several records.
        """
        if self._kept and out.record.run_id in self._kept:
            kept = self._keep(out)  # behind the run's earlier records, never ahead of them
        else:
            try:
                if deadline:
                    # asyncio.timeout, not wait_for: no extra task per record on the hot path.
                    async with asyncio.timeout(self.settings.ack_timeout_s):
                        sent = await self._send(out, functools.partial(self._handed, out, ack))
                else:
                    sent = await self._send(out, functools.partial(self._handed, out, ack))
            except (KafkaError, TimeoutError, SchemaRegistryError):
                kept = self._keep(out)
            else:
                self._pending[sent] = [out]
                return sent
        if ack is not None:
            kept.add_done_callback(functools.partial(_settle, ack))
        return kept

    def _handed(self, out: _Outgoing, ack: Ack | None, sent: Ack) -> None:
        """A record `_hand` gave the producer was acknowledged, failed or cancelled."""
        del self._pending[sent]
        if not sent.cancelled() and isinstance(sent.exception(), AUTHORIZATION_ERRORS):
            # No ACL to write: sending again cannot help. Every later wait raises this.
            self._denied = self._denied or self._no_write(sent.exception())
        elif sent.cancelled() or sent.exception() is not None:
            self._keep(out)  # sent again; the waiter learns of the failure now (`_settle`)
        else:
            self._record_position(sent.result())
        if ack is not None:
            _settle(ack, sent)

    async def _send(self, out: _Outgoing, then: Callable[[Ack], None]) -> Ack:
        """Give a record to the producer; `then(future)` runs once the producer's future is done.

        One callback per record: it closes the record's open send on its partition, records the
        acknowledgement's latency and calls `then`.
        """
        assert self._producer is not None
        topic, tp = out.topic, out.tp
        value = out.value if self._registry is None else await self._confluent(out, topic)
        sent_at = time.perf_counter()
        sent: Ack = await self._producer.send(
            topic, value, key=out.key, headers=out.headers, partition=out.partition
        )
        self._opened(tp, out.record.run_id)
        records_appended.add(1, _TOPIC_ATTRIBUTES[isinstance(out.record, StepEvent)])
        sent.add_done_callback(functools.partial(self._sent, tp, sent_at, then))
        return sent

    def _sent(self, tp: tuple[str, int], sent_at: float, then: Callable[[Ack], None], sent: Ack) -> None:
        self._closed(tp)
        if not sent.cancelled() and sent.exception() is None:
            ack_latency.record(time.perf_counter() - sent_at)
        then(sent)

    async def _confluent(self, out: _Outgoing, topic: str) -> bytes:
        """The record in the Confluent wire format, its schema's id asked of the registry once per process.

        Raises `SchemaRegistryError` when the id is not cached and the registry does not give it:
        the record is then kept and sent again like one the broker did not take.
        """
        assert self._registry is not None
        schema, subject = schema_of(out.record), subject_of(topic)
        schema_id = self._registry.cached_id(subject, schema)
        if schema_id is None:
            try:
                # Within the send's own timeout, so that a registry that hangs is named as the cause.
                async with asyncio.timeout(self.settings.ack_timeout_s / 2):
                    schema_id = await self._registry.id_of(subject, schema)
            except (SchemaRegistryError, TimeoutError) as exc:
                self._registry_failure = SchemaRegistryError(
                    f'{exc if isinstance(exc, SchemaRegistryError) else self._registry_timeout()}. '
                    f'Records of {schema.name} are kept, and sent once it gives their schema id'
                )
                raise self._registry_failure from exc
            self._registry_failure = None
        if out.value[2:10] != schema.fingerprint:
            raise StepStreamError(
                f'the serializer did not write {schema.name} v{schema.version} in single-object encoding, '
                'which the registry mode reframes: use the default serializer with a schema registry'
            )
        return to_confluent(out.value, schema_id)

    def _registry_timeout(self) -> str:
        assert self._registry is not None
        return (
            f'the schema registry at {self._registry.url} did not answer within '
            f'{self.settings.ack_timeout_s / 2:g}s: check STEPSTREAM_SCHEMA_REGISTRY_URL'
        )

    def _keep(self, out: _Outgoing) -> Ack:
        """Keep a record the broker did not take, in its run's `seq` order, and wake the resender.

        Only the same record is kept once: records may share a `seq` (an operator's resolution
        names the seq of the transition it answers), and each must reach the log.
        """
        kept = self._kept.setdefault(out.record.run_id, [])
        for other in kept:
            if other.record == out.record:
                return other.ack
        entry = _Kept(out, asyncio.get_running_loop().create_future())
        bisect.insort(kept, entry)
        self._kept_changed.set()
        return entry.ack

    async def _resend_kept(self) -> None:
        """Send kept records again, run by run in `seq` order, until the broker takes them."""
        while True:
            await self._kept_changed.wait()
            self._kept_changed.clear()
            while self._kept:
                if not await self._resend_once():
                    await asyncio.sleep(RESEND_BACKOFF_S)

    async def _resend_once(self) -> bool:
        """One pass over the kept records, all runs at once; True when the broker took all of them."""
        await asyncio.gather(*(self._resend_run(run_id) for run_id in list(self._kept)))
        return not self._kept

    async def _resend_run(self, run_id: str) -> None:
        sent: list[Ack] = []
        try:
            async with asyncio.timeout(self.settings.ack_timeout_s):
                for entry in list(self._kept.get(run_id, ())):
                    if entry.resending is not None and not entry.resending.done():
                        sent.append(entry.resending)  # still on its way from an earlier pass
                        continue
                    ack = entry.resending = await self._send(
                        entry.out, functools.partial(self._on_resent, entry)
                    )
                    sent.append(ack)
                if sent:
                    await asyncio.wait(sent)
        except (KafkaError, TimeoutError, OSError, SchemaRegistryError) as exc:
            logger.debug('stepstream: resending records of run %r failed (%r); retrying', run_id, exc)

    def _on_resent(self, entry: _Kept, ack: Ack) -> None:
        if ack.cancelled() or ack.exception() is not None:
            return  # still kept: the next pass sends it again
        self._record_position(ack.result())
        kept = self._kept.get(entry.record.run_id)
        if kept is not None and entry in kept:
            kept.remove(entry)
            if not kept:
                del self._kept[entry.record.run_id]
        if not entry.ack.done():
            entry.ack.set_result(ack.result())

    async def _all_kept_sent(self) -> None:
        while self._kept:
            await asyncio.gather(*(k.ack for kept in list(self._kept.values()) for k in kept))

    def _record_position(self, meta: RecordMetadata) -> None:
        tp = meta.topic_partition
        if meta.offset + 1 > self._written.get(tp, 0):
            self._written[tp] = meta.offset + 1

    async def wait_acked(self, acks: Iterable[Ack], *, timeout: float | None = None) -> None:
        """Wait until the broker acknowledged every record in `acks`.

        Raises `StepStreamUnavailable` naming the servers and the timeout when it does not, or
        `SchemaRegistryError` when the records wait for a schema id the registry did not give.
        """
        acks = list(acks)
        if self._queued:
            self._hand_over_soon()
        try:
            await await_acks(self.settings, acks, timeout)
        except StepStreamUnavailable as missing:
            if self._registry_failure is not None:  # the records wait for their schema id, not the broker
                raise SchemaRegistryError(str(self._registry_failure)) from missing
            raise
        for ack in acks:
            exc = ack.exception()
            if isinstance(exc, AUTHORIZATION_ERRORS):
                raise self._no_write(exc) from exc
            if exc is not None:
                raise unavailable(self.settings, 'rejected a record', exc) from exc

    def _no_write(self, exc: BaseException | None) -> StepStreamError:
        assert exc is not None
        topics = f'{self.settings.step_events_topic} and {self.settings.tool_effects_topic}'
        return access_denied(
            self.settings,
            f'write to {topics}',
            exc,
            fix=f'grant it WRITE on {topics} (the producer ACL), or use the producer principal',
        )

    async def flush(self, *, timeout: float | None = None) -> Position:
        """Wait until the broker took every record appended so far, then return the position written.

        A record the broker did not take at first is being sent again: it is waited for too.
        Pass the result to `Projector.wait_for` to read your own writes. `timeout` defaults to
        `settings.ack_timeout_s`; after a broker outage, give the producer longer to reconnect.
        Raises `StepStreamUnavailable` when the records are not all taken in time.
        """
        limit = self.settings.ack_timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                await self._hand_over(settled=True)
                while self._pending or self._kept:
                    # A send that fails moves its record to the kept ones, so look again until none is left.
                    await asyncio.wait(
                        [*self._pending, *(k.ack for kept in self._kept.values() for k in kept)]
                    )
        except TimeoutError:
            waiting = sum(len(outs) for outs in self._pending.values())
            waiting += sum(len(kept) for kept in self._kept.values())
            waited = '' if timeout is None else f' (waited {timeout:g}s)'
            if self._registry_failure is not None:
                raise SchemaRegistryError(str(self._registry_failure)) from None
            raise unavailable(self.settings, f'did not take {waiting} record(s){waited}') from None
        if self._denied is not None:
            raise self._denied
        return dict(self._written)

    @property
    def position(self) -> Position:
        """The acknowledged position so far, without waiting."""
        return dict(self._written)


_TOPIC_ATTRIBUTES = {True: {'stepstream.topic': 'step-events'}, False: {'stepstream.topic': 'tool-effects'}}


def _settle(ack: Ack, sent: Ack) -> None:
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
