"""Applying log records to the projection: total, idempotent and deterministic.

Every record either applies or is dead-lettered with a reason; an unexpected exception while
applying one record dead-letters that record (`apply_error`) and the batch goes on. The state
after applying a log is a function of the two partitions' record sequences alone: not of batch
boundaries, restarts, or how the consumer interleaved the two topics. The rules that make it
so are in docs/decisions/0010-conflict-rules.md; in short:

- A run is registered by the first `run_started` in its step-events partition; its writer owns
  it. Records before the registration are parked and applied when it comes; records of any
  other writer are kept apart and the run is listed under conflicts.
- A seq holds one record. A repeat with the same bytes is a duplicate (ignored); a different
  record at a held seq goes to the DLQ (`duplicate_seq`), except that a step event displaces a
  tool-effect transition at the same seq (step events win), whichever arrived first.
- A seq more than `MAX_SEQ_JUMP` above the highest accepted in its topic goes to the DLQ
  (`seq_jump`); gaps are kept as ranges.
- Each derived field is a max/min over the records that hold it (the terminal event with the
  highest seq, an effect's status from its highest-seq transition), so arrival order is moot.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from rocksdict import Rdict

from stepstream.errors import SchemaError
from stepstream.ids import check_record_ids
from stepstream.projector._keys import (
    APART,
    CHILDREN,
    CONFLICT,
    CONVERSATION,
    DLQ_COUNTS,
    EFFECT,
    EVENT,
    OFFSET,
    PARKED,
    RUN,
    RUNS,
    SNAPSHOT,
    TRANSITION,
    UNRESOLVED,
    UNRESOLVED_RUN,
    decode_int,
    encode_int,
)
from stepstream.projector._state import EffectState, RunState, SnapshotEntry, dumps, ranges_add, ranges_hold
from stepstream.projector._store import BatchTxn
from stepstream.schemas import (
    EVENT_KINDS,
    TOOL_EFFECT_STATUSES,
    LogRecord,
    StepEvent,
    ToolEffectTransition,
    decode,
)
from stepstream.topics import murmur2_partition

EVENTS, EFFECTS = 0, 1
"""Topic indexes: step events, tool effects."""

MAX_SEQ_JUMP = 1_000_000
"""How far above the highest seq accepted in its topic a run's next record may be."""

TERMINAL_KINDS = {'run_completed': 'completed', 'run_failed': 'failed'}

DLQ_REASONS = (
    'tombstone',
    'no_key',
    'not_a_record',
    'unknown_version',
    'corrupt',
    'invalid',
    'invalid_id',
    'wrong_topic',
    'wrong_key',
    'wrong_partition',
    'seq_jump',
    'duplicate_seq',
    'snapshot_conflict',
    'apply_error',
)
"""Every reason a record can be dead-lettered for (docs/decisions/0010-conflict-rules.md)."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def micros(ts: datetime) -> int:
    """A timestamp as exact integer microseconds since the epoch (how the log carries it)."""
    return (ts - _EPOCH) // _MICROSECOND


@dataclass(frozen=True, slots=True)
class SourceRecord:
    """A record as consumed: where it is in the log, and its bytes."""

    topic: int
    """`EVENTS` or `EFFECTS`."""
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """(topic, partition, offset): unique in the log."""
        return (self.topic, self.partition, self.offset)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record that cannot apply, with its reason code and a sentence for people."""

    source: SourceRecord
    reason: str
    detail: str


@dataclass(slots=True)
class BatchOutcome:
    """What applying one batch did."""

    applied: int = 0
    duplicates: int = 0
    dead: list[DeadLetter] = field(default_factory=list)
    next_offsets: dict[tuple[int, int], int] = field(default_factory=dict)
    """(topic, partition) -> the offset after the batch's last record there."""


class Rejected(Exception):
    """A record that goes to the DLQ, and why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class Applier:
    """Applies batches of source records to a projection store.

    Knows the topic names (for the offset keys), the partition count (to check that each record
    sits in its run's partition) and the projection's options. Kafka-free, so the rules can be
    tested against any generated log.
    """

    def __init__(
        self,
        topics: tuple[str, str],
        *,
        partitions: int,
        max_snapshots_per_run: int | None = None,
        max_seq_jump: int = MAX_SEQ_JUMP,
    ) -> None:
        """`topics` are the step-events and tool-effects topic names, in that order."""
        self.topics = topics
        self.partitions = partitions
        self.max_snapshots = max_snapshots_per_run
        self.max_seq_jump = max_seq_jump
        self._current: SourceRecord | None = None
        self._outcome = BatchOutcome()
        self._poisoned: Mapping[tuple[int, int, int], str] = {}

    # -- a batch -------------------------------------------------------------------------------

    def stage(self, db: Rdict, records: Sequence[SourceRecord]) -> tuple[BatchTxn, BatchOutcome]:
        """Stage a batch (state, DLQ counts and next offsets) in one transaction, not committed.

        An unexpected exception while applying a record marks that record as poisoned and the
        whole batch is staged again, so no half-applied record is ever committed.
        """
        poisoned: dict[tuple[int, int, int], str] = {}
        while True:
            txn = BatchTxn(db)
            try:
                return txn, self._stage(txn, records, poisoned)
            except Exception as exc:
                current = self._current
                if current is None or current.coordinates in poisoned:
                    raise
                poisoned[current.coordinates] = f'{type(exc).__name__}: {exc}'[:2000]

    def _stage(
        self, txn: BatchTxn, records: Sequence[SourceRecord], poisoned: Mapping[tuple[int, int, int], str]
    ) -> BatchOutcome:
        self._outcome = outcome = BatchOutcome()
        self._poisoned = poisoned
        for source in records:
            self._current = source
            self._apply_source(txn, source)
            outcome.next_offsets[(source.topic, source.partition)] = source.offset + 1
        self._current = None
        for (topic, partition), offset in outcome.next_offsets.items():
            txn.put(OFFSET.key(self.topics[topic], partition), str(offset).encode())
        if outcome.dead:
            counts: dict[str, int] = json.loads(txn.get(DLQ_COUNTS) or b'{}')
            for dead in outcome.dead:
                counts[dead.reason] = counts.get(dead.reason, 0) + 1
            txn.put(DLQ_COUNTS, dumps(counts))
        return outcome

    def _dead_letter(self, source: SourceRecord, reason: str, detail: str) -> None:
        self._outcome.dead.append(DeadLetter(source, reason, detail))

    def _apply_source(self, txn: BatchTxn, source: SourceRecord) -> None:
        failure = self._poisoned.get(source.coordinates)
        if failure is not None:
            self._dead_letter(source, 'apply_error', f'applying the record raised {failure}')
            return
        try:
            record = self.check(source)
        except Rejected as rejected:
            self._dead_letter(source, rejected.reason, rejected.detail)
            return
        assert source.value is not None
        run_key = RUN.key(record.run_id)
        run = txn.get_state(run_key, RunState)
        if run is None:
            if not (isinstance(record, StepEvent) and record.kind == 'run_started'):
                txn.put(
                    PARKED.key(record.run_id, source.topic, source.partition, source.offset), source.value
                )
                return
            run = self._register(txn, record)
            self._apply_registered(txn, run, source, record)
            self._drain_parked(txn, run)
        else:
            self._apply_registered(txn, run, source, record)
        txn.put_state(run_key, run)

    # -- record-level rules (no state) ---------------------------------------------------------

    def check(self, source: SourceRecord) -> LogRecord:
        """The decoded record, or `Rejected` when it cannot apply whatever the state."""
        if source.value is None:
            raise Rejected('tombstone', 'a record with no value (a tombstone) on a log topic')
        if source.key is None:
            raise Rejected('no_key', 'a record with no key: log records are keyed by their run_id')
        try:
            record = decode(source.value)
        except SchemaError as exc:
            raise Rejected(exc.reason, str(exc)) from None
        expected = StepEvent if source.topic == EVENTS else ToolEffectTransition
        if not isinstance(record, expected):
            raise Rejected(
                'wrong_topic', f'a {type(record).__name__} on the {self.topics[source.topic]} topic'
            )
        try:
            check_record_ids(record)
        except ValueError as exc:
            raise Rejected('invalid_id', str(exc)) from None
        if source.key != record.run_id.encode():
            raise Rejected(
                'wrong_key', f'record key {source.key[:300]!r} is not its run_id {record.run_id!r}'
            )
        home = murmur2_partition(source.key, self.partitions)
        if home != source.partition:
            raise Rejected(
                'wrong_partition',
                f'run {record.run_id!r} belongs in partition {home} of {self.partitions}, '
                f'not {source.partition}',
            )
        if record.seq < 0:
            raise Rejected('invalid', f'negative seq {record.seq}')
        if isinstance(record, StepEvent):
            _check_event(record)
        elif record.status not in TOOL_EFFECT_STATUSES:
            raise Rejected(
                'unknown_version', f'unknown tool effect status {record.status!r} (a newer writer?)'
            )
        return record

    # -- registration, ownership ---------------------------------------------------------------

    def _register(self, txn: BatchTxn, started: StepEvent) -> RunState:
        run = RunState(
            run_id=started.run_id,
            owner=started.writer_id,
            started_at=micros(started.timestamp),
            conversation_id=started.conversation_id,
            parent_run_id=started.parent_run_id,
            agent_name=started.agent_name,
            metadata=dict(started.metadata),
        )
        txn.put(RUNS.key(run.started_at, run.run_id), b'')
        if run.conversation_id is not None:
            txn.put(CONVERSATION.key(run.conversation_id, run.started_at, run.run_id), b'')
        if run.parent_run_id is not None:
            txn.put(CHILDREN.key(run.parent_run_id, run.started_at, run.run_id), b'')
        return run

    def _drain_parked(self, txn: BatchTxn, run: RunState) -> None:
        """Apply what waited for the registration: step events first, each topic in log order."""
        for k, value in txn.scan(PARKED.prefix(run.run_id)):
            txn.delete(k)
            _, topic, partition, offset = PARKED.parse(k)
            assert isinstance(topic, int) and isinstance(partition, int) and isinstance(offset, int)
            source = SourceRecord(topic, partition, offset, run.run_id.encode(), value)
            self._current = source
            failure = self._poisoned.get(source.coordinates)
            if failure is not None:
                self._dead_letter(source, 'apply_error', f'applying the record raised {failure}')
                continue
            self._apply_registered(txn, run, source, decode(value))

    def _apply_registered(
        self, txn: BatchTxn, run: RunState, source: SourceRecord, record: LogRecord
    ) -> None:
        if record.writer_id != run.owner:
            self._keep_apart(txn, run, source, record)
            return
        try:
            applied = self._apply_owned(txn, run, source, record)
        except Rejected as rejected:
            run.count_rejected(rejected.reason)
            self._dead_letter(source, rejected.reason, rejected.detail)
            return
        if applied:
            self._outcome.applied += 1
        else:
            self._outcome.duplicates += 1

    def _keep_apart(self, txn: BatchTxn, run: RunState, source: SourceRecord, record: LogRecord) -> None:
        assert source.value is not None
        k = APART.key(run.run_id, record.writer_id, source.topic, record.seq)
        if txn.get(k) is not None:
            self._outcome.duplicates += 1
            return
        txn.put(k, source.value)
        conflict_key = CONFLICT.key(run.run_id, record.writer_id)
        conflict = json.loads(txn.get(conflict_key) or b'{"records":0}')
        conflict['records'] += 1
        txn.put(conflict_key, dumps(conflict))
        if record.writer_id not in run.conflicting_writers:
            run.conflicting_writers = sorted([*run.conflicting_writers, record.writer_id])
        self._outcome.applied += 1

    # -- the owner's records -------------------------------------------------------------------

    def _apply_owned(self, txn: BatchTxn, run: RunState, source: SourceRecord, record: LogRecord) -> bool:
        """Apply one record of the run's owner; False for a duplicate, `Rejected` for the DLQ."""
        assert source.value is not None
        seq, topic = record.seq, source.topic
        if seq > run.highs[topic] + self.max_seq_jump:
            raise Rejected(
                'seq_jump',
                f'seq {seq} of run {run.run_id!r} is more than {self.max_seq_jump} above the highest '
                f'seq accepted on its topic ({run.highs[topic]})',
            )
        run.highs[topic] = max(run.highs[topic], seq)
        if isinstance(record, StepEvent):
            return self._apply_event(txn, run, source, record)
        assert isinstance(record, ToolEffectTransition)
        return self._apply_transition(txn, run, source, record)

    def _apply_event(self, txn: BatchTxn, run: RunState, source: SourceRecord, event: StepEvent) -> bool:
        assert source.value is not None
        event_key = EVENT.key(run.run_id, event.seq)
        held = run.holds(event.seq)
        if held:
            existing = txn.get(event_key)
            if existing is not None:
                if existing == source.value:
                    return False
                raise Rejected(
                    'duplicate_seq', f'seq {event.seq} of run {run.run_id!r} holds another step event'
                )
        snap = event.snapshot
        if snap is not None and ranges_hold(run.snapshots, snap.snapshot_seq):
            raise Rejected(
                'snapshot_conflict',
                f'snapshot {snap.snapshot_seq} of run {run.run_id!r} was saved already by another event',
            )
        if held:  # by a tool-effect transition: the step event wins
            self._withdraw_transition(txn, run, source.partition, event.seq)
        else:
            run.claim(event.seq)
        txn.put(event_key, source.value)
        ts = micros(event.timestamp)
        if event.kind in TERMINAL_KINDS and event.seq > run.terminal_seq:
            run.terminal_seq = event.seq
            run.status = TERMINAL_KINDS[event.kind]
            run.ended_at = ts
            run.error = event.error
        elif snap is not None:
            ranges_add(run.snapshots, snap.snapshot_seq)
            entry = SnapshotEntry(
                seq=event.seq,
                snapshot_seq=snap.snapshot_seq,
                state=snap.state,
                step_index=event.step_index,
                prefix_len=snap.prefix_len,
                timestamp=ts,
                idempotency_key=event.idempotency_key,
            )
            txn.put_state(SNAPSHOT.key(run.run_id, snap.snapshot_seq), entry)
            if self.max_snapshots is not None:
                _retain(txn, run, snap.snapshot_seq, snap.state, self.max_snapshots)
        return True

    def _apply_transition(
        self, txn: BatchTxn, run: RunState, source: SourceRecord, t: ToolEffectTransition
    ) -> bool:
        assert source.value is not None
        stored = encode_int(source.offset) + source.value
        transition_key = TRANSITION.key(run.run_id, t.seq)
        if run.holds(t.seq):
            existing = txn.get(transition_key)
            if existing is not None:
                if existing[8:] == source.value:
                    return False
                raise Rejected(
                    'duplicate_seq', f'seq {t.seq} of run {run.run_id!r} holds another tool-effect transition'
                )
            # Held by a step event, which wins. Kept (dead) so that a repeat is a duplicate.
            txn.put(transition_key, stored)
            raise Rejected(
                'duplicate_seq',
                f'seq {t.seq} of run {run.run_id!r} holds a step event, which takes precedence',
            )
        run.claim(t.seq)
        txn.put(transition_key, stored)
        effect_key = EFFECT.key(run.run_id, t.tool_call_id)
        effect = txn.get_state(effect_key, EffectState)
        before = _unresolved_keys(effect)
        if effect is None:
            effect = EffectState(
                run_id=run.run_id, tool_call_id=t.tool_call_id, tool_name=t.tool_name, tool_name_seq=t.seq
            )
        _merge(effect, t)
        txn.put_state(effect_key, effect)
        _reindex_effect(txn, before, _unresolved_keys(effect))
        return True

    def _withdraw_transition(self, txn: BatchTxn, run: RunState, partition: int, seq: int) -> None:
        """A step event took this seq: its transition stops counting and goes to the DLQ."""
        stored = txn.get(TRANSITION.key(run.run_id, seq))
        assert stored is not None
        offset = decode_int(stored[:8])
        t = decode(stored[8:])
        assert isinstance(t, ToolEffectTransition)
        effect_key = EFFECT.key(run.run_id, t.tool_call_id)
        before = _unresolved_keys(txn.get_state(effect_key, EffectState))
        # Rare (a reused seq), so the call's other live transitions are found by a scan of the run's.
        effect = None
        for k, other_raw in txn.scan(TRANSITION.prefix(run.run_id)):
            other_seq = TRANSITION.parse(k)[1]
            if other_seq == seq or txn.get(EVENT.key(run.run_id, other_seq)) is not None:
                continue  # the withdrawn one, or another that a step event displaced
            other = decode(other_raw[8:])
            assert isinstance(other, ToolEffectTransition)
            if other.tool_call_id != t.tool_call_id:
                continue
            if effect is None:
                effect = EffectState(
                    run_id=run.run_id,
                    tool_call_id=other.tool_call_id,
                    tool_name=other.tool_name,
                    tool_name_seq=other.seq,
                )
            _merge(effect, other)
        if effect is None:
            txn.delete(effect_key)
        else:
            txn.put_state(effect_key, effect)
        _reindex_effect(txn, before, _unresolved_keys(effect))
        run.count_rejected('duplicate_seq')
        self._dead_letter(
            SourceRecord(EFFECTS, partition, offset, run.run_id.encode(), stored[8:]),
            'duplicate_seq',
            f'seq {seq} of run {run.run_id!r} also holds a step event, which takes precedence',
        )


def _check_event(event: StepEvent) -> None:
    if event.kind not in EVENT_KINDS:
        raise Rejected('unknown_version', f'unknown event kind {event.kind!r} (a newer writer?)')
    if (event.kind == 'snapshot_saved') != (event.snapshot is not None):
        raise Rejected('invalid', 'a snapshot payload belongs to snapshot_saved events, and only to them')
    snap = event.snapshot
    if snap is None:
        return
    if snap.state not in ('complete', 'interrupted') or snap.prefix_len < 0 or snap.snapshot_seq < 0:
        raise Rejected(
            'invalid', f'invalid snapshot header {snap.state!r} {snap.prefix_len} {snap.snapshot_seq}'
        )
    try:
        tail = json.loads(snap.messages)
    except ValueError as exc:
        raise Rejected('invalid', f'snapshot messages are not JSON: {exc}') from None
    if not isinstance(tail, list):
        raise Rejected('invalid', 'snapshot messages are not a JSON list')


def _merge(effect: EffectState, t: ToolEffectTransition) -> None:
    """Fold one transition into the call's state; commutative, so arrival order is moot."""
    ts = micros(t.timestamp)
    if t.seq < effect.tool_name_seq:
        effect.tool_name, effect.tool_name_seq = t.tool_name, t.seq
    if t.status == 'started':
        effect.started_at = ts if effect.started_at is None else min(ts, effect.started_at)
    if t.status != 'annotated' and t.seq > effect.status_seq:
        effect.status, effect.status_seq, effect.error = t.status, t.seq, t.error
        effect.ended_at = None if t.status == 'started' else ts
    if t.idempotency_key is not None and t.seq > effect.idempotency_key_seq:
        effect.idempotency_key, effect.idempotency_key_seq = t.idempotency_key, t.seq
    if t.effect_summary is not None and t.seq > effect.effect_summary_seq:
        effect.effect_summary, effect.effect_summary_seq = t.effect_summary, t.seq
    effect.last_seq = max(effect.last_seq, t.seq)


def _unresolved_keys(effect: EffectState | None) -> tuple[bytes, ...]:
    if effect is None or not effect.unresolved:
        return ()
    assert effect.started_at is not None
    return (
        UNRESOLVED.key(effect.started_at, effect.run_id, effect.tool_call_id),
        UNRESOLVED_RUN.key(effect.run_id, effect.tool_call_id),
    )


def _reindex_effect(txn: BatchTxn, before: tuple[bytes, ...], after: tuple[bytes, ...]) -> None:
    """Both unresolved indexes change together, from the same state: they cannot disagree."""
    if before == after:
        return
    for k in before:
        txn.delete(k)
    for k in after:
        txn.put(k, b'')


def _retain(txn: BatchTxn, run: RunState, snapshot_seq: int, state: str, keep: int) -> None:
    """Keep the newest `keep` snapshots, the newest complete one and the newest overall.

    Retention hides snapshots from the read side; their deltas stay, because later snapshots
    are reconstructed through them (see docs/decisions/0006-snapshot-retention.md). The
    candidates are tracked on the run, so this costs O(keep) per snapshot, not O(snapshots).
    """
    retained = run.retained_snapshots
    retained.append(snapshot_seq)
    retained.sort()
    if state == 'complete' and snapshot_seq > run.newest_complete_snapshot:
        run.newest_complete_snapshot = snapshot_seq
    keep_set = set(retained[-keep:]) | {retained[-1], run.newest_complete_snapshot}
    for dropped in [s for s in retained if s not in keep_set]:
        retained.remove(dropped)
        entry_key = SNAPSHOT.key(run.run_id, dropped)
        entry = txn.get_state(entry_key, SnapshotEntry)
        if entry is not None:
            entry.retained = False
            txn.put_state(entry_key, entry)
