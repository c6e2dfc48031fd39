"""`Projector`: consumes both log topics and applies each batch to RocksDB atomically."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Self

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from stepstream.errors import SchemaError, StepStreamError
from stepstream.media import MediaStore, S3MediaStore
from stepstream.projector._apply import apply_record, micros, validate
from stepstream.projector._reader import ProjectionReader
from stepstream.projector._store import BatchTxn, key, open_db, scan
from stepstream.schemas import decode
from stepstream.settings import Settings
from stepstream.topics import Position, ensure_topics, unavailable

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
    ) -> None:
        """Configure; nothing connects until `start()` (or `async with`).

        `max_snapshots_per_run` keeps the newest N snapshots of each run readable, plus the
        newest complete and the newest overall. `commit_group_offsets=False` is for throwaway
        consumers such as `rebuild`, which should not show up in lag tooling.
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
        self.media_store: MediaStore = media_store or S3MediaStore.from_settings(settings)
        self._recent: deque[tuple[float, int]] = deque()
        self._uncommitted: Position = {}
        self._last_group_commit = 0.0
        self._db = open_db(self.db_path)
        self._consumer: AIOKafkaConsumer | None = None
        self._dlq: AIOKafkaProducer | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failure: BaseException | None = None
        self._progress = asyncio.Condition()
        self._applied: Position = self._stored_offsets()
        self.records_applied = 0
        self.duplicates_ignored = 0
        self.dead_lettered = 0

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, seek every partition to its stored offset, and consume in the background."""
        layout = await ensure_topics(self.settings, create=self.create_topics)
        topics = [self.settings.step_events_topic, self.settings.tool_effects_topic]
        partitions = [TopicPartition(t, p) for t in topics for p in range(layout.partitions)]
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
        await self.start()
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
        rejected: list[tuple[ConsumerRecord[bytes, bytes], str]] = []

        def stage_and_commit() -> tuple[BatchTxn, int, int, Position]:
            staged = self._stage_batch(batches, rejected)
            if not rejected:  # the common case: one hop to the worker thread, not two
                staged[0].commit()
            return staged

        txn, applied, duplicates, next_offsets = await asyncio.to_thread(stage_and_commit)
        # Poison records are acknowledged by the DLQ before the batch (and its offsets) commits:
        # a crash in between repeats them in the DLQ on restart, and never loses one.
        if rejected:
            await self._dead_letter(rejected)
            await asyncio.to_thread(txn.commit)
        self.records_applied += applied
        self.duplicates_ignored += duplicates
        self.dead_lettered += len(rejected)
        async with self._progress:
            self._applied.update(next_offsets)
            self._progress.notify_all()
        await self._commit_group_offsets(next_offsets)

    def _stage_batch(
        self,
        batches: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]],
        rejected: list[tuple[ConsumerRecord[bytes, bytes], str]],
    ) -> tuple[BatchTxn, int, int, Position]:
        txn = BatchTxn(self._db)
        applied = duplicates = 0
        next_offsets: Position = {}
        for tp, records in batches.items():
            for message in records:
                reason = None
                if message.value is None:
                    reason = 'empty value (tombstone) on a log topic'
                else:
                    try:
                        record = decode(message.value)
                        validate(record, message.key)
                    except SchemaError as exc:
                        reason = str(exc)
                if reason is not None:
                    rejected.append((message, reason))
                    continue
                assert message.value is not None
                if apply_record(txn, record, message.value, max_snapshots=self.max_snapshots_per_run):
                    applied += 1
                else:
                    duplicates += 1
            if records:
                next_offsets[tp] = records[-1].offset + 1
                txn.put(key(b'o', tp.topic, tp.partition), str(next_offsets[tp]).encode())
        if rejected:
            counters = txn.get_json(key(b'm', 'dlq')) or {'count': 0}
            counters['count'] += len(rejected)
            txn.put_json(key(b'm', 'dlq'), counters)
        txn.put_json(key(b'm', 'progress'), self._progress_figures(applied + duplicates + len(rejected)))
        return txn, applied, duplicates, next_offsets

    def _progress_figures(self, consumed: int) -> dict[str, float | int]:
        """Records per second over the last ten seconds, for `stepstream status`."""
        now = time.monotonic()
        self._recent.append((now, consumed))
        while self._recent and self._recent[0][0] < now - 10:
            self._recent.popleft()
        span = max(now - self._recent[0][0], 1.0)
        return {'rate': round(sum(n for _, n in self._recent) / span, 1), 'at': micros(datetime.now(UTC))}

    async def _dead_letter(self, rejected: Iterable[tuple[ConsumerRecord[bytes, bytes], str]]) -> None:
        assert self._dlq is not None
        acks = []
        for message, reason in rejected:
            headers = [
                ('stepstream-dlq-reason', reason.encode()[:4096]),
                ('stepstream-source-topic', message.topic.encode()),
                ('stepstream-source-partition', str(message.partition).encode()),
                ('stepstream-source-offset', str(message.offset).encode()),
            ]
            acks.append(
                await self._dlq.send(self.settings.dlq_topic, message.value, key=message.key, headers=headers)
            )
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

    def _stored_offsets(self) -> Position:
        stored: Position = {}
        for k, v in scan(self._db, b'o\x00'):
            _, topic, partition = k.split(b'\x00')
            stored[TopicPartition(topic.decode(), int(partition))] = int(v)
        return stored
