"""`Projector`: consumes both log topics and applies each batch to its shards atomically.

The projector coordinates: it starts and stops the consumer and consumes; each batch takes its
way to the shards through the `BatchPipeline` (wire formats, the `Applier`, dead letters, the
commit, then `GroupOffsets`, `ApplyMetrics` and `AppliedPosition`). The shards themselves
(opening, restoring, identity, hand-off) are the `ShardSet`'s; which partitions it holds and
where the consumer reads them from, the `Assignment`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from types import TracebackType
from typing import Self

from aiokafka import AIOKafkaConsumer

from stepstream.erasure import KeyRing
from stepstream.errors import StepStreamError
from stepstream.kafka_client import AUTHORIZATION_ERRORS
from stepstream.media import MediaStore, S3MediaStore
from stepstream.projector._assignment import Assignment
from stepstream.projector._connection import (
    connect,
    disconnect,
    end_position,
    make_consumer,
    may_not_read,
    take_partitions,
)
from stepstream.projector._membership import Membership
from stepstream.projector._options import (
    SESSION_TIMEOUT_MS,
    GroupMember,
    ProjectorParts,
    Rebuilding,
    only_partitions,
)
from stepstream.projector._pipeline import BatchPipeline
from stepstream.projector._progress import AppliedPosition
from stepstream.settings import Settings, check_count
from stepstream.storage import Identity, LiveShards, ShardSet, check_projection
from stepstream.topics import Position, TopicLayout, ensure_topics

log = logging.getLogger('stepstream.projector')


class Projector:
    """Materializes the log into a sharded RocksDB projection, exactly once per record.

    ```python
    async with Projector(settings, db_path='proj') as projector:
        await projector.wait_for(await event_log.flush())
        run = await ProjectionReader.of(projector).get_run('librarian-1a2b3c4d')
    ```

    The projection is one shard per partition number (decision 0016). Each batch from
    `getmany` is split by partition and applied to each shard in one `WriteBatch` together with
    that partition's next offsets; on start (or on assignment) the consumer seeks to those stored
    offsets, so a crash at any instant neither loses nor repeats a record.

    Without `member`, one projector owns every partition (or those of `Rebuilding.partitions`,
    as a parallel rebuild's workers do) and commits offsets to a consumer group only for standard
    lag tooling. With `member=GroupMember(group=...)`, it joins that consumer group as a member:
    it opens the shards of the partitions the group assigns it, closes them when they are
    revoked, and several members (on one host sharing `db_path`, or on several hosts) split the
    work; `GroupMember` also holds what only a member uses (its session timeout, assignment
    callback, `Membership` and `Checkpoints`).

    `max_snapshots_per_run` keeps the newest N snapshots of each run readable, plus the
    newest complete and the newest overall; it is part of what the projection is, so an
    existing projection keeps the value it was built with (None: take it from there) and a
    different one is refused. `rebuilding` makes this a rebuild's projector (`Rebuilding`).
    `parts` replaces what it coordinates (`ProjectorParts`), made from `settings` otherwise.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        db_path: str | Path | None = None,
        member: GroupMember | None = None,
        create_topics: bool = True,
        max_batch_records: int = 5000,
        poll_timeout_ms: int = 100,
        max_snapshots_per_run: int | None = None,
        media_store: MediaStore | None = None,
        rebuilding: Rebuilding | None = None,
        parts: ProjectorParts | None = None,
    ) -> None:
        """Check the projection directory; nothing connects until `start()` (or `async with`)."""
        self.only = only_partitions(member, rebuilding, max_snapshots_per_run)
        check_count(max_batch_records, 'max_batch_records')
        group = member.group if member is not None else None
        checkpoints = member.checkpoints if member is not None else None
        self.settings = settings
        path = db_path if db_path is not None else settings.projection.db_path
        self.db_path = check_projection(path, create=True)
        self.shards = ShardSet(
            self.db_path,
            settings,
            group=group,
            rebuilding=rebuilding is not None,
            max_snapshots_per_run=max_snapshots_per_run,
            checkpoints=checkpoints,
        )
        """The shards this projector holds (assign, revoke, restore: `ShardSet`)."""
        self.member = member
        self.group = group
        self.group_id = group or f'{settings.topics.topic_prefix}.projector'
        self.create_topics = create_topics
        self.max_batch_records = max_batch_records
        self.poll_timeout_ms = poll_timeout_ms
        self.send_dead_letters = rebuilding is None  # a rebuild does not repeat the DLQ
        self.rebuilding = rebuilding is not None
        self.checkpoints = checkpoints
        self.session_timeout_ms = member.session_timeout_ms if member is not None else SESSION_TIMEOUT_MS
        given = member.membership if member is not None else None
        self.membership = given if given is not None else Membership()
        self.media_store: MediaStore = media_store or S3MediaStore.from_settings(settings.media)
        self.keys = KeyRing(settings) if settings.security.erasure_key is not None else None
        """Erasure on: the conversation keys its readers open sealed content with, in memory only."""
        self._topics = (settings.topics.step_events_topic, settings.topics.tool_effects_topic)
        made = (parts or ProjectorParts()).made(settings, self._topics, live=rebuilding is None)
        self.dead_letters, self.group_offsets, self.metrics = made
        self._position = AppliedPosition()
        self._pipeline = BatchPipeline(
            self.shards,
            self._topics,
            made,
            self._position,
            send_dead_letters=self.send_dead_letters,
            stopping=lambda: self._stopping,
        )
        self._assignment = Assignment(
            self.shards,
            self._position,
            self.metrics,
            self._topics,
            group=group,
            on_assignment=member.on_assignment if member is not None else None,
            on_failure=self._fail,
            on_open=lambda _shard: self._pipeline.options_changed(),
        )
        self._layout: TopicLayout | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        if group is None:
            self._open_existing()

    @property
    def records_applied(self) -> int:
        """Records applied since this projector was made (duplicates and dead letters not counted)."""
        return self.metrics.records_applied

    @property
    def duplicates_ignored(self) -> int:
        """Repeats of records already applied, ignored."""
        return self.metrics.duplicates_ignored

    @property
    def dead_lettered(self) -> int:
        """Records that went to the DLQ."""
        return self.metrics.dead_lettered

    @property
    def identity(self) -> Identity | None:
        """The identity of the projection's shards (None before one is opened)."""
        return self.shards.identity

    @property
    def max_snapshots_per_run(self) -> int | None:
        """The projection's option: the one asked for, or the one its shards were built with."""
        return self.shards.max_snapshots_per_run

    @property
    def restored_from_checkpoint(self) -> dict[int, int]:
        """Partition -> records the shard's restored checkpoint held, for shards restored so far."""
        return self.shards.restored_from_checkpoint

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Check the projection is of these topics, seek to its offsets and consume in the background."""
        layout = await ensure_topics(self.settings, create=self.create_topics)
        self._layout = layout
        for partition in self.shards.partitions:
            self.shards.claim(self.shards[partition], layout)
        self._pipeline.start(self.settings, layout)
        kafka = self.settings.kafka
        consumer = make_consumer(
            kafka,
            group_id=self.group_id,
            membership=self.membership,
            session_timeout_ms=self.session_timeout_ms,
        )
        await connect(kafka, consumer, self.dead_letters, send_dead_letters=self.send_dead_letters)
        self._consumer = consumer
        self._assignment.attach(consumer, layout)
        if self.group is None:
            mine = [p for p in range(layout.partitions) if self.only is None or p in self.only]
            for partition in mine:
                if partition not in self.shards:
                    await self._assignment.open_shard(partition)
            try:
                await take_partitions(consumer, self._assignment, self._topics, mine)
            except AUTHORIZATION_ERRORS as exc:
                self._consumer = None
                await consumer.stop()
                await self.dead_letters.stop()
                raise may_not_read(self.settings.kafka, self.group_id, self._topics, exc) from exc
        else:
            consumer.subscribe(list(self._topics), listener=self._assignment.listener())
        self._stopping = False
        self._task = asyncio.create_task(self._consume(), name='stepstream-projector')

    def _open_existing(self) -> None:
        """Open the shards that exist now, so a second writer is refused before connecting."""
        try:
            for shard in self.shards.open_existing(self.only):
                self._position.start_at(shard.offsets())
        except BaseException:
            self.close()
            raise

    async def _fail(self, exc: BaseException) -> None:
        """Stop on `exc`: `wait_for`, `join()` and `__aexit__` raise it."""
        self._stopping = True
        await self._position.fail(exc)

    def mark_rebuilt(self) -> None:
        """Record that a rebuild reached the end it was after: its shards are complete."""
        self.shards.mark_rebuilt()

    async def stop(self) -> None:
        """Finish the batch in hand, then disconnect and flush the shards."""
        self._stopping = True
        if self._task is not None:
            with contextlib.suppress(Exception):  # kept in the applied position, raised by __aexit__
                await self._task
            self._task = None
        if self._consumer is not None and self.group_offsets.pending:
            # The last second's offsets too, so lag tooling reads the position the projector left at.
            with contextlib.suppress(TimeoutError):
                timeout = self.settings.kafka.ack_timeout_s
                await asyncio.wait_for(self.group_offsets.commit(self._consumer), timeout)
        # A member's shards are revoked (and closed) as its consumer leaves the group; with the
        # broker gone, `close()` closes them all the same.
        await disconnect(self.settings.kafka, self._consumer, self.dead_letters)
        self._consumer = None
        await self._pipeline.close()
        self.shards.flush()
        if self.keys is not None:
            await self.keys.close()

    def close(self) -> None:
        """Close the shards' RocksDB handles (after `stop()`)."""
        for partition in self.shards.partitions:
            self._assignment.release(partition)

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            if self._consumer is not None:
                await self._consumer.stop()
            await self.dead_letters.stop()
            self.close()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
        self.close()
        failure = self._position.failure
        if failure is not None and exc is None:
            raise StepStreamError(f'the projector stopped on an error: {failure!r}') from failure

    async def join(self) -> None:
        """Wait until the background loop ends: after `stop()`, or on an error, which is raised."""
        if self._task is not None:
            await asyncio.shield(self._task)

    # -- reading your writes ---------------------------------------------------------------------

    def live_shards(self) -> LiveShards:
        """The shards this projector holds open, as `ProjectionReader.of(projector)` reads them.

        A group member holds only its own shards; `ProjectionReader.open(db_path)` reads every
        shard in the directory, whichever member writes it. A member that serves (its membership
        has an `endpoint`) lists only the partitions it owns at each query: its service merges the
        other members' lists.
        """
        partitions = (
            self._layout.partitions if self._layout is not None else max(self.shards.view, default=-1) + 1
        )
        membership = self.membership
        return LiveShards(
            self.shards.view,
            partitions=partitions,
            media_store=self.media_store,
            keys=self.keys,
            stale_after_s=self.settings.liveness.stale_after_s,
            scope=(lambda: membership.own) if membership.endpoint is not None else None,
        )

    @property
    def partitions(self) -> list[int]:
        """The partition numbers whose shards this projector holds now."""
        return self.shards.partitions

    @property
    def applied(self) -> Position:
        """For each partition, the offset just past the last applied record."""
        return self._position.position

    async def wait_for(self, position: Position, timeout: float = 30.0) -> None:
        """Return once every record up to `position` (from `EventLog.flush()`) is applied."""
        await self._position.wait_for(position, timeout)

    async def end_position(self) -> Position:
        """The end of every partition this projector owns right now (what `catch_up` waits for)."""
        if self._consumer is None:
            raise StepStreamError('the projector is not started')
        return await end_position(self._consumer)

    async def catch_up(self, timeout: float = 60.0) -> Position:
        """Wait until everything in the log when called is applied; returns that position."""
        position = await self.end_position()
        await self.wait_for(position, timeout=timeout)
        return position

    # -- the loop --------------------------------------------------------------------------------

    async def _consume(self) -> None:
        assert self._consumer is not None
        try:
            assignment = self._assignment
            while not self._stopping:
                changes = assignment.changes
                batches = await self._consumer.getmany(
                    timeout_ms=self.poll_timeout_ms, max_records=self.max_batch_records
                )
                if batches or assignment.pacer.holding:
                    async with self.shards.lock:
                        if changes == assignment.changes:
                            await self._pipeline.apply(self._consumer, await assignment.pace(batches))
                        else:
                            await assignment.refetch()
                if self.checkpoints is not None:
                    await self.checkpoints.maybe_upload(self.shards)
            if self._position.failure is not None:  # set by a failed assignment
                raise self._position.failure
        except asyncio.CancelledError:
            raise
        except AUTHORIZATION_ERRORS as exc:
            failure = may_not_read(self.settings.kafka, self.group_id, self._topics, exc)
            log.error('projector stopped: %s', failure)
            await self._position.fail(failure)
            raise failure from exc
        except Exception as exc:
            if exc is not self._position.failure:
                log.exception('projector stopped')
                await self._position.fail(exc)
            raise
