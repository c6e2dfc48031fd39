"""The snapshots view: continuable histories rebuilt from the deltas, and `continue_run`/`fork_run`.

A snapshot record holds a delta (how many messages of the previous history it keeps, a tail, a
patch of the kept ones); a history is the replay of every delta up to its own. Sealed content
opens with the reader's keys; content whose key was destroyed reads as erased (no messages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

from stepstream.erasure import ContentErased, KeyRing, open_snapshot
from stepstream.errors import StepStreamError
from stepstream.media import NO_CONTEXT, MediaContext, MediaStore, SealedMediaStore
from stepstream.readmodel._shards import Shards
from stepstream.schemas import ContinuableSnapshot, StepEvent, decode
from stepstream.storage import EVENT, SNAPSHOT, SnapshotEntry

if TYPE_CHECKING:
    from pydantic_ai.messages import ModelMessage


class _NoMediaStore:
    """Stands in when a reader has no media store: any reference fails saying what to do."""

    def _missing(self, uri: str) -> StepStreamError:
        return StepStreamError(
            f'this snapshot refers to offloaded media ({uri}) but the reader has no media store: '
            'open it with media_store=S3MediaStore.from_settings(settings.media)'
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


class Snapshots:
    """The `SNAPSHOT` entries of a run and the step events that carry their deltas."""

    def __init__(self, shards: Shards, media_store: MediaStore | None, keys: KeyRing | None) -> None:
        self._shards = shards
        self.media_store = media_store
        self.keys = keys

    def store(self) -> MediaStore:
        """Where offloaded media is read from: the reader's store, opened with its keys."""
        store: MediaStore = self.media_store or _NoMediaStore()
        if self.keys is not None:
            store = SealedMediaStore(store, lookup=self.keys.get)
        return store

    async def latest_snapshot(
        self, run_id: str, include_interrupted: bool, *, restore: bool
    ) -> ContinuableSnapshot | None:
        """`ProjectionReader.latest_snapshot`: replays the deltas up to the one wanted."""

        def query() -> list[SnapshotEntry]:
            entries = self.entries(run_id)
            eligible = [e for e in entries if e.retained and (include_interrupted or e.state == 'complete')]
            return entries[: entries.index(eligible[-1]) + 1] if eligible else []

        entries = await self._shards.query(query)
        if not entries:
            return None
        return (await self._materialize(run_id, entries, {entries[-1].snapshot_seq}, restore=restore))[0]

    async def list_snapshots(
        self, run_id: str, include_interrupted: bool, *, after: int | None, limit: int | None, restore: bool
    ) -> list[ContinuableSnapshot]:
        """`ProjectionReader.list_snapshots`: one replay up to the page's last snapshot."""

        def query() -> tuple[list[SnapshotEntry], set[int]]:
            entries = self.entries(run_id)
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

        entries, wanted = await self._shards.query(query)
        return await self._materialize(run_id, entries, wanted, restore=restore)

    async def get_snapshot(
        self, run_id: str, snapshot_seq: int, *, restore: bool
    ) -> ContinuableSnapshot | None:
        """`ProjectionReader.get_snapshot`: a snapshot no longer retained reads as None."""

        def query() -> list[SnapshotEntry]:
            entries = self.entries(run_id)
            if not any(e.snapshot_seq == snapshot_seq and e.retained for e in entries):
                return []
            return [e for e in entries if e.snapshot_seq <= snapshot_seq]

        entries = await self._shards.query(query)
        if not entries:
            return None
        return (await self._materialize(run_id, entries, {snapshot_seq}, restore=restore))[0]

    def entries(self, run_id: str) -> list[SnapshotEntry]:
        """The run's snapshot entries in `snapshot_seq` order (in the reader's thread)."""
        return [SnapshotEntry.decode(v) for _, v in self._shards.db(run_id).scan(SNAPSHOT.prefix(run_id))]

    async def _materialize(
        self, run_id: str, entries: list[SnapshotEntry], wanted: set[int], *, restore: bool = True
    ) -> list[ContinuableSnapshot]:
        """Replay the deltas in order: each snapshot is the previous one's prefix plus its tail.

        Each tail is decoded, validated and has its media restored once, however many of the
        wanted snapshots include it.
        """
        from stepstream.media import restore_media
        from stepstream.schemas import apply_patch

        if self.keys is not None:
            await self.keys.refresh()  # a key destroyed a moment ago is gone from here on
        tails = await self._shards.query(lambda: self.tails(run_id, entries))
        if self.keys is not None and self.keys.missed and None in tails[1]:
            # A key never seen: erased long ago, or past an end the broker under-reported. Look again.
            self.keys.missed.clear()
            await self.keys.refresh(thorough=True)
            tails = await self._shards.query(lambda: self.tails(run_id, entries))
            self.keys.erased |= self.keys.missed  # read to the end twice: gone, not late
            self.keys.missed.clear()
        store = self.store()
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

    def tails(
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
            raw = self._shards.db(run_id).get(EVENT.key(run_id, entry.seq))
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
