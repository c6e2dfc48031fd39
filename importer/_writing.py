"""One reference run as the records of its own writer: what the capability would have appended.

The run's records are built by the producer's own `RunWriter` (ids, `seq`, the hash chain,
redaction, signing) and `SnapshotWriter` (delta snapshots, media offload; sealed by the log's
`Sealer` when erasure is on), so an imported run reads, audits and replays like a written one.
What differs is where the values come from: the timestamps, step indexes, idempotency keys,
errors and metadata are the store's, as it recorded them. The reference keeps a run's events,
snapshots and ledger apart; they are put in one order by their timestamps, each kind keeping its
own stored order (`ordered`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, Literal

from stepstream.errors import RecordTooLarge
from stepstream.importer._reference import (
    DamagedStore,
    ReferenceEffect,
    ReferenceEvent,
    ReferenceRun,
    ReferenceSnapshot,
)
from stepstream.media import MediaStore
from stepstream.producer import REDACTION_KEY, Redaction, RunWriter, SnapshotWriter, StepLog
from stepstream.schemas import LogRecord
from stepstream.signing import Signer

IMPORTED_KEY = 'stepstream.imported_from'
"""The `run_started` metadata key of an imported run: what it was imported from (`pydantic-ai-harness`)."""

REGISTRATION_KEY = 'stepstream.imported_registration_id'
"""The `run_started` metadata key keeping the reference's `registration_id`, when it had one."""

WRITER_PREFIX = 'stepstream-import@'


def import_writer_id(run_id: str, started_at: datetime) -> str:
    """The writer of an imported run: a function of the run alone, so every import of it is one writer.

    ```python
    import_writer_id('support-1', started)  # 'stepstream-import@3f2a9c01d4e5b6a7'
    ```

    A resumed import, in another process or on another host, continues the run as its owner,
    and records it sends again are duplicates of the same writer's, which the projector ignores.
    """
    digest = hashlib.sha256(f'{run_id}\x00{started_at.isoformat()}'.encode('utf-8', 'surrogatepass'))
    return WRITER_PREFIX + digest.hexdigest()[:16]


Transition = tuple[Literal['started', 'annotated', 'completed', 'failed'], ReferenceEffect, datetime, bool]
"""A ledger transition: its status, its record, its time, whether it carries the key and summary."""

Step = tuple[str, Any]
"""One record to write: `('start' | 'event' | 'snapshot' | 'transition', what it is made of)`."""


def transitions(effects: list[ReferenceEffect]) -> list[Transition]:
    """The ledger's records as transitions, by time (each call's `started` before its end).

    A file store keeps every record the reference wrote of a call, a SQLite store only the latest:
    a call that ended is a `started` at its `started_at` then its end at `ended_at`; a `started`
    record of a call already started is an `annotated` transition (`annotate_tool_effect`).
    """
    out: list[Transition] = []
    open_calls: set[str] = set()
    for e in effects:
        if e.status == 'started':
            status: Literal['started', 'annotated'] = (
                'annotated' if e.tool_call_id in open_calls else 'started'
            )
            out.append((status, e, e.started_at, True))
            open_calls.add(e.tool_call_id)
            continue
        if e.tool_call_id not in open_calls:
            out.append(('started', e, e.started_at, False))
        out.append((e.status, e, e.ended_at or e.started_at, True))
        open_calls.discard(e.tool_call_id)
    out.sort(key=lambda t: t[2])  # stable: a call's end never passes its start
    return out


def ordered(run: ReferenceRun) -> list[Step]:
    """The run's records in write order: `run_started`, then by time, each kind in its stored order."""
    events = list(run.events)
    first = next((e for e in events if e.kind == 'run_started'), None)
    if first is not None:
        events.remove(first)
    ledger: Iterator[tuple[datetime, int, Step]] = (
        (t[2], 0, ('transition', t)) for t in transitions(run.effects)
    )
    steps: Iterator[tuple[datetime, int, Step]] = ((e.timestamp, 1, ('event', e)) for e in events)
    snapshots: Iterator[tuple[datetime, int, Step]] = (
        (s.timestamp, 2, ('snapshot', s)) for s in run.snapshots
    )
    merged = heapq.merge(ledger, steps, snapshots, key=lambda item: (item[0], item[1]))
    return [('start', first), *(step for _, _, step in merged)]


class RunImport:
    """Writes one reference run with its own `RunWriter`: `count` records, `seq` 0 to `count - 1`."""

    def __init__(
        self,
        log: StepLog,
        run: ReferenceRun,
        *,
        media_store: MediaStore | None,
        threshold_bytes: int,
        redaction: Redaction,
        signer: Signer | None,
        label: str | None = None,
        store: str = 'the reference store',
    ) -> None:
        """Prepare `run` for `log`; nothing is written until `write`.

        `label` is `redaction.label`, which an import of many runs works out once.
        """
        record = run.run
        self.run = run
        self.label = label if label is not None else redaction.label
        self.store = store
        self.steps = ordered(run)
        metadata = {**record.metadata, IMPORTED_KEY: 'pydantic-ai-harness'}
        if record.registration_id is not None:
            metadata[REGISTRATION_KEY] = record.registration_id
        self.writer = RunWriter(
            log=log,
            run_id=record.run_id,
            writer_id=import_writer_id(record.run_id, record.started_at),
            agent_name=record.agent_name,
            parent_run_id=record.parent_run_id,
            metadata=redaction.metadata(metadata),
            context_run_id=None,
            durable_engine=False,
            snapshots=SnapshotWriter(media_store, threshold_bytes, redaction),
            operations=lambda: None,
            redaction=redaction,
            signer=signer,
            conversation_id=record.conversation_id,
        )

    @property
    def count(self) -> int:
        """How many records the run is on the log: one per step (signed heads are beside them)."""
        return len(self.steps)

    async def write(self, on_log: Callable[[int], bool]) -> int:
        """Append each record whose `seq` is not `on_log`, sign the head, wait for the broker; count sent.

        A record on the log already is built again, not sent: the next one links to its hash, and
        its bytes are the same (its values are the store's; media offloaded again land at the same
        content addresses). A sealed snapshot is the exception: sealing is random, so a run whose
        import was interrupted after one is linked to the record built again (decision 0060).
        """
        writer = self.writer
        built: list[tuple[LogRecord, bytes]] = []
        for seq, (kind, value) in enumerate(self.steps):
            try:  # every record built and encoded first: one the log refuses leaves nothing sent
                record = await (self._snapshot(value) if kind == 'snapshot' else self._record(kind, value))
                encoded = await writer.append(record, send=False)
            except (ValueError, RecordTooLarge) as exc:
                where = (
                    'its run record'
                    if kind == 'start'
                    else (value[1] if kind == 'transition' else value).where
                )
                raise DamagedStore(
                    f'the reference store {self.store}: run {writer.run_id!r}, {where}: the log refuses '
                    f'it ({exc}); nothing of this run was written'
                ) from None
            if not on_log(seq):
                built.append((record, encoded))
        for record, encoded in built:
            writer.unacked.append(await writer.log.send(record, encoded))
        if built:
            await writer.sign_head()
            await writer.durable(None)  # type: ignore[arg-type]  # no engine: only the acknowledgements
        return len(built)

    async def _record(self, kind: str, value: Any) -> LogRecord:
        if kind == 'start':
            return self._start(value)
        return self._event(value) if kind == 'event' else self._transition(value)

    def _start(self, event: ReferenceEvent | None) -> Any:
        writer = self.writer
        return writer.step_event(
            'run_started',
            event.step_index if event is not None else 0,
            metadata={**writer.metadata, REDACTION_KEY: self.label},
            idempotency_key=event.idempotency_key if event is not None else None,
            timestamp=self.run.run.started_at,
        )

    def _event(self, event: ReferenceEvent) -> Any:
        writer = self.writer
        writer.step_index = event.step_index
        return writer.step_event(
            event.kind,  # type: ignore[arg-type]  # the reference's kinds are stepstream's
            event.step_index,
            metadata=writer.redaction.metadata(event.metadata),
            idempotency_key=event.idempotency_key,
            tool_call_id=event.tool_call_id,
            tool_name=event.tool_name,
            error=event.error,
            timestamp=event.timestamp,
        )

    def _transition(self, transition: Transition) -> Any:
        status, effect, at, annotated = transition
        return self.writer.transition(
            effect.tool_call_id,
            effect.tool_name,
            status,
            timestamp=at,
            idempotency_key=effect.idempotency_key if annotated else None,
            effect_summary=effect.effect_summary if annotated else None,
        )

    async def _snapshot(self, snapshot: ReferenceSnapshot) -> LogRecord:
        """The snapshot as the capability saves one: a delta, media offloaded, sealed when erasure is on."""
        writer = self.writer
        snapshots = writer.snapshots
        plan = snapshots.plan(snapshot.messages)
        sealer = writer.log.sealer
        if sealer is not None:
            delta = await sealer.delta(
                snapshots,
                plan,
                writer.snapshot_seq,
                conversation_id=writer.conversation_id or writer.run_id,
                run_id=writer.run_id,
            )
        else:
            delta = await snapshots.delta(plan, writer.snapshot_seq)
        # The state the reference recorded, which it decided at the time (by the same rule).
        delta = dataclasses.replace(delta, state=snapshot.state)
        writer.step_index = snapshot.step_index
        writer.snapshot_seq += 1
        snapshots.commit(plan)
        return writer.step_event(
            'snapshot_saved',
            snapshot.step_index,
            metadata=writer.metadata,
            idempotency_key=snapshot.idempotency_key,
            snapshot=delta,
            timestamp=snapshot.timestamp,
        )
