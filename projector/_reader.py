"""`ProjectionReader`: the read half of the harness `StepStore`, over the RocksDB projection."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import ValidationError

from stepstream.erasure import ContentErased, ErasureError, KeyRing, open_snapshot
from stepstream.errors import StepStreamError
from stepstream.ids import is_run_id
from stepstream.media._sealed import SealedMediaStore
from stepstream.media._types import MEDIA_URI_SCHEME, NO_CONTEXT, MediaContext, MediaStore
from stepstream.projector._keys import (
    CHILDREN,
    CONFLICT,
    CONVERSATION,
    EFFECT,
    EVENT,
    PARKED,
    RUN,
    RUN_MEDIA,
    RUNS,
    SNAPSHOT,
    UNRESOLVED,
    UNRESOLVED_RUN,
)
from stepstream.projector._retention import (
    RetentionPreview,
    RetentionState,
    expired_started_at,
    referenced_media,
    retention_preview,
    retention_state,
)
from stepstream.projector._shard import (
    MemoryShard,
    Shard,
    check_projection,
    combined_state,
    shard_paths,
    shard_writer,
)
from stepstream.projector._state import EffectState, RunState, SnapshotEntry
from stepstream.schemas import (
    ContinuableSnapshot,
    EffectResolution,
    RunRecord,
    RunUsage,
    StepEvent,
    ToolEffectRecord,
    decode,
)

if TYPE_CHECKING:
    from pydantic_ai.messages import ModelMessage
from stepstream.timestamps import EPOCH, from_micros, micros
from stepstream.topics import murmur2_partition

T = TypeVar('T')
ReadableShard = Shard | MemoryShard
"""A shard a reader can read: on disk (its writer's own, or a read-only secondary), or in memory."""
DEFAULT_STALE_AFTER_S = 20.0
"""A `running` run with no record for this long reads as `stale`: four of its writer's default
heartbeat intervals (docs/decisions/0014 and 0026)."""
RATE_WINDOW = timedelta(seconds=10)
"""The window of the records-per-second figure the projector keeps for `status`."""


class _NoMediaStore:
    """Stands in when a reader has no media store: any reference fails saying what to do."""

    def _missing(self, uri: str) -> StepStreamError:
        return StepStreamError(
            f'this snapshot refers to offloaded media ({uri}) but the reader has no media store: '
            'open it with media_store=S3MediaStore.from_settings(settings)'
        )

    async def put(self, data: bytes, ctx: MediaContext = NO_CONTEXT) -> str:
        raise StepStreamError('a reader never writes media')

    async def get(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bytes:
        raise self._missing(uri)

    async def exists(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bool:
        raise self._missing(uri)

    async def public_url(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> str | None:
        raise self._missing(uri)

    async def get_metadata(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> MediaContext:
        raise self._missing(uri)


def _snapshot(
    run_id: str, entry: SnapshotEntry, event: StepEvent, messages: list[ModelMessage] | None
) -> ContinuableSnapshot:
    """The snapshot `entry` of `event` with `messages`; None: its content was erased (no messages)."""
    return ContinuableSnapshot(
        run_id=run_id,
        step_index=entry.step_index,
        messages=[] if messages is None else messages,
        snapshot_seq=entry.snapshot_seq,
        seq=entry.seq,
        conversation_id=event.conversation_id,
        parent_run_id=event.parent_run_id,
        agent_name=event.agent_name,
        timestamp=event.timestamp,
        state=entry.state,  # type: ignore[arg-type]
        idempotency_key=entry.idempotency_key,
        erased=messages is None,
    )


def _ts(value: int | None) -> datetime | None:
    return None if value is None else from_micros(value)


class ShardUnavailable(StepStreamError):
    """A read needs a shard this reader cannot see (moving to another member, or on another host)."""


class ProjectionReader:
    """Async queries over a projection: runs, lineage, events, snapshots, tool effects.

    From the projector's process use `projector.reader()`; from any other process
    `ProjectionReader.open(path)`, which opens every shard as a RocksDB secondary instance and
    catches up with the writers before every query. A run's own reads go to its shard (the
    producer's partitioner decides which); lists merge the shards in key order. A read that
    needs a shard the reader cannot see raises `ShardUnavailable` naming the partition, never
    a partial answer.
    """

    def __init__(
        self,
        shards: ReadableShard | Mapping[int, ReadableShard],
        *,
        partitions: int | None = None,
        secondary: bool = False,
        owns_db: bool = False,
        media_store: MediaStore | None = None,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        keys: KeyRing | None = None,
    ) -> None:
        """Wrap open shards (`{partition: shard}` with the topics' `partitions`), or one shard.

        One shard given alone holds every partition's runs (tests and benchmarks).

        `media_store` restores offloaded payloads. A `running` run whose newest record (its
        writer's heartbeats included) is older than `stale_after_s` reads as `stale` (its process
        probably died), and so does one whose newest record claims a time more than `stale_after_s`
        ahead of this reader's clock (a writer clock that cannot be trusted is no proof of life).
        Computed here, at read time, never stored, so a rebuild agrees with the live projection;
        an unended tool call reads `in_flight` while its run is live, else `unknown_after_crash`.
        `keys` (erasure on) opens sealed content; content whose key was destroyed reads as erased.
        """
        if stale_after_s < 0:
            raise ValueError(f'stale_after_s must not be negative, got {stale_after_s}')
        self._shards: Mapping[int, ReadableShard] = (
            {0: shards} if isinstance(shards, Shard | MemoryShard) else shards
        )
        self._partitions = partitions
        """None: one db holds every partition's runs (tests and benchmarks)."""
        self.media_store = media_store
        self.keys = keys
        self.stale_after = timedelta(seconds=stale_after_s)
        self._secondary = secondary
        self._owns_db = owns_db
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._root: Path | None = None
        self.only: frozenset[int] | None = None
        """Lists and sweeps cover only these partitions (a group member's own: its service merges
        the other members' answers); None: every partition."""

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        media_store: MediaStore | None = None,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        keys: KeyRing | None = None,
    ) -> ProjectionReader:
        """Open a projection that projectors (maybe in other processes) are writing.

        Give `media_store` (e.g. `S3MediaStore.from_settings(settings)`) to read snapshots whose
        large payloads were offloaded, and `keys` (`KeyRing(settings)`) when erasure is on.
        """
        root = check_projection(path, create=False)
        tmp = tempfile.TemporaryDirectory(prefix='stepstream-reader-')
        reader = cls(
            {}, secondary=True, owns_db=True, media_store=media_store, stale_after_s=stale_after_s, keys=keys
        )
        reader._tmp, reader._root = tmp, root
        try:
            reader._open_new_shards()
        except BaseException:
            reader.close()
            raise
        return reader

    def _open_new_shards(self) -> None:
        """Open shards that appeared under the directory since the last query."""
        assert self._root is not None and self._tmp is not None and isinstance(self._shards, dict)
        for partition, path in shard_paths(self._root).items():
            if partition in self._shards:
                continue
            shard = Shard.open_read_only(path, Path(self._tmp.name) / path.name)
            identity = shard.identity()
            assert identity is not None  # open_read_only checked it
            if self._partitions is not None and identity.partitions != self._partitions:
                shard.close()
                raise StepStreamError(
                    f'{path} is a shard of {identity.partitions} partitions, '
                    f'the others of {self._partitions}: '
                    'the directory mixes two projections; rebuild it'
                )
            self._partitions = identity.partitions
            self._shards[partition] = shard

    def close(self) -> None:
        """Release the database handles if this reader opened them."""
        if self._owns_db:
            for shard in self._shards.values():
                shard.close()
            if isinstance(self._shards, dict):
                self._shards.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def _query(self, fn: Callable[[], T]) -> T:
        def run() -> T:
            if self._secondary:
                if self._root is not None:
                    self._open_new_shards()
                for shard in self._shards.values():
                    shard.catch_up()
            return fn()

        return await asyncio.to_thread(run)

    async def _point(self, fn: Callable[[], T]) -> T:
        """A point read (a few RocksDB gets): on the event loop over a projector's own shards.

        Such a read takes microseconds; a hop to a worker thread and back costs the loop two
        wake-ups, which while it serves writers too was most of a read-your-writes `get_run`
        (docs/benchmarks.md, "Issue 27, third pass"). A reader of another process's shards
        catches up with them first, which can take longer: that one goes to a thread.
        """
        if self._secondary:
            return await self._query(fn)
        return fn()

    def _db(self, run_id: str) -> ReadableShard:
        """The shard holding `run_id`'s records."""
        if self._partitions is None:
            return self._shards[0]
        partition = murmur2_partition(run_id.encode(), self._partitions)
        shard = self._shards.get(partition)
        if shard is None:
            raise ShardUnavailable(self._missing_message([partition]))
        return shard

    def _all(self) -> list[ReadableShard]:
        """Every shard, or `ShardUnavailable` naming those missing."""
        if self._partitions is None:
            return list(self._shards.values())
        wanted = range(self._partitions) if self.only is None else sorted(self.only)
        missing = [p for p in wanted if p not in self._shards]
        if missing:
            raise ShardUnavailable(self._missing_message(missing))
        return [self._shards[p] for p in wanted]

    def _missing_message(self, partitions: list[int]) -> str:
        where = f' under {self._root}' if self._root is not None else ' in this process'
        return (
            f'the shard of partition(s) {partitions} is not readable{where}: it is moving to another '
            'group member, held by a member on another host, or not made yet; try again, or read '
            'a directory that holds every shard'
        )

    def _scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Every shard's keys under `prefix`, merged in key order (a k-way merge, not a sort)."""
        shards = self._all()
        if len(shards) == 1:
            return shards[0].scan(prefix)
        return heapq.merge(*(shard.scan(prefix) for shard in shards), key=lambda item: item[0])

    # -- runs ------------------------------------------------------------------------------------

    async def get_run(self, run_id: str) -> RunRecord | None:
        """The run's lineage and status, or None if the projection has not seen it."""
        return await self._point(lambda: self._run(run_id))

    async def list_runs(
        self,
        conversation_id: str | None = None,
        parent_run_id: str | None = None,
        status: str | None = None,
        agent_name: str | None = None,
        *,
        newest_first: bool = False,
        after: str | None = None,
        after_started: datetime | None = None,
        limit: int | None = None,
    ) -> list[RunRecord]:
        """Runs matching every given filter, in the order they started (`newest_first` reverses it).

        Page with `limit` and `after` (the run_id of the last run of the previous page: only
        runs past it in this order). A page reads the index keys up to its end but decodes only
        the runs it looks at. With `after_started` (the `after` run's `started_at`) the page
        starts at that place in the order, whether or not `after` is in this listing: how a
        group's service merges pages of runs held by several members.

        ```python
        page = await reader.list_runs(newest_first=True, limit=50)
        more = await reader.list_runs(newest_first=True, limit=50, after=page[-1].run_id)
        ```
        """

        def query() -> list[RunRecord]:
            if conversation_id is not None:
                index, prefix = CONVERSATION, CONVERSATION.prefix(conversation_id)
            elif parent_run_id is not None:
                index, prefix = CHILDREN, CHILDREN.prefix(parent_run_id)
            else:
                index, prefix = RUNS, RUNS.prefix()
            run_ids: Iterator[str] = (index.last_str(k) for k, _ in self._scan(prefix))
            if after is not None and after_started is not None:
                cut = (micros(after_started), after)
                places = (index.parse(k)[-2:] for k, _ in self._scan(prefix))
                if newest_first:
                    run_ids = (str(r) for s, r in reversed(list(places)) if (s, r) < cut)
                else:
                    run_ids = (str(r) for s, r in places if (s, r) > cut)
            elif newest_first:
                run_ids = reversed(list(run_ids))
            if after is not None and after_started is None:
                run_ids = itertools.dropwhile(lambda run_id: run_id != after, run_ids)
                if next(run_ids, None) is None:
                    raise LookupError(f'after={after!r} is not a run of this listing')
            runs: list[RunRecord] = []
            for run_id in run_ids:
                if limit is not None and len(runs) >= limit:
                    break
                run = self._run(run_id)
                if run is None:
                    continue
                if parent_run_id is not None and run.parent_run_id != parent_run_id:
                    continue
                if status is not None and run.status != status:
                    continue
                if agent_name is not None and run.agent_name != agent_name:
                    continue
                runs.append(run)
            return runs

        return await self._query(query)

    async def list_conflicts(self) -> list[RunRecord]:
        """Runs whose run_id was claimed by more than one writer, in the order they started."""

        def query() -> list[RunRecord]:
            run_ids = {CONFLICT.parse(k)[0] for k, _ in self._scan(CONFLICT.prefix())}
            runs = [r for r in (self._run(str(run_id)) for run_id in run_ids) if r is not None]
            return sorted(runs, key=lambda r: (r.started_at or EPOCH, r.run_id))

        return await self._query(query)

    async def run_tree(self, run_id: str) -> list[RunRecord]:
        """The run and all its descendants, depth first, children in the order they started."""

        def query() -> list[RunRecord]:
            root = self._run(run_id)
            if root is None:
                return []
            tree, stack, seen = [], [root], {root.run_id}
            while stack:
                run = stack.pop()
                tree.append(run)
                children = [c for c in self._children(run.run_id) if c.run_id not in seen]
                seen.update(c.run_id for c in children)
                stack.extend(reversed(children))
            return tree

        return await self._query(query)

    async def root_of(self, run_id: str) -> RunRecord | None:
        """The top of the run's lineage (the run itself when it has no parent)."""

        def query() -> RunRecord | None:
            run, seen = self._run(run_id), set()
            while run is not None and run.parent_run_id is not None and run.run_id not in seen:
                seen.add(run.run_id)
                parent = self._run(run.parent_run_id)
                if parent is None:
                    break
                run = parent
            return run

        return await self._query(query)

    def _children(self, run_id: str) -> list[RunRecord]:
        """The runs naming `run_id` as parent: the same index `list_runs(parent_run_id=)` reads."""
        children = (self._run(CHILDREN.last_str(k)) for k, _ in self._scan(CHILDREN.prefix(run_id)))
        return [c for c in children if c is not None and c.parent_run_id == run_id]

    def _run(self, run_id: str) -> RunRecord | None:
        state = self._db(run_id).get_state(RUN.key(run_id), RunState)
        if state is None:
            return None
        last_record_at = from_micros(max(state.started_at, state.last_record_at))
        status = state.status
        if status == 'running' and not self._alive(last_record_at):
            status = 'stale'
        return RunRecord(
            run_id=state.run_id,
            conversation_id=state.conversation_id,
            parent_run_id=state.parent_run_id,
            agent_name=state.agent_name,
            metadata=dict(state.metadata),
            started_at=_ts(state.started_at),
            registration_id=state.owner,
            status=status,  # type: ignore[arg-type]
            ended_at=_ts(state.ended_at),
            error=state.error,
            last_record_at=last_record_at,
            event_count=state.record_count,
            last_seq=state.last_seq,
            gaps=state.gaps(),
            conflicting_writers=list(state.conflicting_writers),
            rejected=dict(state.rejected),
            usage=RunUsage(**state.usage, cost_usd=state.cost_usd),
            parent_expired=state.parent_run_id is not None and self._expired(state.parent_run_id) is not None,
        )

    async def expired(self, run_id: str) -> datetime | None:
        """When a run the retention policy dropped had started, or None if it was not dropped.

        What is left of an expired run is this marker: a child that names it as parent says
        `parent_expired`, and a lookup of it can say why it finds nothing.
        """
        return await self._query(lambda: self._expired(run_id))

    def _expired(self, run_id: str) -> datetime | None:
        """`expired`, in the reader's thread; None too when the run's shard is not here."""
        if not is_run_id(run_id):
            return None
        try:
            started = expired_started_at(self._db(run_id), run_id)
        except ShardUnavailable:
            return None
        return None if started is None else from_micros(started)

    def _alive(self, last_record_at: datetime) -> bool:
        """Whether a `running` run's newest record is recent.

        Neither older than the threshold, nor further ahead of this reader's clock than it: a
        writer clock in the future cannot keep a dead run alive.
        """
        quiet = datetime.now(UTC) - last_record_at
        return -self.stale_after <= quiet <= self.stale_after

    def _live(self, run_id: str) -> bool:
        """Whether the run reads `running` (not stale, not ended): its unended calls are in flight."""
        run = self._run(run_id)
        return run is not None and run.status == 'running'

    # -- events ----------------------------------------------------------------------------------

    async def list_events(self, run_id: str) -> list[StepEvent]:
        """The run's step events in `seq` order (snapshot events included)."""

        def query() -> list[StepEvent]:
            events = []
            for _, raw in self._db(run_id).scan(EVENT.prefix(run_id)):
                event = decode(raw)
                assert isinstance(event, StepEvent)
                events.append(event)
            return events

        return await self._query(query)

    # -- snapshots -------------------------------------------------------------------------------

    async def latest_snapshot(
        self, run_id: str, include_interrupted: bool = False, *, restore: bool = True
    ) -> ContinuableSnapshot | None:
        """The newest `complete` snapshot (or newest of any state), or None.

        `restore` as in `list_snapshots`.
        """

        def query() -> list[SnapshotEntry]:
            entries = self._snapshot_entries(run_id)
            eligible = [e for e in entries if include_interrupted or e.state == 'complete']
            return entries[: entries.index(eligible[-1]) + 1] if eligible else []

        entries = await self._query(query)
        if not entries:
            return None
        return (await self._materialize(run_id, entries, {entries[-1].snapshot_seq}, restore=restore))[0]

    async def list_snapshots(
        self,
        run_id: str,
        include_interrupted: bool = False,
        *,
        after: int | None = None,
        limit: int | None = None,
        restore: bool = True,
    ) -> list[ContinuableSnapshot]:
        """Retained snapshots of the run, oldest first, each with its full history.

        Page with `after` (a `snapshot_seq`: only later ones) and `limit`. The histories are
        rebuilt in one pass over the deltas, so a page costs what its deltas cost, not the
        square of the run's length; snapshots of one call share their unchanged message
        objects (copy one before changing it in place). `restore=False` leaves offloaded media
        as the references the log holds (no store round trip; `stepstream.media.link_media`
        turns them into links).
        """

        def query() -> tuple[list[SnapshotEntry], set[int]]:
            entries = self._snapshot_entries(run_id)
            wanted = [
                e.snapshot_seq
                for e in entries
                if e.retained
                and (include_interrupted or e.state == 'complete')
                and (after is None or e.snapshot_seq > after)
            ][:limit]
            if not wanted:
                return [], set()
            last = wanted[-1]
            return [e for e in entries if e.snapshot_seq <= last], set(wanted)

        entries, wanted = await self._query(query)
        return await self._materialize(run_id, entries, wanted, restore=restore)

    async def get_snapshot(
        self, run_id: str, snapshot_seq: int, *, restore: bool = True
    ) -> ContinuableSnapshot | None:
        """One snapshot by its `snapshot_seq`, of any state, or None (`restore` as in `list_snapshots`)."""

        def query() -> list[SnapshotEntry]:
            entries = self._snapshot_entries(run_id)
            if not any(e.snapshot_seq == snapshot_seq and e.retained for e in entries):
                return []
            return [e for e in entries if e.snapshot_seq <= snapshot_seq]

        entries = await self._query(query)
        if not entries:
            return None
        return (await self._materialize(run_id, entries, {snapshot_seq}, restore=restore))[0]

    def _snapshot_entries(self, run_id: str) -> list[SnapshotEntry]:
        return [SnapshotEntry.decode(v) for _, v in self._db(run_id).scan(SNAPSHOT.prefix(run_id))]

    async def _materialize(
        self, run_id: str, entries: list[SnapshotEntry], wanted: set[int], *, restore: bool = True
    ) -> list[ContinuableSnapshot]:
        """Replay the deltas in order: each snapshot is the previous one's prefix plus its tail.

        Each tail is decoded, validated and has its media restored once, however many of the
        wanted snapshots include it.
        """
        from stepstream.media._walker import restore_media
        from stepstream.schemas._patch import apply_patch

        if self.keys is not None:
            await self.keys.refresh()  # a key destroyed a moment ago is gone from here on
        tails = await self._query(lambda: self._tails(run_id, entries))
        if self.keys is not None and self.keys.missed and None in tails[1]:
            # A key never seen: erased long ago, or past an end the broker under-reported. Look again.
            self.keys.missed.clear()
            await self.keys.refresh(thorough=True)
            tails = await self._query(lambda: self._tails(run_id, entries))
            self.keys.erased |= self.keys.missed  # read to the end twice: gone, not late
            self.keys.missed.clear()
        store: MediaStore = self.media_store or _NoMediaStore()
        if self.keys is not None:
            store = SealedMediaStore(store, lookup=self.keys.get)
        history: list[ModelMessage] = []
        out: list[ContinuableSnapshot] = []
        erased = False
        for entry, event, tail, patch in zip(entries, *tails, strict=True):
            erased = erased or tail is None
            if not erased and tail is not None:
                try:
                    tail = await restore_media(tail, store) if restore else tail
                except ContentErased:
                    erased = True
            if erased or tail is None:  # its key was destroyed: the content is gone, the structure stays
                history.clear()
                if entry.snapshot_seq in wanted:
                    out.append(_snapshot(run_id, entry, event, None))
                continue
            if entry.prefix_len > len(history):
                raise StepStreamError(
                    f'run {run_id!r}: snapshot {entry.snapshot_seq} keeps {entry.prefix_len} messages of a '
                    f'history of {len(history)}; the log holds a corrupt delta'
                )
            if patch is not None:
                try:
                    apply_patch(history, patch)  # stamps on kept messages (schema v2)
                except ValueError as exc:
                    raise StepStreamError(
                        f'run {run_id!r}: snapshot {entry.snapshot_seq} holds a patch that does not fit: '
                        f'{exc}'
                    ) from None
            del history[entry.prefix_len :]
            history.extend(tail)
            if entry.snapshot_seq in wanted:
                out.append(_snapshot(run_id, entry, event, list(history)))
        return out

    def _tails(
        self, run_id: str, entries: list[SnapshotEntry]
    ) -> tuple[list[StepEvent], list[list[ModelMessage] | None], list[str | None]]:
        """Each snapshot's event, tail (None: erased) and patch, opened when sealed."""
        from pydantic_ai.messages import ModelMessagesTypeAdapter  # not at import: views need no Pydantic AI

        events: list[StepEvent] = []
        tails: list[list[ModelMessage] | None] = []
        patches: list[str | None] = []
        for expected, entry in enumerate(entries):
            if entry.snapshot_seq != expected:
                raise StepStreamError(
                    f'run {run_id!r}: snapshot {expected} is missing from the projection (a gap in the log), '
                    f'so snapshot {entry.snapshot_seq} cannot be reconstructed'
                )
            raw = self._db(run_id).get(EVENT.key(run_id, entry.seq))
            if raw is None:
                raise StepStreamError(f'run {run_id!r}: the event of snapshot {expected} is missing')
            event = decode(raw)
            assert isinstance(event, StepEvent) and event.snapshot is not None
            events.append(event)
            opened = open_snapshot(event.snapshot, run_id=run_id, keys=self.keys)
            if opened is None:
                tails.append(None)
                patches.append(None)
                continue
            patches.append(opened[1])
            try:
                tails.append(ModelMessagesTypeAdapter.validate_json(opened[0]))
            except ValidationError as exc:
                raise StepStreamError(
                    f'run {run_id!r}: snapshot {expected} holds messages Pydantic AI cannot read: '
                    f'{exc.error_count()} error(s), first: {exc.errors()[0]["msg"]}'
                ) from None
        return events, tails, patches

    # -- retention ---------------------------------------------------------------------------------

    async def retention(self) -> tuple[int | None, list[RetentionState]]:
        """The projection's retention policy (micros; None keeps every run) and each shard's figures."""

        def query() -> tuple[int | None, list[RetentionState]]:
            shards = self._all()
            identity = next((i for i in (s.identity() for s in shards) if i is not None), None)
            policy = identity.retain_ended_us if identity is not None else None
            partitions = sorted(self._shards) if self._partitions is not None else [0]
            return policy, [
                retention_state(self._shards[p], p, policy) for p in partitions if p in self._shards
            ]

        return await self._query(query)

    async def retention_preview(self, retain_us: int) -> list[RetentionPreview]:
        """What a policy of `retain_us` would drop from each shard now (to choose one before a rebuild)."""

        def query() -> list[RetentionPreview]:
            self._all()  # every shard, or `ShardUnavailable`
            return [retention_preview(shard, p, retain_us) for p, shard in sorted(self._shards.items())]

        return await self._query(query)

    async def referenced_media(self) -> set[str]:
        """The sha256 digests of every payload a kept run references, over every shard.

        Only a projection built with a retention policy indexes them (`ShardUnavailable` if a
        shard is not readable here: a sweep must see every shard's references).
        """
        return await self._query(lambda: set().union(*(referenced_media(s) for s in self._all())))

    async def media_index_versions(self) -> dict[int, int]:
        """Each shard's media index version (`Identity.media_index`), by partition."""

        def query() -> dict[int, int]:
            self._all()  # every shard, or `ShardUnavailable`
            versions = {}
            for partition, shard in sorted(self._shards.items()):
                identity = shard.identity()
                versions[partition] = identity.media_index if identity is not None else 1
            return versions

        return await self._query(query)

    async def media_read(self) -> set[str]:
        """The URI of every payload that reading a kept run's snapshots fetches, over every shard.

        Found as a reader finds them (`stepstream.media.media_read` over each snapshot's tail,
        opened with the reader's keys, JSON payloads fetched to see the references inside them),
        never from the media index, so the media sweep can check its index against it before it
        deletes anything. A run whose snapshots cannot be read (a gap in the log, messages
        Pydantic AI cannot read) counts with what its records list. Sealed content needs the
        reader's `keys` (`ErasureError` without them); erased content reads nothing.
        """
        from stepstream.media._walker import media_read

        if self.keys is not None:
            await self.keys.refresh(thorough=True)  # a key not seen yet must not read as erased
        store: MediaStore = self.media_store or _NoMediaStore()
        if self.keys is not None:
            store = SealedMediaStore(store, lookup=self.keys.get)
        run_ids = await self._query(
            lambda: [RUN.last_str(k) for s in self._all() for k, _ in s.scan(RUN.tag)]
        )
        read: set[str] = set()
        for run_id in run_ids:

            def tails(run_id: str = run_id) -> list[list[ModelMessage] | None] | set[str]:
                try:
                    return self._tails(run_id, self._snapshot_entries(run_id))[1]
                except ErasureError:
                    raise  # sealed content and no (or the wrong) key: say so, guess nothing
                except StepStreamError:
                    return {
                        MEDIA_URI_SCHEME + RUN_MEDIA.last_str(k)
                        for k, _ in self._db(run_id).scan(RUN_MEDIA.prefix(run_id))
                    }

            found = await self._query(tails)
            if isinstance(found, set):
                read |= found
                continue
            for tail in found:
                # A JSON payload sealed with a key destroyed since holds nothing to keep.
                with contextlib.suppress(ContentErased):
                    if tail is not None:
                        read |= await media_read(tail, store)
        return read

    # -- tool effects ------------------------------------------------------------------------------

    async def status(self) -> ProjectionStatus:
        """Where the projection stands: applied offsets, apply rate, DLQ and conflict counts."""

        def query() -> ProjectionStatus:
            offsets: dict[tuple[str, int], int] = {}
            dlq: dict[str, int] = {}
            rate, updated, conflicts, parked = 0.0, None, 0, 0
            identities = []
            now = datetime.now(UTC)
            last_batch: dict[int, datetime | None] = {}
            for partition, shard in self._shards.items():
                offsets.update({(tp.topic, tp.partition): offset for tp, offset in shard.offsets().items()})
                progress = shard.progress()
                last_batch[partition] = _ts(int(progress['at'])) if progress.get('at') is not None else None
                if progress.get('at') is not None:
                    updated = max(updated or 0, int(progress['at']))
                    # The rate is over the ten seconds before the shard's last batch: once that
                    # batch is older than the window, the shard applied nothing in the last ten.
                    at = _ts(int(progress['at']))
                    if at is not None and now - at <= RATE_WINDOW:
                        rate += float(progress.get('rate', 0.0))
                for reason, count in shard.dlq_counts().items():
                    dlq[reason] = dlq.get(reason, 0) + count
                conflicts += len({CONFLICT.parse(k)[0] for k, _ in shard.scan(CONFLICT.prefix())})
                parked += sum(1 for _ in shard.scan(PARKED.prefix()))
                identities.append(shard.identity())
            identity = next((i for i in identities if i is not None), None)
            missing = (
                []
                if self._partitions is None
                else [p for p in range(self._partitions) if p not in self._shards]
            )
            state = combined_state({i.state for i in identities if i is not None}, missing=bool(missing))
            return ProjectionStatus(
                offsets=dict(sorted(offsets.items())),
                applied_per_second=round(rate, 1),
                updated_at=_ts(updated),
                dead_lettered=sum(dlq.values()),
                dead_lettered_by_reason=dict(sorted(dlq.items())),
                conflicting_runs=conflicts,
                parked_records=parked,
                state=state,
                topic_prefix=identity.topic_prefix if identity is not None else None,
                max_snapshots_per_run=identity.max_snapshots_per_run if identity is not None else None,
                shards=sorted(self._shards),
                missing_shards=missing,
                writers=self._writers(),
                last_batch_at=dict(sorted(last_batch.items())),
            )

        return await self._query(query)

    def _writers(self) -> dict[int, int | None]:
        """Partition -> pid of the projector applying the shard (this process, for its own reader)."""
        if self._root is None:
            return {p: os.getpid() for p in sorted(self._shards)}
        paths = shard_paths(self._root)
        return {p: shard_writer(paths[p]) if p in paths else None for p in sorted(self._shards)}

    async def get_tool_effect(self, run_id: str, tool_call_id: str) -> ToolEffectRecord | None:
        """The merged effect record of one tool call, or None."""
        return await self._query(lambda: self._effect(run_id, tool_call_id))

    async def list_tool_effects(self, run_id: str) -> list[ToolEffectRecord]:
        """Every tool effect of the run, in the order the calls started."""

        def query() -> list[ToolEffectRecord]:
            calls = [EFFECT.last_str(k) for k, _ in self._db(run_id).scan(EFFECT.prefix(run_id))]
            live = self._live(run_id)
            effects = [e for e in (self._effect(run_id, c, live=live) for c in calls) if e is not None]
            effects.sort(key=lambda e: (e.started_at or EPOCH, e.tool_call_id))
            return effects

        return await self._query(query)

    async def list_unresolved_tool_effects(self, run_id: str | None = None) -> list[ToolEffectRecord]:
        """Effects whose latest status is `started`, oldest first: every call that has not ended.

        Each says what it is: `in_flight` while its run is live (the call may still finish),
        `unknown_after_crash` once the run is stale, failed or cancelled (it may or may not have
        happened). With `run_id`, for that run; without, across every run, so a recovering
        orchestrator can sweep them all.
        """

        def query() -> list[ToolEffectRecord]:
            found: list[ToolEffectRecord] = []
            if run_id is not None:
                ids = [
                    (run_id, UNRESOLVED_RUN.last_str(k))
                    for k, _ in self._db(run_id).scan(UNRESOLVED_RUN.prefix(run_id))
                ]
            else:
                ids = [
                    (str(run), str(call))
                    for _, run, call in (UNRESOLVED.parse(k) for k, _ in self._scan(UNRESOLVED.prefix()))
                ]
            live: dict[str, bool] = {}
            for run, call in ids:
                if run not in live:
                    live[run] = self._live(run)
                effect = self._effect(run, call, live=live[run])
                if effect is not None:
                    found.append(effect)
            found.sort(key=lambda e: (e.started_at or EPOCH, e.run_id, e.tool_call_id))
            return found

        return await self._query(query)

    def _effect(self, run_id: str, tool_call_id: str, *, live: bool | None = None) -> ToolEffectRecord | None:
        """The merged effect; `live` is whether its run reads `running` (looked up when not given)."""
        state = self._db(run_id).get_state(EFFECT.key(run_id, tool_call_id), EffectState)
        if state is None:
            return None
        resolutions = [
            EffectResolution(
                resolution=r['resolution'],
                resolved_by=r['resolved_by'],
                writer_id=r['writer_id'],
                resolved_at=from_micros(r['at']),
                note=r['note'],
                resolves_seq=r['seq'],
                applied=r['offset'] == state.resolved_offset,
            )
            for r in state.resolutions
        ]
        resolution = next((r for r in resolutions if r.applied), None)
        return ToolEffectRecord(
            tool_call_id=state.tool_call_id,
            tool_name=state.tool_name,
            run_id=state.run_id,
            status='resolved' if resolution is not None else state.status,  # type: ignore[arg-type]
            started_at=_ts(state.started_at),
            ended_at=resolution.resolved_at if resolution is not None else _ts(state.ended_at),
            idempotency_key=state.idempotency_key,
            effect_summary=state.effect_summary,
            error=state.error,
            last_seq=state.last_seq,
            status_seq=state.status_seq,
            resolution=resolution,
            resolutions=resolutions,
            in_flight=resolution is None
            and state.status == 'started'
            and (self._live(run_id) if live is None else live),
        )


async def continue_run(
    reader: ProjectionReader, *, run_id: str, include_interrupted: bool = False
) -> list[ModelMessage]:
    """The latest continuable history of a run, ready for `Agent.run(message_history=...)`.

    Only `complete` snapshots unless `include_interrupted=True` (check
    `list_unresolved_tool_effects` before resuming from an interrupted one). Raises
    `LookupError` when the run has no such snapshot, and `ContentErased` when its content was
    erased (`stepstream forget`).
    """
    snapshot = await reader.latest_snapshot(run_id, include_interrupted=include_interrupted)
    if snapshot is None:
        kind = 'snapshot' if include_interrupted else 'complete snapshot'
        raise LookupError(f'no {kind} for run_id {run_id!r} in the projection')
    return _content(snapshot)


async def fork_run(
    reader: ProjectionReader,
    *,
    run_id: str,
    snapshot_seq: int | None = None,
    include_interrupted: bool = False,
) -> list[ModelMessage]:
    """The messages of any retained snapshot, to start a new run from.

    Without `snapshot_seq`, the latest complete one (or the latest of any state with
    `include_interrupted=True`), as `continue_run` picks it.
    """
    if snapshot_seq is None:
        return await continue_run(reader, run_id=run_id, include_interrupted=include_interrupted)
    snapshot = await reader.get_snapshot(run_id, snapshot_seq)
    if snapshot is None:
        raise LookupError(f'run_id {run_id!r} has no snapshot {snapshot_seq} in the projection')
    return _content(snapshot)


def _content(snapshot: ContinuableSnapshot) -> list[ModelMessage]:
    if snapshot.erased:
        raise ContentErased(
            f'the content of run {snapshot.run_id!r} (conversation {snapshot.conversation_id!r}) was '
            'erased: its structure remains, its messages cannot be continued from'
        )
    return snapshot.messages


@dataclass(kw_only=True)
class ProjectionStatus:
    """What `stepstream status` shows besides the lag (which needs the broker)."""

    offsets: dict[tuple[str, int], int]
    """(topic, partition) -> the next offset the projection will apply."""
    applied_per_second: float
    updated_at: datetime | None
    dead_lettered: int
    dead_lettered_by_reason: dict[str, int]
    conflicting_runs: int
    parked_records: int
    """Records waiting for their run's `run_started`, which has not arrived (in no other view)."""
    state: str | None
    """`live`, `rebuilding` (an unfinished rebuild: resume it) or `rebuilt`; None before the first start."""
    topic_prefix: str | None
    max_snapshots_per_run: int | None
    shards: list[int] = field(default_factory=list)
    """The partition numbers whose shards this reader sees."""
    missing_shards: list[int] = field(default_factory=list)
    """Partitions with no shard here (moving, on another host's member, or not made yet)."""
    writers: dict[int, int | None] = field(default_factory=dict)
    """Partition -> the pid of the projector applying its shard now; None: no projector does."""
    last_batch_at: dict[int, datetime | None] = field(default_factory=dict)
    """Partition -> when its projector last committed a batch to the shard."""


@dataclass(kw_only=True)
class RecoveryReport:
    """What an orchestrator needs to decide how to resume a run."""

    run: RunRecord | None
    latest_snapshot: ContinuableSnapshot | None
    """The newest snapshot of any state."""
    latest_complete_snapshot: ContinuableSnapshot | None
    unresolved: list[ToolEffectRecord]
    """Calls that have not ended: `unknown_after_crash` (they may or may not have happened) or,
    while the run is live, `in_flight` (each says which: `effect.doubt`)."""
    completed_tools: list[str]
    failed_tools: list[str]
    snapshot_error: str | None = None
    """Why the snapshots could not be reconstructed, when the log broke their chain."""


async def inspect_recovery(reader: ProjectionReader, *, run_id: str) -> RecoveryReport:
    """Everything about a run's resumability in one call.

    A snapshot chain the log broke (a missing or corrupt delta) leaves the snapshots None and
    says why in `snapshot_error`; the ledger is reported all the same.
    """
    effects = await reader.list_tool_effects(run_id)
    latest = latest_complete = None
    snapshot_error = None
    try:
        latest = await reader.latest_snapshot(run_id, include_interrupted=True)
        latest_complete = await reader.latest_snapshot(run_id)
    except StepStreamError as exc:
        snapshot_error = str(exc)
    return RecoveryReport(
        run=await reader.get_run(run_id),
        latest_snapshot=latest,
        latest_complete_snapshot=latest_complete,
        unresolved=await reader.list_unresolved_tool_effects(run_id),
        completed_tools=[e.tool_name for e in effects if e.status == 'completed'],
        failed_tools=[e.tool_name for e in effects if e.status == 'failed'],
        snapshot_error=snapshot_error,
    )
