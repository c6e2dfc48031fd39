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

The log is its collaborators, as aiokafka's producer is an accumulator and a sender: the
`Accumulator` (`_accumulator`: the queue, the linger, one hand-over at a time), `hand_batches`
(`_batches`: a hand-over's batches and singles), the `Sender` (`_sender`: the producer it
connects, its sends, the records kept and resent, the acknowledged position), the `Framing`
(`_framing`: the registry mode's wire format) and, with erasure on, the `Sealer` (`_sealing`),
whose keys the log writes to the key topic (`_send_key`). `Liveness` (`_liveness`) keeps its open runs alive.

Every collaborator lives on the loop the log was started on. A run on another thread or loop
(`run_sync` in a worker thread, `asyncio.run` per request) hands its records to that loop through
the log's inbox (`Crossing`) and waits for acknowledgements of its own loop (decision 0052); its
`flush`, `close` and conversation keys run on the log's loop. A log whose loop is no longer
running refuses such a record at once, saying what to do: nothing would ever send it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Self

from aiokafka import AIOKafkaProducer

from stepstream.erasure import ensure_key_topic, key_topic
from stepstream.errors import SchemaRegistryError, StepStreamError, StepStreamUnavailable
from stepstream.kafka_client import AUTHORIZATION_ERRORS
from stepstream.producer._accumulator import Accumulator, Crossing, Queued
from stepstream.producer._batches import hand_batches
from stepstream.producer._framing import Framing
from stepstream.producer._liveness import CLOSED_WHILE_OPEN, Liveness, unwatch_sigterm, watch_sigterm
from stepstream.producer._protocol import (
    MAX_RECORD_BYTES,
    Ack,
    await_acks,
    encode_record,
    gone,
    loop_blocked,
    loop_gone,
    record_headers,
    run_on,
    topic_of,
)
from stepstream.producer._sender import Outgoing, Sender, connect
from stepstream.schemas import LogRecord
from stepstream.settings import Settings, check_count
from stepstream.telemetry import failed
from stepstream.topics import Position, ensure_topics, murmur2_partition, supports_idempotence, unavailable

if TYPE_CHECKING:
    from stepstream.producer._sealing import Sealer

Serializer = Callable[[LogRecord, int], bytes]
"""`(record, max_record_bytes) -> value`: encodes a record, or refuses it before it is sent."""

Partitioner = Callable[[bytes, int], int]
"""`(key, partition count) -> partition`: the same number on both topics for one run."""

Headers = Callable[[LogRecord], list[tuple[str, bytes]]]
"""`record -> headers` of the Kafka record."""

StartCheck = Callable[[Settings], Awaitable[None]]
"""`settings -> None`: a check of a service the settings name besides Kafka, run as a log starts."""

logger = logging.getLogger('stepstream.producer')


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
        id, and the kind, schema and trace headers. Media are not the log's business: the
        capability's snapshot writer moves large values before a record reaches the log, and its
        options check the S3 bucket they choose as the log starts (`start_checks`).
        While a run is open the log keeps it alive on the log (`settings.liveness.heartbeat_interval_s`);
        `close` ends the runs still open as `cancelled`, and so does SIGTERM when
        `end_runs_on_sigterm` and nothing else handles that signal (docs/decisions/0026).
        """
        check_count(max_record_bytes, 'max_record_bytes')
        if settings.media.media_threshold_bytes >= max_record_bytes:
            raise ValueError(
                f'media_threshold_bytes ({settings.media.media_threshold_bytes}) must stay below '
                'the record limit '
                f'({max_record_bytes}): payloads under the threshold stay inline in records'
            )
        self.settings = settings
        self.start_checks: list[StartCheck] = []
        """What this log checks as it starts, beyond Kafka (`check_at_start`)."""
        self.serializer = serializer
        self.partitioner = partitioner
        self.headers = headers
        self.create_topics = create_topics
        self.max_record_bytes = max_record_bytes
        self.linger_ms = linger_ms
        self.compression_type = compression_type
        self.enable_idempotence = enable_idempotence
        self.end_runs_on_sigterm = end_runs_on_sigterm
        self.liveness = Liveness(self, settings.liveness.heartbeat_interval_s)
        """The open runs of this process, kept alive on the log by heartbeats."""
        self._framing = Framing(settings.registry, settings.kafka.ack_timeout_s)
        self._sender = Sender(settings.kafka, settings.topics, self._framing)
        self._accumulator = Accumulator(linger_ms, lambda queued: self._hand_batches(queued))
        """Hands over through `_hand_batches`, looked up at each hand-over (bench.handovers wraps it)."""
        self._crossing = Crossing(self._accumulator)
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the log was started on, where its collaborators live."""
        self._start_guard = threading.Lock()
        self._starting: concurrent.futures.Future[None] | None = None
        """The start under way, which callers on every thread wait for (`start`)."""
        self._partition_count = 0
        self.sealer: Sealer | None = None
        """Set when erasure is on (`security.erasure_key`): seals snapshot content (decision 0033)."""
        if settings.security.erasure_key is not None:
            from stepstream.producer._sealing import Sealer  # not at import: erasure is optional

            self.sealer = Sealer(settings.security.erasure_key.get_secret_value(), self._send_key)

    def check_at_start(self, check: StartCheck) -> None:
        """Run `check` as this log starts, once connected (a failure fails the start); once per check.

        Media are not the log's business: a capability that uses the S3 bucket of this log's
        settings asks for that bucket's check (`_options.check_media_store`), so that a wrong bucket
        or key is found at start, not at the first large payload. A log already started runs none.
        """
        if check not in self.start_checks:
            self.start_checks.append(check)

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
        """Connect, and create the topics if allowed and missing; at once when started.

        Callers on other threads' loops at the same time wait for the one start (a shared log
        started by the first runs of a thread pool).
        """
        with self._start_guard:
            starting = self._starting
            mine = starting is None or (starting.done() and not self._started)
            if mine:
                starting = self._starting = concurrent.futures.Future()
        assert starting is not None
        if not mine:
            await asyncio.wrap_future(starting)
            return
        try:
            await self._start()
        except BaseException as error:
            starting.set_exception(error)  # for the callers waiting on it; the next start tries again
            raise
        starting.set_result(None)

    async def _start(self) -> None:
        layout = await ensure_topics(self.settings, create=self.create_topics, dlq=False)
        self._partition_count = layout.partitions
        if self.enable_idempotence is None:
            self.enable_idempotence = await supports_idempotence(self.settings.kafka)
        # aiokafka binds a producer to the running loop, so it is made here, not in __init__.
        producer = await connect(
            self.settings,
            compression_type=self.compression_type,
            enable_idempotence=self.enable_idempotence,
            max_record_bytes=self.max_record_bytes,
        )
        try:
            for check in self.start_checks:
                await check(self.settings)
            if self.sealer is not None and self.create_topics:
                await ensure_key_topic(self.settings)
        except BaseException:
            await producer.stop()
            raise
        self._framing.start()
        self._started = True
        self._loop = loop = asyncio.get_running_loop()
        self._crossing.bind(loop)
        self._sender.start(producer)
        self.liveness.bind(loop)
        if self.end_runs_on_sigterm:
            watch_sigterm(self)

    @property
    def _producer(self) -> AIOKafkaProducer | None:
        """The aiokafka producer while the log is started (the sender's)."""
        return self._sender.producer

    async def _send_key(self, key: bytes, value: bytes) -> None:
        """Append a conversation key record to the key topic and wait for the broker (erasure on)."""
        if (loop := self._elsewhere()) is not None:
            await run_on(loop, self._send_key(key, value), 2 * self.settings.kafka.ack_timeout_s)
            return
        if self._sender.producer is None:
            await self.start()
        await self._sender.send_key(key_topic(self.settings.topics), key, value)

    async def close(self) -> None:
        """Flush what is buffered (best effort within the timeout) and disconnect.

        Runs still open are ended first (`run_cancelled`: the process closed the log while they
        ran), except runs under a durable-execution engine, which their engine recovers.
        Records the broker has not taken by then (it is still away) are lost with the process;
        a warning names their runs. From another loop, the log closes on its own loop; when
        that loop is no longer running, nothing can be sent or stopped: the warning says so.
        """
        if (loop := self._elsewhere()) is not None and loop.is_running():
            await run_on(loop, self.close(), 6 * self.settings.kafka.ack_timeout_s)
            return
        unwatch_sigterm(self)
        if loop is not None:  # its loop no longer runs: nothing can be sent or stopped
            self._started = False
            queued = [out.record for out, _ack in self._accumulator.queued]
            self._sender.warn_lost(queued, f' (its event loop {gone(loop)}, so nothing could be sent)')
            return
        self._crossing.take_posted()  # records other loops appended before the close
        if self._started:
            await self.liveness.close_runs(CLOSED_WHILE_OPEN, timeout_s=self.settings.kafka.ack_timeout_s)
        await self.liveness.stop()
        self._crossing.take_posted()  # the ends of runs on other loops
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self._accumulator.hand_over(settled=True), self.settings.kafka.ack_timeout_s
            )
        self._accumulator.stop()
        self._crossing.stop()
        await self._sender.stop_resending(self.settings.kafka.ack_timeout_s)
        producer = self._sender.detach()
        self._started = False
        await self._framing.close()
        if producer is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(producer.stop(), self.settings.kafka.ack_timeout_s)
        self._sender.warn_lost([out.record for out, _ack in self._accumulator.queued], '')

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
        sender = self._sender
        if sender.denied is not None:
            raise sender.denied
        key = record.run_id.encode()
        partition = self.partitioner(key, self._partition_count)
        out = Outgoing(
            record, value, self.headers(record), key, topic_of(record, self.settings.topics), partition
        )
        if asyncio.get_running_loop() is not self._loop:
            return self._crossing.append(out)  # refused when the log's loop no longer runs
        if self.linger_ms <= 0:
            return await sender.hand(out)
        return self._accumulator.append(out)

    def _elsewhere(self) -> asyncio.AbstractEventLoop | None:
        """The log's loop when the caller runs on another one (`run_on` it), else None."""
        loop = self._loop
        return loop if loop is not None and loop is not asyncio.get_running_loop() else None

    async def _hand_batches(self, queued: Queued) -> None:
        """Give a hand-over's records to the producer (`hand_batches`); the unsent go back to the queue."""
        await hand_batches(self._sender, queued, self._accumulator.requeue)

    async def wait_acked(self, acks: Iterable[Ack], *, timeout: float | None = None) -> None:
        """Wait until the broker acknowledged every record in `acks`.

        Raises `StepStreamUnavailable` naming the servers and the timeout when it does not, or
        `SchemaRegistryError` when the records wait for a schema id the registry did not give.
        """
        acks = list(acks)
        caller = None
        if asyncio.get_running_loop() is self._loop:
            if self._accumulator.queued:
                self._accumulator.hand_over_soon()
        elif self._loop is not None:  # refused when the log's loop no longer runs
            caller = self._crossing.wait_from_here(acks)
        try:  # free unless it raises (Python 3.11): a durability point pays nothing for the count
            try:
                await await_acks(self.settings.kafka, acks, timeout)
            except StepStreamUnavailable as missing:
                if self._framing.failure is not None:  # the records wait for their schema id, not the broker
                    raise SchemaRegistryError(str(self._framing.failure)) from missing
                if self._crossing.untaken and (loop := self._elsewhere()) is not None:
                    if not loop.is_running():  # it stopped while the records were on their way
                        raise loop_gone(loop) from missing
                    waited = self.settings.kafka.ack_timeout_s if timeout is None else timeout
                    raise loop_blocked(waited) from missing  # its loop never took them
                raise
            for ack in acks:
                exc = ack.exception()
                if isinstance(exc, AUTHORIZATION_ERRORS):
                    raise self._sender.no_write(exc) from exc
                if isinstance(exc, StepStreamError):  # the log closed before the record reached it
                    raise exc
                if exc is not None:
                    raise unavailable(self.settings.kafka, 'rejected a record', exc) from exc
        except StepStreamError as error:  # counted once, by what the caller gets (not a cancellation)
            failed(error)
            raise
        finally:
            if caller is not None:
                caller.waiting -= 1

    async def flush(self, *, timeout: float | None = None) -> Position:
        """Wait until the broker took every record appended so far, then return the position written.

        A record the broker did not take at first is being sent again: it is waited for too.
        Pass the result to `Projector.wait_for` to read your own writes. `timeout` defaults to
        `settings.kafka.ack_timeout_s`; after a broker outage, give the producer longer to reconnect.
        Raises `StepStreamUnavailable` when the records are not all taken in time.
        """
        limit = self.settings.kafka.ack_timeout_s if timeout is None else timeout
        if (loop := self._elsewhere()) is not None:
            return await run_on(loop, self.flush(timeout=timeout), 2 * limit)
        self._crossing.take_posted()  # records other loops appended, not queued yet
        try:
            async with asyncio.timeout(limit):
                await self._accumulator.hand_over(settled=True)
                await self._sender.settled()
        except TimeoutError:
            error = self._sender.untaken(timeout)
            failed(error)
            raise error from None
        if self._sender.denied is not None:
            failed(self._sender.denied)
            raise self._sender.denied
        return dict(self._sender.written)

    @property
    def position(self) -> Position:
        """The acknowledged position so far, without waiting."""
        return dict(self._sender.written)
