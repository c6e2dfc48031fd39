"""`Projector`: consumes both log topics and applies each batch to RocksDB atomically."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Self

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, ConsumerRecord
from aiokafka.errors import GroupAuthorizationFailedError, KafkaError, MessageSizeTooLargeError
from aiokafka.structs import TopicPartition
from opentelemetry.trace import Span
from rocksdict import Rdict

from stepstream.errors import ProjectionInUse, ProjectionMismatch, StepStreamError, UsageError
from stepstream.kafka_client import AUTHORIZATION_ERRORS, access_denied, client_options, connection_error
from stepstream.media import MediaStore, S3MediaStore
from stepstream.projector._apply import (
    EFFECTS,
    EVENTS,
    Applier,
    BatchOutcome,
    DeadLetter,
    SourceRecord,
)
from stepstream.projector._checkpoints import Checkpoints
from stepstream.projector._keys import PROGRESS
from stepstream.projector._membership import Membership, membership_assignor
from stepstream.projector._reader import ProjectionReader
from stepstream.projector._state import Identity, dumps
from stepstream.projector._store import (
    BatchTxn,
    check_projection,
    create_shard,
    open_db,
    read_identity,
    read_projection_identity,
    shard_path,
    shard_paths,
    stored_offsets,
    write_identity,
)
from stepstream.projector._wire import WireFormats
from stepstream.settings import Settings
from stepstream.telemetry import lag, records_applied, records_dead_lettered, span
from stepstream.timestamps import micros
from stepstream.topics import Position, TopicLayout, ensure_topics, unavailable

DLQ_INLINE_BYTES = 512 * 1024
"""A dead letter whose key and value exceed this goes to the DLQ as an envelope (see `dlq_envelope`)."""

DLQ_HEAD_BYTES = 1024
"""How much of an oversized record's value an envelope keeps."""

log = logging.getLogger('stepstream.projector')


SHARD_HANDOFF_TIMEOUT_S = 30.0
"""How long a member waits for a shard's previous owner (same directory) to close it."""


@dataclass(eq=False)
class _Shard:
    """One open shard: its partition number, its RocksDB and its recent apply rate."""

    partition: int
    db: Rdict
    recent: deque[tuple[float, int]] = field(default_factory=deque)

    def progress_figures(self, consumed: int) -> dict[str, float | int]:
        """Records per second over the last ten seconds, for `stepstream status`."""
        now = time.monotonic()
        self.recent.append((now, consumed))
        while self.recent and self.recent[0][0] < now - 10:
            self.recent.popleft()
        span = max(now - self.recent[0][0], 1.0)
        return {'rate': round(sum(n for _, n in self.recent) / span, 1), 'at': micros(datetime.now(UTC))}


class _Rebalance(ConsumerRebalanceListener):
    """Hands a member's assignment changes to its projector."""

    def __init__(self, projector: Projector) -> None:
        self.projector = projector

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Close the shards moving away (after the batch in hand)."""
        await self.projector._revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Open, restore or create the shards of the new assignment."""
        await self.projector._assigned(assigned)


class Projector:
    """Materializes the log into a sharded RocksDB projection, exactly once per record.

    ```python
    async with Projector(settings, db_path='proj') as projector:
        await projector.wait_for(await event_log.flush())
        run = await projector.reader().get_run('librarian-1a2b3c4d')
    ```

    The projection is one shard per partition number (decision 0016). Each batch from
    `getmany` is split by partition and applied to each shard in one `WriteBatch` together with
    that partition's next offsets; on start (or on assignment) the consumer seeks to those stored
    offsets, so a crash at any instant neither loses nor repeats a record.

    Without `group`, one projector owns every partition (or the `partitions` given, as a
    parallel rebuild's workers do) and commits offsets to a consumer group only for standard
    lag tooling. With `group`, it joins that consumer group as a member: it opens the shards
    of the partitions the group assigns it, closes them when they are revoked, and several
    members (on one host sharing `db_path`, or on several hosts) split the work.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        db_path: str | Path | None = None,
        group_id: str | None = None,
        group: str | None = None,
        partitions: Collection[int] | None = None,
        create_topics: bool = True,
        max_batch_records: int = 5000,
        poll_timeout_ms: int = 100,
        max_snapshots_per_run: int | None = None,
        commit_group_offsets: bool = True,
        media_store: MediaStore | None = None,
        send_dead_letters: bool = True,
        rebuilding: bool = False,
        checkpoints: Checkpoints | None = None,
        session_timeout_ms: int = 10_000,
        on_assignment: Callable[[list[int]], None] | None = None,
        membership: Membership | None = None,
    ) -> None:
        """Check the projection directory; nothing connects until `start()` (or `async with`).

        `max_snapshots_per_run` keeps the newest N snapshots of each run readable, plus the
        newest complete and the newest overall; it is part of what the projection is, so an
        existing projection keeps the value it was built with (None: take it from there) and a
        different one is refused. `commit_group_offsets=False` and `send_dead_letters=False` are
        for rebuilds, which neither show up in lag tooling nor repeat the DLQ; `rebuilding` marks
        the projection incomplete until `mark_rebuilt()`. `group` makes this projector a member
        of that consumer group; `checkpoints` uploads its shards to S3 and restores shards it is
        assigned but does not hold; `session_timeout_ms` is how long the group waits for a
        silent member before its partitions move; `on_assignment` is called with the partitions
        a member holds after every change. A member tells the group `membership.endpoint` (the
        URL its service answers on) and learns there who owns each partition (`_membership`).
        """
        if max_snapshots_per_run is not None and max_snapshots_per_run < 1:
            raise ValueError(f'max_snapshots_per_run must be at least 1, got {max_snapshots_per_run}')
        if group is not None and partitions is not None:
            raise UsageError('a group member owns the partitions its group assigns; give group or partitions')
        self.settings = settings
        self.db_path = check_projection(db_path if db_path is not None else settings.db_path, create=True)
        self.group = group
        self.group_id = group or group_id or f'{settings.topic_prefix}.projector'
        self.only = frozenset(partitions) if partitions is not None else None
        self.create_topics = create_topics
        self.max_batch_records = max_batch_records
        self.poll_timeout_ms = poll_timeout_ms
        self.max_snapshots_per_run = max_snapshots_per_run
        self.commit_group_offsets = commit_group_offsets
        self.send_dead_letters = send_dead_letters
        self.rebuilding = rebuilding
        self.checkpoints = checkpoints
        self.session_timeout_ms = session_timeout_ms
        self.on_assignment = on_assignment
        self.membership = membership if membership is not None else Membership()
        self.media_store: MediaStore = media_store or S3MediaStore.from_settings(settings)
        self._uncommitted: Position = {}
        self._last_group_commit = 0.0
        self._topics = (settings.step_events_topic, settings.tool_effects_topic)
        self._topic_index = {settings.step_events_topic: EVENTS, settings.tool_effects_topic: EFFECTS}
        self._applier: Applier | None = None
        self._wire: WireFormats | None = None
        self._layout: TopicLayout | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._dlq: AIOKafkaProducer | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failure: BaseException | None = None
        self._progress = asyncio.Condition()
        self._batch_lock = asyncio.Lock()
        self._assignments = 0
        """Counts assignment changes, so a batch fetched across one is recognised and dropped."""
        self._shards: dict[int, _Shard] = {}
        self._dbs: dict[int, Rdict] = {}
        """The open shards' databases, shared (and kept current) with `reader()`."""
        self._applied: Position = {}
        self.identity: Identity | None = None
        self.records_applied = 0
        self.duplicates_ignored = 0
        self.dead_lettered = 0
        self.restored_from_checkpoint: dict[int, int] = {}
        """Partition -> records the shard's restored checkpoint held, for shards restored so far."""
        if group is None:
            # Open the shards that exist now, so a second writer is refused before connecting.
            try:
                for partition, path in shard_paths(self.db_path).items():
                    if self.only is None or partition in self.only:
                        self._adopt(partition, open_db(path, create=False))
            except BaseException:
                self.close()
                raise

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Check the projection is of these topics, seek to its offsets and consume in the background."""
        layout = await ensure_topics(self.settings, create=self.create_topics)
        self._layout = layout
        for shard in list(self._shards.values()):
            self._claim_identity(shard, layout)
        self._applier = Applier(
            self._topics, partitions=layout.partitions, max_snapshots_per_run=self.max_snapshots_per_run
        )
        self._wire = WireFormats(self.settings)
        consumer = AIOKafkaConsumer(
            **client_options(self.settings),
            group_id=self.group_id,
            client_id='stepstream-projector',
            enable_auto_commit=False,
            auto_offset_reset='earliest',
            fetch_max_wait_ms=50,
            request_timeout_ms=max(5000, int(self.settings.ack_timeout_s * 1000)),
            # Range assignment gives a member the same partition numbers of both topics, which
            # are co-partitioned by run_id: one member owns every record of a shard. Ours also
            # shares the members' endpoints. One assignor only: aiokafka (through 0.14) sends a
            # JoinGroup per configured assignor, and the second one starts another rebalance,
            # so members joining together can rebalance for minutes (decision 0016).
            partition_assignment_strategy=(membership_assignor(self.membership),),
            session_timeout_ms=self.session_timeout_ms,
            heartbeat_interval_ms=max(100, self.session_timeout_ms // 3),
        )
        dlq = AIOKafkaProducer(
            **client_options(self.settings),
            acks='all',
            client_id='stepstream-projector-dlq',
        )
        try:
            await asyncio.wait_for(consumer.start(), self.settings.ack_timeout_s)
            await asyncio.wait_for(dlq.start(), self.settings.ack_timeout_s)
        except (KafkaError, OSError, TimeoutError) as exc:
            await consumer.stop()
            await dlq.stop()
            raise await connection_error(self.settings, 'did not accept the projector', exc) from exc
        self._consumer, self._dlq = consumer, dlq
        if self.group is None:
            mine = [p for p in range(layout.partitions) if self.only is None or p in self.only]
            for partition in mine:
                if partition not in self._shards:
                    await self._open_shard(partition)
            assigned = {TopicPartition(t, p) for t in self._topics for p in mine}
            consumer.assign(sorted(assigned))
            try:
                # Asks the group coordinator once, so a missing group ACL fails here at once (a
                # seek would wait out the request timeout first).
                if assigned:
                    await consumer.committed(min(assigned))
                await self._seek(assigned)
            except AUTHORIZATION_ERRORS as exc:
                self._consumer = self._dlq = None
                await consumer.stop()
                await dlq.stop()
                raise self._may_not_read(exc) from exc
        else:
            consumer.subscribe(list(self._topics), listener=_Rebalance(self))
        self._stopping = False
        self._task = asyncio.create_task(self._consume(), name='stepstream-projector')

    def _may_not_read(self, exc: BaseException) -> StepStreamError:
        """The error for a principal without the projector's READ rights (on its group or topics)."""
        if isinstance(exc, GroupAuthorizationFailedError):
            what, grant = f'use the consumer group {self.group_id}', f'READ on group {self.group_id}'
        else:
            topics = ' and '.join(self._topics)
            what, grant = f'read {topics}', f'READ on {topics}'
        fix = f'grant it {grant} (the projector ACL), or use the projector principal'
        return access_denied(self.settings, what, exc, fix=fix)

    async def _open_shard(self, partition: int) -> _Shard:
        """Open the shard of `partition` here, restoring it from a checkpoint or making it new."""
        assert self._layout is not None
        path = shard_path(self.db_path, partition)
        if not (path / 'CURRENT').exists() and self.checkpoints is not None:
            restored = await self.checkpoints.restore(self.db_path, partition, self._layout.partitions)
            if restored is not None:
                self.restored_from_checkpoint[partition] = restored
        if (path / 'CURRENT').exists():
            db = await self._open_when_free(path)
            shard = self._adopt(partition, db)
            self._claim_identity(shard, self._layout)
            return shard
        identity = Identity(
            format=Identity.FORMAT,
            topic_prefix=self.settings.topic_prefix,
            cluster=self._layout.cluster,
            max_snapshots_per_run=self._options_from_shards(),
            state='rebuilding' if self.rebuilding else 'live',
            partitions=self._layout.partitions,
            partition=partition,
        )
        shard = self._adopt(
            partition, await asyncio.to_thread(create_shard, self.db_path, partition, identity)
        )
        if self.identity is None:
            self.identity = identity
        return shard

    async def _open_when_free(self, path: Path) -> Rdict:
        """Open a shard for writing; in a group, wait a while for its previous owner to let go."""
        deadline = time.monotonic() + (SHARD_HANDOFF_TIMEOUT_S if self.group is not None else 0)
        while True:
            try:
                return await asyncio.to_thread(open_db, path, create=False)
            except ProjectionInUse:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)

    def _options_from_shards(self) -> int | None:
        """`max_snapshots_per_run` for a new shard: the one asked for, or the existing shards'."""
        if self.max_snapshots_per_run is None:
            existing = read_projection_identity(self.db_path)
            if existing is not None:
                self.max_snapshots_per_run = existing.max_snapshots_per_run
        return self.max_snapshots_per_run

    def _adopt(self, partition: int, db: Rdict) -> _Shard:
        shard = _Shard(partition, db)
        self._shards[partition] = shard
        self._dbs[partition] = db
        self._applied.update(stored_offsets(db))
        if self.identity is None:
            self.identity = read_identity(db)
        return shard

    async def _seek(self, assigned: Collection[TopicPartition]) -> None:
        assert self._consumer is not None
        for tp in assigned:
            offset = self._applied.get(tp)
            if offset is None:
                await self._consumer.seek_to_beginning(tp)
            else:
                self._consumer.seek(tp, offset)

    async def _assigned(self, assigned: set[TopicPartition]) -> None:
        """The group gave this member partitions: open (or restore) their shards and seek.

        A shard that cannot be opened stops the member (its partitions must not be consumed
        with nowhere to apply them): the error is raised by `join()` and `__aexit__`.
        """
        try:
            await self._take(assigned)
        except Exception as exc:
            log.error('member of %s cannot take its partitions: %s', self.group, exc)
            self._failure = exc
            self._stopping = True
            async with self._progress:
                self._progress.notify_all()

    async def _take(self, assigned: set[TopicPartition]) -> None:
        numbers = {tp.partition for tp in assigned}
        lopsided = sorted(
            p for p in numbers if any(TopicPartition(t, p) not in assigned for t in self._topics)
        )
        if lopsided:
            raise StepStreamError(
                f'the group {self.group!r} assigned partition(s) {lopsided} of one log topic '
                'without the other; '
                'every member must be a stepstream projector (range assignment keeps a shard together)'
            )
        async with self._batch_lock:
            self._assignments += 1
            for partition in sorted(numbers - self._shards.keys()):
                await self._open_shard(partition)
            await self._seek(assigned)
        log.info('member of %s: owns partitions %s', self.group, self.partitions)
        if self.on_assignment is not None:
            self.on_assignment(self.partitions)

    async def _revoked(self, revoked: set[TopicPartition]) -> None:
        """Partitions are moving away: finish the batch in hand, then flush and close their shards."""
        async with self._batch_lock:
            self._assignments += 1
            for partition in sorted({tp.partition for tp in revoked}):
                self._release(partition)
        if self.on_assignment is not None and revoked:
            self.on_assignment(self.partitions)

    def _release(self, partition: int) -> None:
        shard = self._shards.pop(partition, None)
        self._dbs.pop(partition, None)
        for topic in self._topics:
            self._applied.pop(TopicPartition(topic, partition), None)
        if shard is not None:
            shard.db.flush()
            shard.db.close()

    def _claim_identity(self, shard: _Shard, layout: TopicLayout) -> None:
        """Check a shard was built from these topics and options, or refuse it."""
        stored = read_identity(shard.db)
        where = shard_path(self.db_path, shard.partition)
        if stored is None or stored.format != Identity.FORMAT:
            found = 'no identity record' if stored is None else f'format {stored.format}'
            raise ProjectionMismatch(
                f'{where} holds a projection made by another stepstream version ({found}); this one reads '
                f'format {Identity.FORMAT}. Rebuild it with `stepstream rebuild --into NEW_DIR`'
            )
        if stored.topic_prefix != self.settings.topic_prefix:
            raise ProjectionMismatch(
                f'{self.db_path} was built from the topics {stored.topic_prefix}.*, '
                f'not {self.settings.topic_prefix}.*: set STEPSTREAM_TOPIC_PREFIX (--topic-prefix) '
                'to match, or use another --db-path'
            )
        if stored.cluster != layout.cluster:
            raise ProjectionMismatch(
                f'{self.db_path} was built from Kafka cluster {stored.cluster!r}, '
                f'but {self.settings.bootstrap_servers} is cluster {layout.cluster!r}: point '
                'STEPSTREAM_BOOTSTRAP_SERVERS at the cluster it was built from, or use another --db-path'
            )
        if stored.partitions != layout.partitions or stored.partition != shard.partition:
            raise ProjectionMismatch(
                f'{where} is shard {stored.partition} of {stored.partitions} partitions, but the topics '
                f'now have {layout.partitions}: runs moved between partitions, so rebuild the projection '
                'with `stepstream rebuild --into NEW_DIR`'
            )
        wanted = self.max_snapshots_per_run
        if wanted is not None and wanted != stored.max_snapshots_per_run:
            raise ProjectionMismatch(
                f'{self.db_path} was built with '
                f'max_snapshots_per_run={stored.max_snapshots_per_run}, not {wanted}: '
                'leave the option out (it is kept), or rebuild into a new directory with the new value'
            )
        self.max_snapshots_per_run = stored.max_snapshots_per_run
        if self._applier is not None:
            self._applier.max_snapshots = stored.max_snapshots_per_run
        if stored.state == 'rebuilding' and not self.rebuilding:
            stored.state = 'live'  # a live projector carries an interrupted rebuild on to the end
            write_identity(shard.db, stored)
        self.identity = stored

    def mark_rebuilt(self) -> None:
        """Record that a rebuild reached the end it was after: its shards are complete."""
        for shard in self._shards.values():
            identity = read_identity(shard.db)
            if identity is not None:
                identity.state = 'rebuilt'
                write_identity(shard.db, identity)
                self.identity = identity

    async def stop(self) -> None:
        """Finish the batch in hand, then disconnect and flush the shards."""
        self._stopping = True
        if self._task is not None:
            with contextlib.suppress(Exception):  # kept in self._failure, raised by __aexit__
                await self._task
            self._task = None
        if self._consumer is not None and self.commit_group_offsets and self._uncommitted:
            # The last second's offsets too, so lag tooling reads the position the projector left at.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._commit_uncommitted(), self.settings.ack_timeout_s)
        # A member's shards are revoked (and closed) as its consumer leaves the group. With the
        # broker gone, leaving cannot finish: give up after the ack timeout, since the shards'
        # offsets are stored with their state and `close()` closes them all the same.
        for client in (self._consumer, self._dlq):
            if client is None:
                continue
            stopping = _stop_consumer(client) if isinstance(client, AIOKafkaConsumer) else client.stop()
            try:
                await asyncio.wait_for(stopping, self.settings.ack_timeout_s)
            except TimeoutError:
                log.warning('the broker did not answer while the projector disconnected; stopping anyway')
        self._consumer = self._dlq = None
        wire, self._wire = self._wire, None
        if wire is not None:
            await wire.close()
        for shard in self._shards.values():
            shard.db.flush()

    def close(self) -> None:
        """Close the shards' RocksDB handles (after `stop()`)."""
        for partition in list(self._shards):
            self._release(partition)

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            if self._consumer is not None:
                await self._consumer.stop()
            if self._dlq is not None:
                await self._dlq.stop()
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
        """A reader over the shards this projector holds open (same process, always current).

        A group member holds only its own shards; `ProjectionReader.open(db_path)` reads every
        shard in the directory, whichever member writes it.
        """
        partitions = self._layout.partitions if self._layout is not None else max(self._dbs, default=-1) + 1
        return ProjectionReader(
            self._dbs,
            partitions=partitions,
            media_store=self.media_store,
            stale_after_s=self.settings.stale_after_s,
        )

    @property
    def partitions(self) -> list[int]:
        """The partition numbers whose shards this projector holds now."""
        return sorted(self._shards)

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
        """The end of every partition this projector owns right now (what `catch_up` waits for)."""
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
                assignments = self._assignments
                batches = await self._consumer.getmany(
                    timeout_ms=self.poll_timeout_ms, max_records=self.max_batch_records
                )
                if batches:
                    async with self._batch_lock:
                        if assignments == self._assignments:
                            await self._apply_batch(batches)
                        else:
                            await self._refetch()
                if self.checkpoints is not None:
                    await self.checkpoints.maybe_upload(self)
            if self._failure is not None:  # set by a failed assignment
                raise self._failure
        except asyncio.CancelledError:
            raise
        except AUTHORIZATION_ERRORS as exc:
            self._failure = self._may_not_read(exc)
            log.error('projector stopped: %s', self._failure)
            async with self._progress:
                self._progress.notify_all()
            raise self._failure from exc
        except Exception as exc:
            log.exception('projector stopped')
            self._failure = exc
            async with self._progress:
                self._progress.notify_all()
            raise

    async def _refetch(self) -> None:
        """Drop a batch fetched across an assignment change; fetch again from the shards' offsets.

        aiokafka installs a new assignment and starts fetching from the group's committed offsets
        before it calls `_assigned`, which restores shards and seeks to their stored offsets. A
        batch `getmany` returned meanwhile may start past a restored shard's offsets: applying it
        would skip the records in between. Seeking every owned partition again costs one fetch.
        """
        assert self._consumer is not None
        await self._seek(self._consumer.assignment())

    async def _apply_batch(self, batches: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> None:
        by_shard: dict[int, list[SourceRecord]] = {}
        for tp, messages in batches.items():
            if tp.partition not in self._shards:
                continue  # revoked meanwhile: its next owner reads these from the shard's offsets
            topic = self._topic_index[tp.topic]
            by_shard.setdefault(tp.partition, []).extend(
                SourceRecord(topic, tp.partition, m.offset, m.key, m.value) for m in messages
            )
        if not by_shard:
            return
        assert self._wire is not None
        for partition, records in by_shard.items():  # Confluent-framed records, if any, as single-object
            read = await self._wire.read(records, lambda: self._stopping)
            if read is None:
                return  # stopping while the schema registry does not answer: applied on restart
            by_shard[partition] = read
        with span('stepstream.projector.batch') as current:
            await self._stage_batch(by_shard, current)

    async def _stage_batch(self, by_shard: dict[int, list[SourceRecord]], current: Span | None) -> None:
        applier = self._applier
        assert applier is not None
        send = self.send_dead_letters
        shards = self._shards

        def stage_and_commit() -> tuple[list[BatchTxn], list[BatchOutcome], bool]:
            txns, outcomes = [], []
            for partition, records in by_shard.items():
                shard = shards[partition]
                txn, outcome = applier.stage(shard.db, records)
                txn.put(PROGRESS, dumps(shard.progress_figures(len(records))))
                txns.append(txn)
                outcomes.append(outcome)
            held = send and any(o.dead for o in outcomes)
            if not held:  # the common case: one hop to the worker thread, not two
                for txn in txns:
                    txn.commit()
            return txns, outcomes, held

        txns, outcomes, held = await asyncio.to_thread(stage_and_commit)
        # Dead letters are acknowledged by the DLQ before the batch (and its offsets) commits:
        # a crash in between repeats them in the DLQ on restart, and never loses one.
        if held:
            if not await self._dead_letter([d for o in outcomes for d in o.dead]):
                return  # stopping while the DLQ was unreachable: the batch is applied on restart
            await asyncio.to_thread(lambda: [txn.commit() for txn in txns])
        next_offsets: Position = {}
        for outcome in outcomes:
            self.records_applied += outcome.applied
            self.duplicates_ignored += outcome.duplicates
            self.dead_lettered += len(outcome.dead)
            for (topic, partition), offset in outcome.next_offsets.items():
                next_offsets[TopicPartition(self._topics[topic], partition)] = offset
        self._observe(outcomes, next_offsets, current)
        async with self._progress:
            self._applied.update(next_offsets)
            self._progress.notify_all()
        await self._commit_group_offsets(next_offsets)

    def _observe(self, outcomes: list[BatchOutcome], next_offsets: Position, current: Span | None) -> None:
        """The batch's figures as OpenTelemetry metrics and span attributes (no-ops without an SDK)."""
        applied = sum(o.applied for o in outcomes)
        records_applied.add(applied)
        dead = [d for o in outcomes for d in o.dead]
        for letter in dead:
            records_dead_lettered.add(1, {'stepstream.reason': letter.reason})
        assert self._consumer is not None
        for tp, offset in next_offsets.items():
            highwater = self._consumer.highwater(tp)
            if highwater is not None:
                lag.set(
                    max(highwater - offset, 0),
                    {'stepstream.topic': tp.topic, 'stepstream.partition': tp.partition},
                )
        if current is not None and current.is_recording():
            current.set_attributes(
                {
                    'stepstream.records': sum(o.applied + o.duplicates + len(o.dead) for o in outcomes),
                    'stepstream.applied': applied,
                    'stepstream.dead_lettered': len(dead),
                }
            )

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
            except AUTHORIZATION_ERRORS as exc:  # no ACL to write the DLQ: retrying cannot help
                raise access_denied(
                    self.settings,
                    f'write dead letters to {self.settings.dlq_topic}',
                    exc,
                    fix=f'grant it WRITE on {self.settings.dlq_topic} (the projector ACL)',
                ) from exc
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
        except AUTHORIZATION_ERRORS:
            raise
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
        await self._commit_uncommitted()

    async def _commit_uncommitted(self) -> None:
        """Commit the offsets applied since the last commit, for the partitions still owned."""
        assert self._consumer is not None
        owned = self._consumer.assignment()
        offsets = {tp: offset for tp, offset in self._uncommitted.items() if tp in owned}
        self._uncommitted = {}
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except KafkaError as exc:  # lag tooling only; the stored offsets are what counts
            log.debug('group offset commit failed: %r', exc)


async def _stop_consumer(consumer: AIOKafkaConsumer) -> None:
    """Stop `consumer`, also while its broker is away.

    aiokafka's fetcher cancels a fetch that waits out a retry backoff and then awaits it, so
    `stop()` raises that fetch's `CancelledError` although nobody cancelled us: swallow that one.
    """
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # a real cancellation of the caller
        # stop() ended early: close the connections it did not get to.
        await consumer._client.close()


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
