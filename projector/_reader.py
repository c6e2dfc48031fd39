"""`ProjectionReader`: the read half of the harness `StepStore`, over the RocksDB projection."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from rocksdict import Rdict

from stepstream.errors import StepStreamError
from stepstream.media import NO_CONTEXT, MediaContext, MediaStore, restore_media
from stepstream.projector._store import key, open_db, prefix_of, scan
from stepstream.schemas import (
    ContinuableSnapshot,
    RunRecord,
    StepEvent,
    ToolEffectRecord,
    decode,
)

T = TypeVar('T')
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


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


def _ts(micros: int | None) -> datetime | None:
    return None if micros is None else _EPOCH + timedelta(microseconds=micros)


class ProjectionReader:
    """Async queries over a projection: runs, lineage, events, snapshots, tool effects.

    From the projector's process use `projector.reader()`; from any other process
    `ProjectionReader.open(path)`, which opens RocksDB as a secondary instance and catches up
    with the projector before every query.
    """

    def __init__(
        self,
        db: Rdict,
        *,
        secondary: bool = False,
        owns_db: bool = False,
        media_store: MediaStore | None = None,
    ) -> None:
        """Wrap an open projection database; `media_store` restores offloaded payloads."""
        self._db = db
        self.media_store = media_store
        self._secondary = secondary
        self._owns_db = owns_db
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    @classmethod
    def open(cls, path: str | Path, *, media_store: MediaStore | None = None) -> ProjectionReader:
        """Open a projection that a projector (maybe in another process) is writing.

        Give `media_store` (e.g. `S3MediaStore.from_settings(settings)`) to read snapshots whose
        large payloads were offloaded.
        """
        if not (Path(path) / 'CURRENT').exists():
            raise StepStreamError(f'no projection at {path}: run a projector with --db-path {path} first')
        tmp = tempfile.TemporaryDirectory(prefix='stepstream-reader-')
        reader = cls(open_db(path, secondary=tmp.name), secondary=True, owns_db=True, media_store=media_store)
        reader._tmp = tmp
        return reader

    def close(self) -> None:
        """Release the database handle if this reader opened it."""
        if self._owns_db:
            self._db.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def _query(self, fn: Callable[[], T]) -> T:
        def run() -> T:
            if self._secondary:
                self._db.try_catch_up_with_primary()
            return fn()

        return await asyncio.to_thread(run)

    # -- runs ------------------------------------------------------------------------------------

    async def get_run(self, run_id: str) -> RunRecord | None:
        """The run's lineage and status, or None if the projection has not seen it."""
        return await self._query(lambda: self._run(run_id))

    async def list_runs(
        self,
        conversation_id: str | None = None,
        parent_run_id: str | None = None,
        status: str | None = None,
        agent_name: str | None = None,
    ) -> list[RunRecord]:
        """Runs matching every given filter, in the order they started."""

        def query() -> list[RunRecord]:
            if conversation_id is not None:
                prefix = prefix_of(b'c', conversation_id)
            elif parent_run_id is not None:
                prefix = prefix_of(b'p', parent_run_id)
            else:
                prefix = b'a\x00'
            runs = []
            for k, _ in scan(self._db, prefix):
                run = self._run(k.rsplit(b'\x00', 1)[1].decode())
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
            run_ids = {k.split(b'\x00')[1].decode() for k, _ in scan(self._db, b'k\x00')}
            runs = [r for r in (self._run(run_id) for run_id in run_ids) if r is not None]
            return sorted(runs, key=lambda r: (r.started_at or _EPOCH, r.run_id))

        return await self._query(query)

    async def run_tree(self, run_id: str) -> list[RunRecord]:
        """The run and all its descendants, depth first, children in the order they started."""

        def query() -> list[RunRecord]:
            root = self._run(run_id)
            if root is None:
                return []
            tree, stack = [], [root]
            while stack:
                run = stack.pop()
                tree.append(run)
                stack.extend(reversed(self._children(run.run_id)))
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
        children = (
            self._run(k.rsplit(b'\x00', 1)[1].decode()) for k, _ in scan(self._db, prefix_of(b'p', run_id))
        )
        return [c for c in children if c is not None]

    def _run(self, run_id: str) -> RunRecord | None:
        raw = self._db.get(key(b'r', run_id))
        if raw is None:
            return None
        state: dict[str, Any] = json.loads(raw)
        return RunRecord(
            run_id=state['run_id'],
            conversation_id=state['conversation_id'],
            parent_run_id=state['parent_run_id'],
            agent_name=state['agent_name'],
            metadata=state['metadata'],
            started_at=_ts(state['started_at']),
            registration_id=state['registration_id'],
            status=state['status'],
            ended_at=_ts(state['ended_at']),
            error=state['error'],
            event_count=state['event_count'],
            last_seq=state['last_seq'],
            gaps=list(state['missing']),
            conflicting_writers=list(state.get('conflicting_writers', [])),
        )

    # -- events ----------------------------------------------------------------------------------

    async def list_events(self, run_id: str) -> list[StepEvent]:
        """The run's step events in `seq` order (snapshot events included)."""

        def query() -> list[StepEvent]:
            events = []
            for _, raw in scan(self._db, prefix_of(b'e', run_id)):
                event = decode(raw)
                assert isinstance(event, StepEvent)
                events.append(event)
            return events

        return await self._query(query)

    # -- snapshots -------------------------------------------------------------------------------

    async def latest_snapshot(
        self, run_id: str, include_interrupted: bool = False
    ) -> ContinuableSnapshot | None:
        """The newest `complete` snapshot (or newest of any state), or None."""

        def query() -> ContinuableSnapshot | None:
            entries = self._snapshot_entries(run_id)
            eligible = [e for e in entries if include_interrupted or e['state'] == 'complete']
            if not eligible:
                return None
            return self._materialize(run_id, entries, [eligible[-1]['snapshot_seq']])[0]

        snapshot = await self._query(query)
        return None if snapshot is None else await self._restore(snapshot)

    async def list_snapshots(
        self, run_id: str, include_interrupted: bool = False
    ) -> list[ContinuableSnapshot]:
        """Every retained snapshot of the run, oldest first, each with its full history."""

        def query() -> list[ContinuableSnapshot]:
            entries = self._snapshot_entries(run_id)
            wanted = [
                e['snapshot_seq']
                for e in entries
                if e.get('retained', True) and (include_interrupted or e['state'] == 'complete')
            ]
            return self._materialize(run_id, entries, wanted)

        return [await self._restore(s) for s in await self._query(query)]

    async def get_snapshot(self, run_id: str, snapshot_seq: int) -> ContinuableSnapshot | None:
        """One snapshot by its `snapshot_seq`, of any state, or None."""

        def query() -> ContinuableSnapshot | None:
            entries = self._snapshot_entries(run_id)
            if not any(e['snapshot_seq'] == snapshot_seq and e.get('retained', True) for e in entries):
                return None
            return self._materialize(run_id, entries, [snapshot_seq])[0]

        snapshot = await self._query(query)
        return None if snapshot is None else await self._restore(snapshot)

    async def _restore(self, snapshot: ContinuableSnapshot) -> ContinuableSnapshot:
        store: MediaStore = self.media_store or _NoMediaStore()
        snapshot.messages = await restore_media(snapshot.messages, store)
        return snapshot

    def _snapshot_entries(self, run_id: str) -> list[dict[str, Any]]:
        return [json.loads(v) for _, v in scan(self._db, prefix_of(b's', run_id))]

    def _materialize(
        self, run_id: str, entries: list[dict[str, Any]], wanted: list[int]
    ) -> list[ContinuableSnapshot]:
        """Replay the deltas in order: each snapshot is the previous one's prefix plus its tail."""
        if not wanted:
            return []
        targets = set(wanted)
        last = max(targets)
        history: list[Any] = []
        out: list[ContinuableSnapshot] = []
        for expected, entry in enumerate(entries):
            if entry['snapshot_seq'] != expected:
                raise StepStreamError(
                    f'run {run_id!r}: snapshot {expected} is missing from the projection (a gap in the log), '
                    f'so snapshot {entry["snapshot_seq"]} cannot be reconstructed'
                )
            raw = self._db.get(key(b'e', run_id, entry['seq']))
            if raw is None:
                raise StepStreamError(f'run {run_id!r}: the event of snapshot {expected} is missing')
            event = decode(raw)
            assert isinstance(event, StepEvent) and event.snapshot is not None
            del history[entry['prefix_len'] :]
            history.extend(json.loads(event.snapshot.messages))
            if expected in targets:
                out.append(
                    ContinuableSnapshot(
                        run_id=run_id,
                        step_index=entry['step_index'],
                        messages=ModelMessagesTypeAdapter.validate_python(history),
                        snapshot_seq=expected,
                        seq=entry['seq'],
                        conversation_id=event.conversation_id,
                        parent_run_id=event.parent_run_id,
                        agent_name=event.agent_name,
                        timestamp=event.timestamp,
                        state=entry['state'],
                        idempotency_key=entry['idempotency_key'],
                    )
                )
            if expected == last:
                break
        return out

    # -- tool effects ------------------------------------------------------------------------------

    async def status(self) -> ProjectionStatus:
        """Where the projection stands: applied offsets, apply rate, DLQ and conflict counts."""

        def query() -> ProjectionStatus:
            offsets: dict[tuple[str, int], int] = {}
            for k, v in scan(self._db, b'o\x00'):
                _, topic, partition = k.split(b'\x00')
                offsets[(topic.decode(), int(partition))] = int(v)
            progress = json.loads(self._db.get(key(b'm', 'progress')) or b'{}')
            dlq = json.loads(self._db.get(key(b'm', 'dlq')) or b'{}')
            conflicts = {k.split(b'\x00')[1] for k, _ in scan(self._db, b'k\x00')}
            return ProjectionStatus(
                offsets=offsets,
                applied_per_second=float(progress.get('rate', 0.0)),
                updated_at=_ts(progress.get('at')),
                dead_lettered=int(dlq.get('count', 0)),
                conflicting_runs=len(conflicts),
            )

        return await self._query(query)

    async def get_tool_effect(self, run_id: str, tool_call_id: str) -> ToolEffectRecord | None:
        """The merged effect record of one tool call, or None."""
        return await self._query(lambda: self._effect(run_id, tool_call_id))

    async def list_tool_effects(self, run_id: str) -> list[ToolEffectRecord]:
        """Every tool effect of the run, in the order the calls started."""

        def query() -> list[ToolEffectRecord]:
            calls = [k.rsplit(b'\x00', 1)[1].decode() for k, _ in scan(self._db, prefix_of(b'x', run_id))]
            effects = [e for e in (self._effect(run_id, c) for c in calls) if e is not None]
            effects.sort(key=lambda e: (e.started_at or _EPOCH, e.tool_call_id))
            return effects

        return await self._query(query)

    async def list_unresolved_tool_effects(self, run_id: str | None = None) -> list[ToolEffectRecord]:
        """Effects whose latest status is `started` (`unknown_after_crash`), oldest first.

        With `run_id`, for that run; without, across every run, so a recovering orchestrator
        can sweep them all.
        """

        def query() -> list[ToolEffectRecord]:
            found: list[ToolEffectRecord] = []
            if run_id is not None:
                ids = [
                    (run_id, k.rsplit(b'\x00', 1)[1].decode())
                    for k, _ in scan(self._db, prefix_of(b'U', run_id))
                ]
            else:
                ids = []
                for k, _ in scan(self._db, b'u\x00'):
                    _, _, run_part, call_part = k.split(b'\x00', 3)
                    ids.append((run_part.decode(), call_part.decode()))
            for run, call in ids:
                effect = self._effect(run, call)
                if effect is not None:
                    found.append(effect)
            found.sort(key=lambda e: (e.started_at or _EPOCH, e.run_id, e.tool_call_id))
            return found

        return await self._query(query)

    def _effect(self, run_id: str, tool_call_id: str) -> ToolEffectRecord | None:
        raw = self._db.get(key(b'x', run_id, tool_call_id))
        if raw is None:
            return None
        state = json.loads(raw)
        return ToolEffectRecord(
            tool_call_id=state['tool_call_id'],
            tool_name=state['tool_name'],
            run_id=state['run_id'],
            status=state['status'],
            started_at=_ts(state['started_at']),
            ended_at=_ts(state['ended_at']),
            idempotency_key=state['idempotency_key'],
            effect_summary=state['effect_summary'],
            error=state['error'],
            last_seq=state['last_seq'],
        )


async def continue_run(
    reader: ProjectionReader, *, run_id: str, include_interrupted: bool = False
) -> list[ModelMessage]:
    """The latest continuable history of a run, ready for `Agent.run(message_history=...)`.

    Only `complete` snapshots unless `include_interrupted=True` (check
    `list_unresolved_tool_effects` before resuming from an interrupted one). Raises
    `LookupError` when the run has no such snapshot.
    """
    snapshot = await reader.latest_snapshot(run_id, include_interrupted=include_interrupted)
    if snapshot is None:
        kind = 'snapshot' if include_interrupted else 'complete snapshot'
        raise LookupError(f'no {kind} for run_id {run_id!r} in the projection')
    return snapshot.messages


async def fork_run(
    reader: ProjectionReader, *, run_id: str, snapshot_seq: int | None = None
) -> list[ModelMessage]:
    """The messages of any retained snapshot (default: the latest complete), to start a new run from."""
    if snapshot_seq is None:
        return await continue_run(reader, run_id=run_id)
    snapshot = await reader.get_snapshot(run_id, snapshot_seq)
    if snapshot is None:
        raise LookupError(f'run_id {run_id!r} has no snapshot {snapshot_seq} in the projection')
    return snapshot.messages


@dataclass(kw_only=True)
class ProjectionStatus:
    """What `stepstream status` shows besides the lag (which needs the broker)."""

    offsets: dict[tuple[str, int], int]
    """(topic, partition) -> the next offset the projection will apply."""
    applied_per_second: float
    updated_at: datetime | None
    dead_lettered: int
    conflicting_runs: int


@dataclass(kw_only=True)
class RecoveryReport:
    """What an orchestrator needs to decide how to resume a run."""

    run: RunRecord | None
    latest_snapshot: ContinuableSnapshot | None
    """The newest snapshot of any state."""
    latest_complete_snapshot: ContinuableSnapshot | None
    unresolved: list[ToolEffectRecord]
    """Effects in `unknown_after_crash`: they may or may not have happened."""
    completed_tools: list[str]
    failed_tools: list[str]


async def inspect_recovery(reader: ProjectionReader, *, run_id: str) -> RecoveryReport:
    """Everything about a run's resumability in one call."""
    effects = await reader.list_tool_effects(run_id)
    return RecoveryReport(
        run=await reader.get_run(run_id),
        latest_snapshot=await reader.latest_snapshot(run_id, include_interrupted=True),
        latest_complete_snapshot=await reader.latest_snapshot(run_id),
        unresolved=[e for e in effects if e.unknown_after_crash],
        completed_tools=[e.tool_name for e in effects if e.status == 'completed'],
        failed_tools=[e.tool_name for e in effects if e.status == 'failed'],
    )
