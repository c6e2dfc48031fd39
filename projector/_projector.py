"""`Projector`: consumes both log topics and applies each batch to RocksDB atomically."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Self

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from aiokafka.structs import TopicPartition

from stepstream.errors import ProjectionMismatch, StepStreamError
from stepstream.media import MediaStore, S3MediaStore
from stepstream.projector._apply import (
    EFFECTS,
    EVENTS,
    Applier,
    BatchOutcome,
    DeadLetter,
    SourceRecord,
    micros,
)
from stepstream.projector._keys import PROGRESS
from stepstream.projector._reader import ProjectionReader
from stepstream.projector._state import Identity, dumps
from stepstream.projector._store import open_db, read_identity, stored_offsets, write_identity
from stepstream.settings import Settings
from stepstream.topics import Position, TopicLayout, ensure_topics, unavailable

DLQ_INLINE_BYTES = 512 * 1024
"""A dead letter whose key and value exceed this goes to the DLQ as an envelope (see `dlq_envelope`)."""

DLQ_HEAD_BYTES = 1024
"""How much of an oversized record's value an envelope keeps."""

log = logging.getLogger('stepstream.projector')


class Projector:
    """Materializes the log into a RocksDB projection, exactly once per record.

    ```python
    async with Projector(settings, db_path='proj') as projector:
        await projector.wait_for(await event_log.flush())
        run = await projector.reader().get_run('librarian-1a2b3c4d')
    ```

    Each batch from `getmany` is applied in one `WriteBatch` together with the next offset of
    every partition in it; on start the consumer seeks to those stored offsets, so a crash at
    any instant neither loses nor repeats a record. The group offsets committed to Kafka are
    only there for standard lag tooling; the stored offsets are the truth.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        db_path: str | Path | None = None,
        group_id: str | None = None,
        create_topics: bool = True,
        max_batch_records: int = 5000,
        poll_timeout_ms: int = 100,
        max_snapshots_per_run: int | None = None,
        commit_group_offsets: bool = True,
        media_store: MediaStore | None = None,
        send_dead_letters: bool = True,
        rebuilding: bool = False,
    ) -> None:
        """Open (or create) the projection; nothing connects until `start()` (or `async with`).

        `max_snapshots_per_run` keeps the newest N snapshots of each run readable, plus the
        newest complete and the newest overall; it is part of what the projection is, so an
        existing projection keeps the value it was built with (None: take it from there) and a
        different one is refused. `commit_group_offsets=False` and `send_dead_letters=False` are
        for rebuilds, which neither show up in lag tooling nor repeat the DLQ; `rebuilding` marks
        the projection incomplete until `mark_rebuilt()`.
        """
        if max_snapshots_per_run is not None and max_snapshots_per_run < 1:
            raise ValueError(f'max_snapshots_per_run must be at least 1, got {max_snapshots_per_run}')
        self.settings = settings
        self.db_path = Path(db_path if db_path is not None else settings.db_path)
        self.group_id = group_id or f'{settings.topic_prefix}.projector'
        self.create_topics = create_topics
        self.max_batch_records = max_batch_records
        self.poll_timeout_ms = poll_timeout_ms
        self.max_snapshots_per_run = max_snapshots_per_run
        self.commit_group_offsets = commit_group_offsets
        self.send_dead_letters = send_dead_letters
        self.rebuilding = rebuilding
        self.media_store: MediaStore = media_store or S3MediaStore.from_settings(settings)
        self._recent: deque[tuple[float, int]] = deque()
        self._uncommitted: Position = {}
        self._last_group_commit = 0.0
        self._db = open_db(self.db_path)
        self._topics = (settings.step_events_topic, settings.tool_effects_topic)
        self._topic_index = {settings.step_events_topic: EVENTS, settings.tool_effects_topic: EFFECTS}
        self._applier: Applier | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._dlq: AIOKafkaProducer | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failure: BaseException | None = None
        self._progress = asyncio.Condition()
        self._applied: Position = stored_offsets(self._db)
        self.identity: Identity | None = read_identity(self._db)
        self.records_applied = 0
        self.duplicates_ignored = 0
        self.dead_lettered = 0

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Check the projection is of these topics, seek to its offsets and consume in the background."""
        layout = await ensure_topics(self.settings, create=self.create_topics)
        self._claim_identity(layout)
        self._applier = Applier(
            self._topics, partitions=layout.partitions, max_snapshots_per_run=self.max_snapshots_per_run
        )
        partitions = [TopicPartition(t, p) for t in self._topics for p in range(layout.partitions)]
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.settings.bootstrap_servers,
            group_id=self.group_id,
            client_id='stepstream-projector',
            enable_auto_commit=False,
            auto_offset_reset='earliest',
            fetch_max_wait_ms=50,
            request_timeout_ms=max(5000, int(self.settings.ack_timeout_s * 1000)),
        )
        dlq = AIOKafkaProducer(
            bootstrap_servers=self.settings.bootstrap_servers,
            acks='all',
            client_id='stepstream-projector-dlq',
        )
        try:
            await asyncio.wait_for(consumer.start(), self.settings.ack_timeout_s)
            await asyncio.wait_for(dlq.start(), self.settings.ack_timeout_s)
        except (KafkaError, OSError, TimeoutError) as exc:
            await consumer.stop()
            await dlq.stop()
            raise unavailable(self.settings, 'did not accept the projector', exc) from exc
        # Every projector owns a whole projection, so it reads every partition itself.
        consumer.assign(partitions)
        for tp in partitions:
            offset = self._applied.get(tp)
            if offset is None:
                await consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, offset)
        self._consumer, self._dlq = consumer, dlq
        self._stopping = False
        self._task = asyncio.create_task(self._consume(), name='stepstream-projector')

    def _claim_identity(self, layout: TopicLayout) -> None:
        """Record what this projection is built from, or refuse when it was built from something else."""
        stored = self.identity
        where = self.db_path
        if stored is None:
            if self._applied or next(iter(self._db.keys()), None) is not None:
                raise ProjectionMismatch(
                    f'{where} holds a projection made by an older stepstream (no identity record); '
                    f'rebuild it with `stepstream rebuild --into NEW_DIR`'
                )
            stored = Identity(
                format=Identity.FORMAT,
                topic_prefix=self.settings.topic_prefix,
                cluster=layout.cluster,
                max_snapshots_per_run=self.max_snapshots_per_run,
                state='rebuilding' if self.rebuilding else 'live',
            )
            write_identity(self._db, stored)
            self.identity = stored
            return
        if stored.format != Identity.FORMAT:
            raise ProjectionMismatch(
                f'{where} is a projection of format {stored.format}; this stepstream reads format '
                f'{Identity.FORMAT}. Rebuild it with `stepstream rebuild --into NEW_DIR`'
            )
        if stored.topic_prefix != self.settings.topic_prefix:
            raise ProjectionMismatch(
                f'{where} was built from the topics {stored.topic_prefix}.*, '
                f'not {self.settings.topic_prefix}.*: set STEPSTREAM_TOPIC_PREFIX (--topic-prefix) '
                'to match, or use another --db-path'
            )
        if stored.cluster != layout.cluster:
            raise ProjectionMismatch(
                f'{where} was built from Kafka cluster {stored.cluster!r}, '
                f'but {self.settings.bootstrap_servers} is cluster {layout.cluster!r}: point '
                'STEPSTREAM_BOOTSTRAP_SERVERS at the cluster it was built from, or use another --db-path'
            )
        wanted = self.max_snapshots_per_run
        if wanted is not None and wanted != stored.max_snapshots_per_run:
            raise ProjectionMismatch(
                f'{where} was built with max_snapshots_per_run={stored.max_snapshots_per_run}, not {wanted}: '
                'leave the option out (it is kept), or rebuild into a new directory with the new value'
            )
        self.max_snapshots_per_run = stored.max_snapshots_per_run
        if stored.state == 'rebuilding' and not self.rebuilding:
            stored.state = 'live'  # a live projector carries an interrupted rebuild on to the end
            write_identity(self._db, stored)

    def mark_rebuilt(self) -> None:
        """Record that a rebuild reached the end it was after: the projection is complete."""
        if self.identity is not None:
            self.identity.state = 'rebuilt'
            write_identity(self._db, self.identity)

    async def stop(self) -> None:
        """Finish the batch in hand, then disconnect and close the projection."""
        self._stopping = True
        if self._task is not None:
            with contextlib.suppress(Exception):  # kept in self._failure, raised by __aexit__
                await self._task
            self._task = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        if self._dlq is not None:
            await self._dlq.stop()
            self._dlq = None
        self._db.flush()

    def close(self) -> None:
        """Close the RocksDB handle (after `stop()`)."""
        self._db.close()

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            self.close()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
        self.close()
        if self._failure is not None and exc is None:
            raise StepStreamError(f'the projector stopped on an error: {self._failure!r}') from self._failure

    async def join(self) -> None:
        """Wait until the background loop ends: after `stop()`, or on an error, which is raised."""
        if self._task is not None:
            await asyncio.shield(self._task)

    # -- reading your writes ---------------------------------------------------------------------

    def reader(self) -> ProjectionReader:
        """A reader over this projector's RocksDB (same process, always current)."""
        return ProjectionReader(self._db, media_store=self.media_store)

    @property
    def applied(self) -> Position:
        """For each partition, the offset just past the last applied record."""
        return dict(self._applied)

    async def wait_for(self, position: Position, timeout: float = 30.0) -> None:
        """Return once every record up to `position` (from `EventLog.flush()`) is applied."""
        deadline = time.monotonic() + timeout
        async with self._progress:
            while not self._reached(position):
                if self._failure is not None:
                    raise StepStreamError(f'the projector stopped on an error: {self._failure!r}')
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    behind = {
                        f'{tp.topic}[{tp.partition}]': (self._applied.get(tp, 0), off)
                        for tp, off in position.items()
                        if self._applied.get(tp, 0) < off
                    }
                    raise TimeoutError(
                        f'projection did not reach the position within {timeout:g}s: '
                        f'(applied, wanted) {behind}'
                    )
                try:
                    await asyncio.wait_for(self._progress.wait(), remaining)
                except TimeoutError:
                    continue

    async def end_position(self) -> Position:
        """The end of every log partition right now (what `catch_up` waits for)."""
        if self._consumer is None:
            raise StepStreamError('the projector is not started')
        ends = await self._consumer.end_offsets(list(self._consumer.assignment()))
        # Some brokers (Tansu) can report an end short of the last batch's records; the high
        # watermark seen on fetches is the larger, and right, figure then.
        position = {tp: max(offset, self._consumer.highwater(tp) or 0) for tp, offset in ends.items()}
        return {tp: offset for tp, offset in position.items() if offset > 0}

    async def catch_up(self, timeout: float = 60.0) -> Position:
        """Wait until everything in the log when called is applied; returns that position."""
        position = await self.end_position()
        await self.wait_for(position, timeout=timeout)
        return position

    def _reached(self, position: Position) -> bool:
        return all(self._applied.get(tp, 0) >= offset for tp, offset in position.items())

    # -- the loop --------------------------------------------------------------------------------

    async def _consume(self) -> None:
        assert self._consumer is not None
        try:
            while not self._stopping:
                batches = await self._consumer.getmany(
                    timeout_ms=self.poll_timeout_ms, max_records=self.max_batch_records
                )
                if batches:
                    await self._apply_batch(batches)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception('projector stopped')
            self._failure = exc
            async with self._progress:
                self._progress.notify_all()
            raise

    async def _apply_batch(self, batches: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> None:
        assert self._applier is not None
        applier = self._applier
        records = [
            SourceRecord(self._topic_index[tp.topic], tp.partition, m.offset, m.key, m.value)
            for tp, messages in batches.items()
            for m in messages
        ]
        send = self.send_dead_letters

        def stage_and_commit() -> tuple[Callable[[], int], BatchOutcome]:
            txn, outcome = applier.stage(self._db, records)
            txn.put(PROGRESS, dumps(self._progress_figures(len(records))))
            if not (outcome.dead and send):  # the common case: one hop to the worker thread, not two
                txn.commit()
            return txn.commit, outcome

        commit, outcome = await asyncio.to_thread(stage_and_commit)
        # Dead letters are acknowledged by the DLQ before the batch (and its offsets) commits:
        # a crash in between repeats them in the DLQ on restart, and never loses one.
        if outcome.dead and send:
            if not await self._dead_letter(outcome.dead):
                return  # stopping while the DLQ was unreachable: the batch is applied on restart
            await asyncio.to_thread(commit)
        self.records_applied += outcome.applied
        self.duplicates_ignored += outcome.duplicates
        self.dead_lettered += len(outcome.dead)
        next_offsets = {
            TopicPartition(self._topics[topic], partition): offset
            for (topic, partition), offset in outcome.next_offsets.items()
        }
        async with self._progress:
            self._applied.update(next_offsets)
            self._progress.notify_all()
        await self._commit_group_offsets(next_offsets)

    def _progress_figures(self, consumed: int) -> dict[str, float | int]:
        """Records per second over the last ten seconds, for `stepstream status`."""
        now = time.monotonic()
        self._recent.append((now, consumed))
        while self._recent and self._recent[0][0] < now - 10:
            self._recent.popleft()
        span = max(now - self._recent[0][0], 1.0)
        return {'rate': round(sum(n for _, n in self._recent) / span, 1), 'at': micros(datetime.now(UTC))}

    async def _dead_letter(self, dead: list[DeadLetter]) -> bool:
        """Send dead letters until the DLQ acknowledges them all; False if stopped meanwhile.

        The DLQ being unreachable is no reason to stop projecting for good: the batch waits,
        and the sends are retried with backoff.
        """
        delay = 0.2
        while True:
            try:
                await self._send_dead_letters(dead)
                return True
            except (KafkaError, TimeoutError, OSError) as exc:
                if self._stopping:
                    return False
                log.warning('the DLQ did not take %d record(s), retrying in %.1fs: %r', len(dead), delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _send_dead_letters(self, dead: list[DeadLetter]) -> None:
        assert self._dlq is not None
        acks = []
        for letter in dead:
            source = letter.source
            headers = [
                ('stepstream-dlq-reason', letter.reason.encode()),
                ('stepstream-dlq-detail', letter.detail.encode(errors='replace')[:4096]),
                ('stepstream-source-topic', self._topics[source.topic].encode()),
                ('stepstream-source-partition', str(source.partition).encode()),
                ('stepstream-source-offset', str(source.offset).encode()),
            ]
            key, value = source.key, source.value
            if len(key or b'') + len(value or b'') > DLQ_INLINE_BYTES:
                key, value = None, dlq_envelope(letter, self._topics[source.topic])
                headers.append(('stepstream-dlq-envelope', b'1'))
            try:
                ack = await self._dlq.send(self.settings.dlq_topic, value, key=key, headers=headers)
            except MessageSizeTooLargeError:  # the DLQ's own limit is below ours: send the envelope
                envelope = dlq_envelope(letter, self._topics[source.topic])
                headers.append(('stepstream-dlq-envelope', b'1'))
                ack = await self._dlq.send(self.settings.dlq_topic, envelope, headers=headers)
            acks.append(ack)
        try:
            await asyncio.wait_for(asyncio.gather(*acks), self.settings.ack_timeout_s)
        except (KafkaError, TimeoutError) as exc:
            raise unavailable(self.settings, 'did not acknowledge dead-lettered records', exc) from exc

    async def _commit_group_offsets(self, offsets: Position) -> None:
        """Commit to the consumer group at most once a second: it only feeds lag tooling."""
        assert self._consumer is not None
        self._uncommitted.update(offsets)
        now = time.monotonic()
        if not self.commit_group_offsets or now - self._last_group_commit < 1.0:
            return
        self._last_group_commit = now
        offsets, self._uncommitted = self._uncommitted, {}
        try:
            await self._consumer.commit(offsets)
        except KafkaError as exc:  # lag tooling only; the stored offsets are what counts
            log.debug('group offset commit failed: %r', exc)


def dlq_envelope(letter: DeadLetter, topic: str) -> bytes:
    """What goes to the DLQ in place of a record too large for it: JSON, a few KiB at most.

    `{"reason", "detail", "topic", "partition", "offset", "key_sha256", "value_sha256",
    "value_bytes", "value_head"}`, the head being the first `DLQ_HEAD_BYTES` of the value in
    base64. The record itself stays in the source topic at those coordinates.
    """
    source = letter.source
    value = source.value or b''
    return dumps(
        {
            'reason': letter.reason,
            'detail': letter.detail[:2000],
            'topic': topic,
            'partition': source.partition,
            'offset': source.offset,
            'key_sha256': hashlib.sha256(source.key).hexdigest() if source.key is not None else None,
            'value_sha256': hashlib.sha256(value).hexdigest(),
            'value_bytes': len(value),
            'value_head': base64.b64encode(value[:DLQ_HEAD_BYTES]).decode(),
        }
    )
