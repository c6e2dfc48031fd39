"""What the service reads: the projection, the media store, and what only the broker knows.

The projection is read through `ProjectionReader` only; the broker gives end offsets (for the
lag) and the DLQ's records.

The API and the explorer both call this one class, so a page and its JSON twin cannot disagree.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter

from stepstream.erasure import ContentErased
from stepstream.errors import BadCursor, NotFound, StepStreamError, UsageError
from stepstream.media import (
    MediaContext,
    MediaStore,
    SealedMediaStore,
    link_media,
    media_uri_for,
    parse_media_uri,
)
from stepstream.producer import StepLog
from stepstream.readmodel import ProjectionReader, UnresolvedCursor
from stepstream.schemas import (
    ContinuableSnapshot,
    Resolution,
    RunRecord,
)
from stepstream.serve._broker import dead_letters as read_dead_letters
from stepstream.serve._broker import status_with_lag
from stepstream.serve._group import NotFoundThere, Peers, forwarded
from stepstream.serve._models import (
    Counts,
    DeadLetters,
    Event,
    Lineage,
    Resolved,
    Run,
    RunPage,
    Snapshot,
    SnapshotPage,
    SnapshotSummary,
    Status,
    ToolEffect,
    TreeNode,
    counts_total,
)
from stepstream.serve._resolutions import Resolutions
from stepstream.settings import Settings

MEDIA_PATH = '/api/media/'
UNRESOLVED_AFTER = ('after_started', 'after_run_id', 'after_tool_call_id')
"""The query parameters of a place in the unresolved sweep (`UnresolvedCursor`), in its order."""
"""Where the service serves offloaded media by SHA-256, after checking the bytes against it."""


class Source:
    """The read model of one service: a `ProjectionReader`, a media store, and the broker."""

    def __init__(
        self,
        settings: Settings,
        reader: ProjectionReader,
        media_store: MediaStore | None,
        log: StepLog | None = None,
        peers: Peers | None = None,
    ) -> None:
        """Serve `reader`'s projection; `media_store` serves offloaded media (None: links fail).

        `log` takes the operators' resolutions; without one, an `EventLog` of the settings is
        started on the first resolution and closed by `aclose`. `peers`, for a group member:
        a run's reads go to the member owning its partition, lists merge every member's part.
        """
        self.settings = settings
        self.reader = reader
        self.media_store = media_store
        self.peers = peers
        if (
            settings.security.erasure_key is not None
        ):  # erasure on: sealed content and media open with the keys
            if reader.keys is None:
                raise UsageError(
                    'erasure is on (STEPSTREAM_ERASURE_KEY) but the reader has no conversation keys: '
                    'open it with ProjectionReader.from_settings(settings) '
                    'or take ProjectionReader.of(projector)'
                )
            if media_store is not None:
                self.media_store = SealedMediaStore(media_store, lookup=reader.keys.get)
        self._resolutions = Resolutions(settings, reader, log)

    async def aclose(self) -> None:
        """Close the log this source started, if it did, and the client to the other members."""
        if self.peers is not None:
            await self.peers.aclose()
        await self._resolutions.aclose()

    # -- a group's members -------------------------------------------------------------------------

    def _owner(self, run_id: str) -> str | None:
        """The member that answers for `run_id` when it is not this one."""
        return None if self.peers is None else self.peers.owner_of(run_id)

    def _merging(self) -> bool:
        """Whether lists are merged from every member (a group's service, asked by a client)."""
        # A member's reader lists only its own partitions (`Projector.reader`); the others' come
        # from them, unless this request was itself forwarded by a member.
        return self.peers is not None and not forwarded.get()

    async def _there(self, url: str, path: str, *, method: str = 'GET', **kwargs: Any) -> Any:
        assert self.peers is not None
        try:
            return await self.peers.ask(url, method, path, **kwargs)
        except NotFoundThere as exc:
            raise NotFound(str(exc)) from None

    async def _everyone(self, path: str, params: dict[str, Any] | None = None) -> list[Any]:
        """Every other member's answer to `path` (each answering from its own shards)."""
        assert self.peers is not None
        return list(
            await asyncio.gather(*(self._there(url, path, params=params) for url in self.peers.others()))
        )

    # -- runs --------------------------------------------------------------------------------------

    async def runs(
        self,
        *,
        conversation_id: str | None = None,
        parent_run_id: str | None = None,
        status: str | None = None,
        agent_name: str | None = None,
        chain: str | None = None,
        newest_first: bool = False,
        after: str | None = None,
        after_started: datetime | None = None,
        limit: int = 50,
    ) -> RunPage:
        """One page of runs matching the filters (`after_started`: see `ProjectionReader.list_runs`).

        In a group, every member's page is asked for and the pages are merged in the listing's
        order, so the page is the one a reader of every shard would give.
        """
        merging = self._merging()
        if merging and after is not None and after_started is None:
            try:
                after_started = (await self.run(after)).started_at
            except NotFound:  # a bad parameter, never a 404 (members read one as "not here")
                raise BadCursor(f'after={after!r} is not a run of this listing') from None
        filters = {
            'conversation_id': conversation_id,
            'parent_run_id': parent_run_id,
            'status': status,
            'agent_name': agent_name,
            'chain': chain,
        }
        try:
            local = await self.reader.list_runs(
                **filters,
                newest_first=newest_first,
                after=after,
                after_started=after_started,
                limit=limit + 1,
            )
        except LookupError as exc:
            raise BadCursor(str(exc)) from None
        parts = [[Run.of(r) for r in local]]
        more = len(local) > limit
        if merging:
            params = {
                **filters,
                'order': '-started' if newest_first else 'started',
                'after': after,
                'after_started': after_started.isoformat() if after_started is not None else None,
                'limit': limit,
            }
            for answer in await self._everyone('/api/runs', params):
                page = RunPage.model_validate(answer)
                parts.append(page.runs)
                more = more or page.next_after is not None
        merged = list(heapq.merge(*parts, key=_started_order, reverse=newest_first))
        page_runs = merged[:limit]
        more = more or len(merged) > limit
        return RunPage(runs=page_runs, next_after=page_runs[-1].run_id if more and page_runs else None)

    async def run_record(self, run_id: str) -> RunRecord:
        """The run, or `NotFound` (`ProjectionReader.require_run`)."""
        return await self.reader.require_run(run_id)

    async def run(self, run_id: str) -> Run:
        """The run, or `NotFound`."""
        if url := self._owner(run_id):
            return Run.model_validate(await self._there(url, _run_path(run_id)))
        return Run.of(await self.run_record(run_id))

    async def events(self, run_id: str) -> list[Event]:
        """The run's step events in seq order."""
        if url := self._owner(run_id):
            return [Event.model_validate(e) for e in await self._there(url, _run_path(run_id, '/events'))]
        await self.run_record(run_id)
        return [Event.of(e) for e in await self.reader.list_events(run_id)]

    async def effects(self, run_id: str) -> list[ToolEffect]:
        """The run's tool effects in the order the calls started."""
        if url := self._owner(run_id):
            answer = await self._there(url, _run_path(run_id, '/tool-effects'))
            return [ToolEffect.model_validate(e) for e in answer]
        await self.run_record(run_id)
        return [ToolEffect.of(e) for e in await self.reader.list_tool_effects(run_id)]

    async def lineage(self, run_id: str) -> Lineage:
        """The root of the run's lineage and the tree under it."""
        if self.peers is not None:
            return await self._group_lineage(run_id)
        root = await self.reader.root_of(run_id)
        if root is None:
            raise NotFound(f'no run {run_id!r} in the projection')
        tree = await self.reader.run_tree(root.run_id)
        depth = {root.run_id: 0}
        nodes = []
        for run in tree:
            depth.setdefault(run.run_id, depth.get(run.parent_run_id or '', -1) + 1)
            nodes.append(TreeNode(depth=depth[run.run_id], run=Run.of(run)))
        return Lineage(root=Run.of(root), tree=nodes)

    async def _group_lineage(self, run_id: str) -> Lineage:
        """`lineage` across members: parents and children may be in any member's shards."""
        root, seen = await self.run(run_id), {run_id}
        while root.parent_run_id is not None and root.parent_run_id not in seen:
            seen.add(root.parent_run_id)
            try:
                root = await self.run(root.parent_run_id)
            except NotFound:
                break
        nodes: list[TreeNode] = []
        stack, placed = [(root, 0)], {root.run_id}
        while stack:
            run, depth = stack.pop()
            nodes.append(TreeNode(depth=depth, run=run))
            children = [
                c
                for c in (await self.runs(parent_run_id=run.run_id, limit=1000)).runs
                if c.run_id not in placed
            ]
            placed.update(c.run_id for c in children)
            stack.extend((c, depth + 1) for c in reversed(children))
        return Lineage(root=root, tree=nodes)

    async def unresolved(
        self, *, limit: int = 1000, after: UnresolvedCursor | None = None
    ) -> list[ToolEffect]:
        """Unended effects (`in_flight` or `unknown_after_crash`) across all runs, oldest first.

        At most `limit`, after the call at `after`; a group's members' pages are merged.
        """
        parts = [
            [
                ToolEffect.of(e)
                for e in await self.reader.list_unresolved_tool_effects(limit=limit, after=after)
            ]
        ]
        if self._merging():
            cursor = (
                {}
                if after is None
                else dict(zip(UNRESOLVED_AFTER, (after[0].isoformat(), *after[1:]), strict=True))
            )
            for answer in await self._everyone('/api/unresolved', {'limit': limit, **cursor}):
                parts.append([ToolEffect.model_validate(e) for e in answer])
        return list(itertools.islice(heapq.merge(*parts, key=_effect_order), limit))

    # -- the one write: an operator's resolution ----------------------------------------------------

    async def resolve(
        self,
        run_id: str,
        tool_call_id: str,
        *,
        resolution: Resolution,
        note: str,
        operator: str | None,
        force: bool = False,
    ) -> Resolved:
        """Append an operator's resolution of an `unknown_after_crash` effect to the log.

        `NotFound` for an unknown run or call, `NotUnknown` for an effect that is not unknown
        (`EffectInFlight` for a call still in flight, unless `force`).
        Returns once the broker acknowledged it, and once this service's projection shows it
        or the settings' timeout passed (`applied` says which). In a group, the member that
        owns the run's partition writes it.
        """
        if url := self._owner(run_id):
            body = {'resolution': resolution, 'note': note, 'operator': operator, 'force': force}
            path = _run_path(run_id, f'/tool-effects/{quote(tool_call_id, safe="")}/resolution')
            return Resolved.model_validate(await self._there(url, path, method='POST', body=body))
        await self.run_record(run_id)
        return await self._resolutions.write(
            run_id, tool_call_id, resolution=resolution, note=note, operator=operator, force=force
        )

    async def conflicts(self) -> list[Run]:
        """Runs whose run_id more than one writer claimed."""
        merging = self._merging()
        parts = [[Run.of(r) for r in await self.reader.list_conflicts()]]
        if merging:
            for answer in await self._everyone('/api/conflicts'):
                parts.append([Run.model_validate(r) for r in answer])
        return list(heapq.merge(*parts, key=_started_order))

    # -- snapshots ---------------------------------------------------------------------------------

    async def snapshots(self, run_id: str, *, after: int | None = None, limit: int = 100) -> SnapshotPage:
        """A page of the run's retained snapshots (any state), without their messages."""
        if url := self._owner(run_id):
            answer = await self._there(
                url, _run_path(run_id, '/snapshots'), params={'after': after, 'limit': limit}
            )
            return SnapshotPage.model_validate(answer)
        await self.run_record(run_id)
        found = await self.reader.list_snapshots(
            run_id, include_interrupted=True, after=after, limit=limit + 1, restore=False
        )
        page = found[:limit]
        return SnapshotPage(
            snapshots=[_summary(s) for s in page],
            next_after=page[-1].snapshot_seq if len(found) > limit else None,
        )

    async def snapshot(self, run_id: str, snapshot_seq: int | None = None) -> ContinuableSnapshot:
        """One snapshot (the latest of any state without `snapshot_seq`), media as links."""
        if self._owner(run_id):
            snap = await self.snapshot_json(run_id, snapshot_seq)
            return ContinuableSnapshot(
                run_id=snap.run_id,
                step_index=snap.step_index,
                messages=ModelMessagesTypeAdapter.validate_python(snap.messages),
                snapshot_seq=snap.snapshot_seq,
                seq=snap.seq,
                timestamp=snap.timestamp,
                state='complete' if snap.state == 'complete' else 'interrupted',
                idempotency_key=snap.idempotency_key,
                erased=snap.erased,
            )
        if snapshot_seq is None:
            latest = await self.reader.list_snapshots(run_id, include_interrupted=True, restore=False)
            found = latest[-1] if latest else None
        else:
            found = await self.reader.get_snapshot(run_id, snapshot_seq, restore=False)
        if found is None:
            which = 'any snapshot' if snapshot_seq is None else f'snapshot {snapshot_seq}'
            raise NotFound(f'run {run_id!r} has no {which} in the projection')
        if self.media_store is None:
            return found
        found.messages = await link_media(found.messages, self.media_store, self._link)
        return found

    async def snapshot_json(self, run_id: str, snapshot_seq: int | None = None) -> Snapshot:
        """`snapshot` in the API's shape: the messages as Pydantic AI's JSON."""
        if url := self._owner(run_id):
            which = 'latest' if snapshot_seq is None else str(snapshot_seq)
            return Snapshot.model_validate(await self._there(url, _run_path(run_id, f'/snapshots/{which}')))
        snap = await self.snapshot(run_id, snapshot_seq)
        return Snapshot(**_summary(snap).model_dump(), messages=messages_json(snap.messages))

    async def _link(self, uri: str, media_type: str) -> str:
        assert self.media_store is not None
        public = await self.media_store.public_url(uri, MediaContext(media_type=media_type))
        if public is not None:
            return public
        return f'{MEDIA_PATH}{parse_media_uri(uri)}?media_type={media_type}'

    async def media(self, sha256: str, media_type: str) -> bytes:
        """The bytes whose SHA-256 is `sha256`, from the media store, checked against it."""
        if self.media_store is None:
            raise NotFound('this service has no media store')
        uri = 'media+sha256://' + sha256
        parse_media_uri(uri)  # ValueError for anything but 64 lowercase hex digits
        try:
            data = await self.media_store.get(uri, MediaContext(media_type=media_type))
        except (LookupError, ContentErased) as exc:
            raise NotFound(str(exc)) from None
        if isinstance(self.media_store, SealedMediaStore):
            return data  # the store checked the sealed bytes' hash, and AES-GCM the plaintext
        if media_uri_for(data) != uri:  # the store checks too; a link is only served verified
            raise StepStreamError(f'the media store returned other bytes for {uri}')
        return data

    async def counts(self) -> Counts | None:
        """Runs per status and agent, and the calls in doubt (a group's summed); None: not counted."""
        local = await self.reader.counts()
        parts = [None if local is None else Counts.of(local)]
        if self._merging():
            parts += [
                None if p is None else Counts.model_validate(p) for p in await self._everyone('/api/counts')
            ]
        return None if None in parts else counts_total([p for p in parts if p is not None])

    # -- the broker (serve/_broker.py) -------------------------------------------------------------

    async def status(self) -> Status:
        """The projection's status with each partition's lag (end offsets from the broker)."""
        return await status_with_lag(self.settings, self.reader)

    async def dead_letters(self, limit: int = 50) -> DeadLetters:
        """The newest `limit` records of the DLQ topic, newest first, read by a short-lived consumer."""
        return await read_dead_letters(self.settings, limit)


def messages_json(messages: list[ModelMessage]) -> list[dict[str, Any]]:
    """Pydantic AI's own JSON of a history, as Python values."""
    dumped: list[dict[str, Any]] = ModelMessagesTypeAdapter.dump_python(messages, mode='json')
    return dumped


def _summary(snap: ContinuableSnapshot) -> SnapshotSummary:
    return SnapshotSummary(
        run_id=snap.run_id,
        snapshot_seq=snap.snapshot_seq,
        seq=snap.seq,
        step_index=snap.step_index,
        state=snap.state,
        timestamp=snap.timestamp,
        idempotency_key=snap.idempotency_key,
        message_count=len(snap.messages),
        erased=snap.erased,
    )


def _run_path(run_id: str, rest: str = '') -> str:
    return f'/api/runs/{quote(run_id, safe="")}{rest}'


_NEVER = datetime.min.replace(tzinfo=UTC)


def _started_order(run: Run) -> tuple[datetime, str]:
    """The order of the runs indexes (decision 0009): when the run started, then its id."""
    return (run.started_at or _NEVER, run.run_id)


def _effect_order(effect: ToolEffect) -> tuple[datetime, str, str]:
    """The order of the unresolved sweep: when the call started, then run and call."""
    return (effect.started_at or _NEVER, effect.run_id, effect.tool_call_id)
