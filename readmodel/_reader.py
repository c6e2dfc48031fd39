"""`ProjectionReader`: the read half of the harness `StepStore`, over the RocksDB projection.

The reader opens the shards (`_shards.py`) and composes one view per shape over them: runs,
lineage, events, snapshots, tool effects, status, retention. Each query method hands its call to
its view; the views share the reader's shards and settings, which nothing changes once it is open.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Self, Unpack

from stepstream.erasure import KeyRing
from stepstream.readmodel._conversation import Conversation, ConversationCursor
from stepstream.readmodel._conversation_group import ConversationMember
from stepstream.readmodel._conversations import Conversations
from stepstream.readmodel._effects import Effects, UnresolvedCursor, UnresolvedSummary
from stepstream.readmodel._events import Events
from stepstream.readmodel._lineage import Lineage
from stepstream.readmodel._retention import Retention
from stepstream.readmodel._runs import DEFAULT_STALE_AFTER_S, RunCounts, Runs
from stepstream.readmodel._shards import ReadableShard, Shards
from stepstream.readmodel._snapshots import Snapshots
from stepstream.readmodel._status import ProjectionStatus, Status
from stepstream.readmodel._waiting import Waiting, WaitingCall, WaitingQuery
from stepstream.schemas import ContinuableSnapshot, RunRecord, StepEvent, ToolEffectRecord
from stepstream.storage import LiveShards, RetentionPreview, RetentionState, check_projection

if TYPE_CHECKING:
    from stepstream.media import MediaStore
    from stepstream.settings import Settings


class HoldsShards(Protocol):
    """What holds shards open in this process and writes them: a `Projector`."""

    def live_shards(self) -> LiveShards:
        """The shards it holds, and how to open what they hold."""
        ...


class ProjectionReader:
    """Async queries over a projection: runs, lineage, events, snapshots, tool effects.

    From the projector's process use `ProjectionReader.of(projector)`; from any other process
    `ProjectionReader.from_settings(settings)` (or `ProjectionReader.open(path)`), which opens
    every shard as a RocksDB secondary instance and catches up with the writers before every
    query. A run's own reads go to its shard (the producer's partitioner decides which); lists
    merge the shards in key order. A read that needs a shard the reader cannot see raises
    `ShardUnavailable` naming the partition, never a partial answer.
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
        scope: Callable[[], Collection[int] | None] | None = None,
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
        `scope` (a group member's) names, at each query, the partitions lists and sweeps cover: the
        member's own, whose answers its service merges with the other members'; None: every one.
        """
        if stale_after_s < 0:
            raise ValueError(f'stale_after_s must not be negative, got {stale_after_s}')
        self._shards = Shards(
            shards, partitions=partitions, secondary=secondary, owns_db=owns_db, scope=scope
        )
        self._runs = Runs(self._shards, timedelta(seconds=stale_after_s))
        self._lineage = Lineage(self._shards, self._runs)
        self._events = Events(self._shards)
        self._snapshots = Snapshots(self._shards, media_store, keys)
        self._effects = Effects(self._shards, self._runs, keys)
        self._status = Status(self._shards, self._runs)
        self._retention = Retention(self._shards, self._snapshots)
        self._waiting = Waiting(self._shards, self._effects, self._runs)
        self._conversations = Conversations(self._shards, self._runs, keys)
        self._owned_keys: KeyRing | None = None

    @classmethod
    def of(cls, projector: HoldsShards) -> ProjectionReader:
        """A reader over the shards a projector of this process holds open (always current).

        ```python
        reader = ProjectionReader.of(projector)
        ```
        """
        live = projector.live_shards()
        return cls(
            live.view,
            partitions=live.partitions,
            media_store=live.media_store,
            stale_after_s=live.stale_after_s,
            keys=live.keys,
            scope=live.scope,
        )

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

        Give `media_store` (e.g. `S3MediaStore.from_settings(settings.media)`) to read snapshots whose
        large payloads were offloaded, and `keys` (`KeyRing(settings)`) when erasure is on.
        """
        root = check_projection(path, create=False)
        reader = cls(
            {}, secondary=True, owns_db=True, media_store=media_store, stale_after_s=stale_after_s, keys=keys
        )
        try:
            reader._shards.open_under(root)
        except BaseException:
            reader.close()
            raise
        return reader

    @classmethod
    def from_settings(cls, settings: Settings, *, media_store: MediaStore | None = None) -> ProjectionReader:
        """The projection at `settings.projection.db_path`, as every reader outside its projector opens it.

        Its media store is the settings' S3 bucket (or `media_store`), stale runs are judged by
        `settings.liveness.stale_after_s`, and with erasure on it reads the conversation keys itself (a
        `KeyRing` it closes with the reader). Close it with `aclose`, or use it as
        `async with ProjectionReader.from_settings(settings) as reader:`.
        """
        from stepstream.media import S3MediaStore

        keys = KeyRing(settings) if settings.security.erasure_key is not None else None
        reader = cls.open(
            settings.projection.db_path,
            media_store=media_store
            if media_store is not None
            else S3MediaStore.from_settings(settings.media),
            stale_after_s=settings.liveness.stale_after_s,
            keys=keys,
        )
        reader._owned_keys = keys
        return reader

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """`close`, and stop reading the conversation keys if this reader started that."""
        self.close()
        if self._owned_keys is not None:
            keys, self._owned_keys = self._owned_keys, None
            await keys.close()

    def close(self) -> None:
        """Release the database handles if this reader opened them."""
        self._shards.close()

    @property
    def media_store(self) -> MediaStore | None:
        """Where offloaded payloads are restored from (None: a snapshot that needs one fails)."""
        return self._snapshots.media_store

    @property
    def keys(self) -> KeyRing | None:
        """The conversation keys sealed content opens with (erasure on), or None."""
        return self._snapshots.keys

    @property
    def root(self) -> Path | None:
        """The projection directory this reader opened (`open`, `from_settings`), or None (`of`)."""
        return self._shards.root

    @property
    def stale_after(self) -> timedelta:
        """How long a `running` run may go without a record before it reads as `stale`."""
        return self._runs.stale_after

    # -- runs and lineage (`_runs.py`, `_lineage.py`) ----------------------------------------------

    async def get_run(self, run_id: str) -> RunRecord | None:
        """The run's lineage and status, or None if the projection has not seen it."""
        return await self._runs.get_run(run_id)

    async def require_run(self, run_id: str) -> RunRecord:
        """The run, or `NotFound` saying whether retention dropped it.

        Every view of one run (the CLI's, the API's, the explorer's) fails this way for an id it
        does not hold.
        """
        return await self._runs.require_run(run_id)

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
        chain: str | None = None,
    ) -> list[RunRecord]:
        """Runs matching every given filter, in the order they started (`newest_first` reverses it).

        Page with `limit` and `after` (the run_id of the last run of the previous page: only
        runs past it in this order). A page is a bounded walk: each shard's index is read from
        the page's start (its end when newest first, or a seek to `after`'s place) and only as
        far as the page needs, whatever the number of runs; a filter without an index of its own
        (`status`, `agent_name`) still walks until it has filled the page. With `after_started`
        (the `after` run's `started_at`) the page
        starts at that place in the order, whether or not `after` is in this listing: how a
        group's service merges pages of runs held by several members. `chain='broken'` walks
        the runs whose hash chain is broken (an index of its own).

        ```python
        page = await reader.list_runs(newest_first=True, limit=50)
        more = await reader.list_runs(newest_first=True, limit=50, after=page[-1].run_id)
        ```
        """
        return await self._runs.list_runs(
            conversation_id,
            parent_run_id,
            status,
            agent_name,
            newest_first=newest_first,
            after=after,
            after_started=after_started,
            limit=limit,
            chain=chain,
        )

    async def list_conflicts(self) -> list[RunRecord]:
        """Runs whose run_id was claimed by more than one writer, in the order they started."""
        return await self._runs.list_conflicts()

    async def expired(self, run_id: str) -> datetime | None:
        """When a run the retention policy dropped had started, or None if it was not dropped.

        What is left of an expired run is this marker: a child that names it as parent says
        `parent_expired`, and a lookup of it can say why it finds nothing.
        """
        return await self._runs.expired(run_id)

    async def run_tree(self, run_id: str) -> list[RunRecord]:
        """The run and all its descendants, depth first, children in the order they started."""
        return await self._lineage.run_tree(run_id)

    async def root_of(self, run_id: str) -> RunRecord | None:
        """The top of the run's lineage (the run itself when it has no parent)."""
        return await self._lineage.root_of(run_id)

    # -- events and snapshots (`_events.py`, `_snapshots.py`) --------------------------------------

    async def list_events(self, run_id: str) -> list[StepEvent]:
        """The run's step events in `seq` order (snapshot events included)."""
        return await self._events.list_events(run_id)

    async def latest_snapshot(
        self, run_id: str, include_interrupted: bool = False, *, restore: bool = True
    ) -> ContinuableSnapshot | None:
        """The newest `complete` snapshot (or newest of any state), or None.

        `restore` as in `list_snapshots`.
        """
        return await self._snapshots.latest_snapshot(run_id, include_interrupted, restore=restore)

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
        return await self._snapshots.list_snapshots(
            run_id, include_interrupted, after=after, limit=limit, restore=restore
        )

    async def get_snapshot(
        self, run_id: str, snapshot_seq: int, *, restore: bool = True
    ) -> ContinuableSnapshot | None:
        """One snapshot by its `snapshot_seq`, of any state, or None (`restore` as in `list_snapshots`)."""
        return await self._snapshots.get_snapshot(run_id, snapshot_seq, restore=restore)

    # -- retention and the media index (`_retention.py`) -------------------------------------------

    async def retention(self) -> tuple[int | None, list[RetentionState]]:
        """The projection's retention policy (micros; None keeps every run) and each shard's figures."""
        return await self._retention.retention()

    async def retention_preview(self, retain_us: int) -> list[RetentionPreview]:
        """What a policy of `retain_us` would drop from each shard now (to choose one before a rebuild)."""
        return await self._retention.retention_preview(retain_us)

    async def referenced_media(self) -> set[str]:
        """The sha256 digests of every payload a kept run references, over every shard.

        Only a projection built with a retention policy indexes them (`ShardUnavailable` if a
        shard is not readable here: a sweep must see every shard's references).
        """
        return await self._retention.referenced_media()

    async def media_index_versions(self) -> dict[int, int]:
        """Each shard's media index version (`Identity.media_index`), by partition."""
        return await self._retention.media_index_versions()

    async def media_read(self) -> set[str]:
        """The URI of every payload that reading a kept run's snapshots fetches, over every shard.

        Found as a reader finds them (`stepstream.media.media_read` over each snapshot's tail,
        opened with the reader's keys, JSON payloads fetched to see the references inside them),
        never from the media index, so the media sweep can check its index against it before it
        deletes anything. A run whose snapshots cannot be read (a gap in the log, messages
        Pydantic AI cannot read) counts with what its records list. Sealed content needs the
        reader's `keys` (`ErasureError` without them); erased content reads nothing.
        """
        return await self._retention.media_read()

    # -- status and tool effects (`_status.py`, `_effects.py`) -------------------------------------

    async def counts(self) -> RunCounts | None:
        """Runs per status and per agent, and the calls in doubt, from the shards' counts.

        None when a shard in scope is missing or was made before the counts (rebuild it).
        """
        return await self._shards.query(self._runs.counts)

    async def status(self) -> ProjectionStatus:
        """Where the projection stands: applied offsets, apply rate, DLQ and conflict counts."""
        return await self._status.status()

    async def unresolved_summary(self) -> UnresolvedSummary:
        """The calls that have not ended, split into in flight and in doubt, and the oldest in doubt.

        Counted from the unresolved index's keys and the live runs (the calls are not read), so a
        scrape costs about a microsecond per unended call (`bench.scrape_cost`).
        """
        return await self._effects.unresolved_summary()

    async def get_tool_effect(self, run_id: str, tool_call_id: str) -> ToolEffectRecord | None:
        """The merged effect record of one tool call, or None."""
        return await self._effects.get_tool_effect(run_id, tool_call_id)

    async def list_tool_effects(self, run_id: str) -> list[ToolEffectRecord]:
        """Every tool effect of the run, in the order the calls started."""
        return await self._effects.list_tool_effects(run_id)

    async def list_waiting(self, **query: Unpack[WaitingQuery]) -> list[WaitingCall]:
        """The deferred calls that wait for a decision, across runs, oldest first (`Waiting.list_waiting`).

        `newest_first`, `limit`, `after` (a `WaitingCall.cursor`), and filters `agent_name`,
        `conversation_id`, `deferral` (`approval`, `question`, `external`), each walked through an
        index of its own: a page reads about its own entries, however few calls match.
        """
        return await self._waiting.list_waiting(**query)

    async def list_conversations(
        self, *, limit: int | None = 50, after: ConversationCursor | None = None, archived: bool | None = None
    ) -> list[Conversation]:
        """Every conversation, newest activity first, in pages of `limit` after `after` (its `cursor`).

        Each with its runs, usage summed, and latest run (last status, live, writer); a page reads
        about `limit` x shards index entries (decision 0062). `archived` True lists only the archived
        ones, False the others (each its own index range; `Conversation.placed`), None every one.
        """
        return await self._conversations.list_conversations(limit=limit, after=after, archived=archived)

    async def search_conversations(
        self,
        words: str,
        *,
        limit: int | None = 50,
        after: ConversationCursor | None = None,
        archived: bool | None = None,
    ) -> list[Conversation]:
        """The conversations whose title or a run's user prompts hold every word of `words`, by id.

        Words are runs of letters and digits, matched whole and without case (the first 8);
        `after` is the last one's `cursor`. A page walks the first word's entries until it has
        `limit` (decision 0062).
        """
        return await self._conversations.search_conversations(
            words, limit=limit, after=after, archived=archived
        )

    async def get_conversation(self, conversation_id: str) -> Conversation | None:
        """One conversation as `list_conversations` gives it, or None when no run of it is held."""
        return await self._conversations.get_conversation(conversation_id)

    def conversation_member(self) -> ConversationMember:
        """The shards of this reader as one member's part of a group's conversations."""
        return self._conversations

    async def list_unresolved_tool_effects(
        self,
        run_id: str | None = None,
        *,
        limit: int | None = None,
        after: UnresolvedCursor | None = None,
    ) -> list[ToolEffectRecord]:
        """Effects whose latest status is `started`, oldest first: every call that has not ended.

        Each says what it is: `in_flight` while its run is live (the call may still finish),
        `unknown_after_crash` once the run is stale, failed or cancelled (it may or may not have
        happened). With `run_id`, for that run; without, across every run, so a recovering
        orchestrator can sweep them all: in pages of `limit`, each `after` the last call of the
        one before, given as its (started_at, run_id, tool_call_id).
        """
        return await self._effects.list_unresolved_tool_effects(run_id, limit=limit, after=after)
