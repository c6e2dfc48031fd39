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
- An operator's `resolved` transition is not the run's record: any writer may write one, it
  holds no seq (its `seq` names the `started` transition it answers) and it is kept in the
  call's ledger. It resolves the effect while that `started` is still the call's latest status
  and no earlier resolution did; otherwise it is history. One for a call with no transition
  before it in the log goes to the DLQ (`unknown_effect`). See decision 0022.
- With a retention policy (`_retention.py`, decision 0032), a run one of whose ends is older than
  its partition's clock minus the period is dropped at the end of the batch, in its transaction,
  and a record of it that comes later is dropped too (`expired_records`), never parked.

How a batch is applied is a matter of speed only. Its records are grouped by run (the Kafka
key), each run's records kept in batch order, and each run is applied in one go: its key
checks are done once, its keys are built once, its state is loaded once and staged once. Runs
share no keys, so applying them one after another gives what applying the batch in its order
gives, and the dead letters are still reported in batch order. Each record is decoded once, into
plain values (`read_plain`, in `schemas/_plain.py`), parked ones included; the record types are
built only for what that reader leaves to `stepstream.schemas.decode` (another schema version,
anything malformed), so every reason and message for a record that does not decode comes from
`decode` itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Context, Decimal, InvalidOperation
from operator import itemgetter
from types import SimpleNamespace
from typing import Any

from stepstream.errors import SchemaError
from stepstream.ids import MAX_ID_BYTES, OTHER_ID_FIELDS, check_record_ids, is_plain_id, is_run_id
from stepstream.media._references import snapshot_media
from stepstream.media._types import is_media_uri
from stepstream.projector._keys import (
    APART,
    CHILDREN,
    CONFLICT,
    CONVERSATION,
    EFFECT,
    EVENT,
    PARKED,
    RESOLUTION,
    RUN,
    RUNS,
    SNAPSHOT,
    TRANSITION,
    UNRESOLVED,
    UNRESOLVED_RUN,
)
from stepstream.projector._retention import Retention
from stepstream.projector._shard import Transaction, Transactional
from stepstream.projector._state import EffectState, RunState, SnapshotEntry, ranges_add, ranges_hold
from stepstream.schemas import EVENT_KINDS, MAX_NOTE_CHARS, RESOLUTIONS, TOOL_EFFECT_STATUSES
from stepstream.schemas._plain import (
    RECORD_TYPES,
    STEP_EVENTS,
    TOOL_EFFECTS,
    Fields,
    read_record,
)
from stepstream.topics import murmur2_partition

EVENTS, EFFECTS = STEP_EVENTS, TOOL_EFFECTS

MAX_SEQ_JUMP = 1_000_000
"""How far above the highest seq accepted in its topic a run's next record may be."""

PARKED_DECODED = 16_384
PARKED_DECODED_BYTES = 32 << 20
"""How many parked records an `Applier` keeps decoded for their registration, and how many of
their bytes: records may be up to the broker's message size, and anyone can park them."""

TERMINAL_KINDS = {'run_completed': 'completed', 'run_failed': 'failed', 'run_cancelled': 'cancelled'}

TIMED_KINDS = frozenset(
    {'model_request_completed', 'model_request_failed', 'tool_call_completed', 'tool_call_failed'}
)
"""The kinds that may carry a `duration_us` (schema v3)."""

MAX_COUNT = 1 << 40
"""The most tokens, requests or microseconds one event may report: more is a garbled record, and
per-run sums of values below it stay far inside a signed 64-bit integer (Parquet, DuckDB)."""

MAX_COST_USD = Decimal(10**9)
"""The most one model request may cost: more is a garbled record."""

_COST_PLACES = 30
"""The most decimal places a cost may have: with them, `_SUMS` adds costs exactly."""
_SUMS = Context(prec=200)

_TOKEN_FIELDS = ('input_tokens', 'output_tokens', 'cache_read_tokens', 'cache_write_tokens', 'requests')
_HEX_ID = {'trace_id': re.compile(r'[0-9a-f]{32}'), 'span_id': re.compile(r'[0-9a-f]{16}')}

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
    'unknown_effect',
    'stray_heartbeat',
    'apply_error',
)
"""Every reason a record can be dead-lettered for (docs/decisions/0010-conflict-rules.md)."""

_RESOLUTION_FIELDS = ('resolution', 'resolved_by', 'note')


# -- reading records into plain values ---------------------------------------------------------


_ENVELOPE_IDS = ('writer_id', 'conversation_id', 'agent_name', 'parent_run_id')
_CALL_IDS = ('tool_call_id', 'tool_name')
assert {*_ENVELOPE_IDS, *_CALL_IDS} == {*OTHER_ID_FIELDS, 'parent_run_id'}


def _ids_plainly_valid(fields: Fields, keys: _RunKeys) -> bool:
    """The common case of `check_record_ids` (`is_plain_id`), without raising; False if unsure.

    The run id is checked against the key. A run's records share their envelope, so it is
    checked once per key and batch, and again only where it changes.
    """
    writer_id, conversation_id = fields['writer_id'], fields['conversation_id']
    agent_name, parent = fields['agent_name'], fields['parent_run_id']
    envelope = (writer_id, conversation_id, agent_name, parent)
    if envelope != keys.envelope:
        if not (
            is_plain_id(writer_id)
            and is_plain_id(conversation_id)
            and is_plain_id(agent_name)
            and (parent is None or is_run_id(parent))
        ):
            return False
        keys.envelope = envelope
    call, tool = fields['tool_call_id'], fields['tool_name']
    return (call is None or is_plain_id(call)) and (tool is None or is_plain_id(tool))


# -- a batch ------------------------------------------------------------------------------------


@dataclass(slots=True)
class SourceRecord:
    """A record as consumed: where it is in the log, and its bytes.

    Never changed once made; not frozen only because a frozen dataclass is four times slower to
    make, and one is made per record.
    """

    topic: int
    """`EVENTS` or `EFFECTS`."""
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    unreadable: SchemaError | None = None
    """Why a Confluent wire-format record could not be turned into its single-object form (the
    value stays as it was in the log); None for every other record (`projector/_wire.py`)."""

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """(topic, partition, offset): unique in the log."""
        return (self.topic, self.partition, self.offset)


@dataclass(frozen=True, slots=True)
class Rejection:
    """A record that cannot apply, with its reason code and a sentence for people."""

    source: SourceRecord
    reason: str
    detail: str


@dataclass(slots=True)
class BatchOutcome:
    """What applying one batch did."""

    applied: int = 0
    duplicates: int = 0
    dead: list[Rejection] = field(default_factory=list)
    next_offsets: dict[tuple[int, int], int] = field(default_factory=dict)
    """(topic, partition) -> the offset after the batch's last record there."""
    expired_records: int = 0
    """Records of runs retention had dropped already, dropped too."""
    expired_runs: list[str] = field(default_factory=list)
    """The runs retention dropped in this batch."""


class Rejected(Exception):
    """A record that goes to the DLQ, and why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class _RunKeys:
    """One Kafka key's records in a batch: what is checked once per key, and the run's keys."""

    __slots__ = (
        'effect',
        'effects',
        'envelope',
        'event',
        'home',
        'key',
        'run',
        'run_id',
        'snapshot',
        'transition',
        'valid',
    )

    def __init__(self, key: bytes | None, partitions: int) -> None:
        self.key = key
        self.run_id: str | None = None
        """The key as text, when it is UTF-8: every accepted record's run_id equals it."""
        self.valid = False
        """Whether the key is a valid run id (so records whose run_id is the key may be)."""
        self.home = -1
        self.effects: dict[bytes, tuple[bytes, ...]] = {}
        """The calls whose effect changed in the batch, with their unresolved keys before it."""
        self.envelope: tuple[Any, ...] = ()
        """The last envelope ids found plainly valid (`_ids_plainly_valid`)."""
        if key is None:
            return
        self.home = murmur2_partition(key, partitions)
        try:
            self.run_id = key.decode()
        except UnicodeDecodeError:
            return
        self.valid = is_run_id(self.run_id)
        if not self.valid:
            return
        self.run = RUN.key(self.run_id)
        self.event: Callable[[int], bytes] = EVENT.under(self.run_id)
        self.transition: Callable[[int], bytes] = TRANSITION.under(self.run_id)
        self.effect: Callable[[str], bytes] = EFFECT.under(self.run_id)
        self.snapshot: Callable[[int], bytes] = SNAPSHOT.under(self.run_id)


_by_index = itemgetter(0)


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
        retain_ended_us: int | None = None,
    ) -> None:
        """`topics` are the step-events and tool-effects topic names, in that order.

        `retain_ended_us` drops runs that ended that long before their partition's clock
        (`_retention.py`); None keeps every run.
        """
        self.topics = topics
        self.partitions = partitions
        self.max_snapshots = max_snapshots_per_run
        self.retention: Retention | None = None
        self.retain_ended_us = retain_ended_us
        self.max_seq_jump = max_seq_jump
        self._current: SourceRecord | None = None
        self._index = 0
        """The batch position of the record being applied: dead letters are reported in it."""
        self._outcome = BatchOutcome()
        self._dead: list[tuple[int, Rejection]] = []
        self._poisoned: Mapping[tuple[int, int, int], str] = {}
        self._parked: dict[bytes, tuple[bytes, Fields]] = {}
        """Recently parked records, decoded, by their parked key (with their bytes, to be sure).

        A registration applies them without decoding them again, in this batch or a later one
        (the usual case live: transitions are fetched ahead of their run's `run_started`). The
        oldest are dropped beyond `PARKED_DECODED` records or `PARKED_DECODED_BYTES`; a dropped
        one is decoded when drained.
        """
        self._parked_bytes = 0

    @property
    def retain_ended_us(self) -> int | None:
        """The retention policy applied (None: every run is kept)."""
        return None if self.retention is None else self.retention.retain_us

    @retain_ended_us.setter
    def retain_ended_us(self, value: int | None) -> None:
        self.retention = None if value is None else Retention(value)

    def stage(
        self, shard: Transactional, records: Sequence[SourceRecord]
    ) -> tuple[Transaction, BatchOutcome]:
        """Stage a batch (state, DLQ counts and next offsets) in one transaction of `shard`, not committed.

        An unexpected exception while applying a record marks that record as poisoned and the
        whole batch is staged again, so no half-applied record is ever committed.
        """
        poisoned: dict[tuple[int, int, int], str] = {}
        while True:
            txn = shard.begin()
            try:
                return txn, self._stage(txn, records, poisoned)
            except Exception as exc:
                current = self._current
                if current is None or current.coordinates in poisoned:
                    raise
                poisoned[current.coordinates] = f'{type(exc).__name__}: {exc}'[:2000]

    def _stage(
        self, txn: Transaction, records: Sequence[SourceRecord], poisoned: Mapping[tuple[int, int, int], str]
    ) -> BatchOutcome:
        self._outcome = outcome = BatchOutcome()
        self._dead = []
        self._poisoned = poisoned
        retention = self.retention
        if retention is not None:
            retention.begin()
        next_offsets = outcome.next_offsets
        by_key: dict[bytes | None, list[tuple[int, SourceRecord]]] = {}
        for index, source in enumerate(records):
            next_offsets[(source.topic, source.partition)] = source.offset + 1
            same_key = by_key.get(source.key)
            if same_key is None:
                by_key[source.key] = [(index, source)]
            else:
                same_key.append((index, source))
        for key, items in by_key.items():
            self._apply_run(txn, _RunKeys(key, self.partitions), items)
        self._current = None
        self._dead.sort(key=_by_index)  # stable: within one record's turn, in the order they came
        outcome.dead = [dead for _, dead in self._dead]
        for (topic, partition), offset in next_offsets.items():
            txn.set_offset(self.topics[topic], partition, offset)
        if outcome.dead:
            txn.count_dead_letters(dead.reason for dead in outcome.dead)
        if retention is not None:  # after the counts: an expiry takes its run's dead letters back
            outcome.expired_runs = retention.expire(txn, {partition for _, partition in next_offsets})
        return outcome

    def _dead_letter(self, source: SourceRecord, reason: str, detail: str) -> None:
        self._dead.append((self._index, Rejection(source, reason, detail)))

    def _run_dead_letter(
        self, txn: Transaction, run: RunState, source: SourceRecord, reason: str, detail: str
    ) -> None:
        """A record of a registered run dead-lettered by a state rule (a retention policy tallies it)."""
        self._dead_letter(source, reason, detail)
        if self.retention is not None:
            self.retention.tally(txn, run.run_id, reason)

    def _apply_run(self, txn: Transaction, keys: _RunKeys, items: list[tuple[int, SourceRecord]]) -> None:
        """Apply one key's records of the batch, in order; the run's state is staged once."""
        poisoned = self._poisoned
        retention = self.retention
        run: RunState | None = None
        loaded = False
        newest = -1  # the newest step event of the key, for the partition's retention clock
        for index, source in items:
            self._current, self._index = source, index
            if poisoned and source.coordinates in poisoned:
                self._dead_letter(
                    source, 'apply_error', f'applying the record raised {poisoned[source.coordinates]}'
                )
                continue
            try:
                record = self._check(source, keys)
            except Rejected as rejected:
                self._dead_letter(source, rejected.reason, rejected.detail)
                continue
            assert source.value is not None and keys.run_id is not None
            if retention is not None and source.topic == EVENTS and record['timestamp'] > newest:
                newest = record['timestamp']
            if not loaded:
                run, loaded = txn.get_state(keys.run, RunState), True
            if run is None:
                if retention is not None and retention.is_expired(txn, keys.run_id):
                    self._outcome.expired_records += 1
                    continue
                if source.topic == EVENTS and record['kind'] == 'run_heartbeat':
                    self._dead_letter(
                        source,
                        'stray_heartbeat',
                        f'a heartbeat for run {keys.run_id!r}, which has no run_started before it',
                    )
                    continue
                if not (source.topic == EVENTS and record['kind'] == 'run_started'):
                    parked = PARKED.key(keys.run_id, source.topic, source.partition, source.offset)
                    txn.put(parked, source.value)
                    self._keep_decoded(parked, source.value, record)
                    continue
                run = self._register(txn, record)
                self._apply_registered(txn, keys, run, source, record)
                self._drain_parked(txn, keys, run)
            else:
                self._apply_registered(txn, keys, run, source, record)
        if newest >= 0:
            retention.saw(keys.home, newest)  # type: ignore[union-attr]
        if run is not None:
            txn.put_state(keys.run, run)
        for effect_key, before in keys.effects.items():
            _reindex_effect(txn, before, _unresolved_keys(txn.get_state(effect_key, EffectState)))

    # -- record-level rules (no state) ---------------------------------------------------------

    def check(self, source: SourceRecord) -> Fields:
        """The record's plain fields, or `Rejected` when it cannot apply whatever the state."""
        return self._check(source, _RunKeys(source.key, self.partitions))

    def _check(self, source: SourceRecord, keys: _RunKeys) -> Fields:
        if source.value is None:
            raise Rejected('tombstone', 'a record with no value (a tombstone) on a log topic')
        if source.key is None:
            raise Rejected('no_key', 'a record with no key: log records are keyed by their run_id')
        if source.unreadable is not None:
            raise Rejected(source.unreadable.reason, str(source.unreadable))
        try:
            topic, record = read_record(source.value)
        except SchemaError as exc:
            raise Rejected(exc.reason, str(exc)) from None
        if topic != source.topic:
            raise Rejected('wrong_topic', f'a {RECORD_TYPES[topic]} on the {self.topics[source.topic]} topic')
        run_id = record['run_id']
        if not (keys.valid and run_id == keys.run_id and _ids_plainly_valid(record, keys)):
            try:
                check_record_ids(SimpleNamespace(**record))
            except ValueError as exc:
                raise Rejected('invalid_id', str(exc)) from None
        if run_id != keys.run_id:  # the key is UTF-8 of its run_id exactly when it decodes to it
            raise Rejected('wrong_key', f'record key {source.key[:300]!r} is not its run_id {run_id!r}')
        if keys.home != source.partition:
            raise Rejected(
                'wrong_partition',
                f'run {run_id!r} belongs in partition {keys.home} of {self.partitions}, '
                f'not {source.partition}',
            )
        if record['seq'] < 0:
            raise Rejected('invalid', f'negative seq {record["seq"]}')
        if topic == EVENTS:
            _check_event(record)
        elif record['status'] not in TOOL_EFFECT_STATUSES:
            raise Rejected(
                'unknown_version', f'unknown tool effect status {record["status"]!r} (a newer writer?)'
            )
        else:
            _check_resolution(record)
        return record

    # -- registration, ownership ---------------------------------------------------------------

    def _register(self, txn: Transaction, started: Fields) -> RunState:
        run = RunState(
            run_id=started['run_id'],
            owner=started['writer_id'],
            started_at=started['timestamp'],
            conversation_id=started['conversation_id'],
            parent_run_id=started['parent_run_id'],
            agent_name=started['agent_name'],
            metadata=dict(started['metadata']),
        )
        txn.put(RUNS.key(run.started_at, run.run_id), b'')
        if run.conversation_id is not None:
            txn.put(CONVERSATION.key(run.conversation_id, run.started_at, run.run_id), b'')
        if run.parent_run_id is not None:
            txn.put(CHILDREN.key(run.parent_run_id, run.started_at, run.run_id), b'')
        return run

    def _keep_decoded(self, parked: bytes, value: bytes, record: Fields) -> None:
        """Keep a parked record's fields for its registration, within the bounds."""
        self._forget_decoded(parked)
        self._parked[parked] = (value, record)
        self._parked_bytes += len(value)
        while self._parked_bytes > PARKED_DECODED_BYTES or len(self._parked) > PARKED_DECODED:
            self._forget_decoded(next(iter(self._parked)))

    def _forget_decoded(self, parked: bytes) -> tuple[bytes, Fields] | None:
        kept = self._parked.pop(parked, None)
        if kept is not None:
            self._parked_bytes -= len(kept[0])
        return kept

    def _take_decoded(self, parked: bytes, value: bytes) -> Fields:
        """A parked record's fields: the kept ones if they are of these bytes, else decoded."""
        kept = self._forget_decoded(parked)
        return kept[1] if kept is not None and kept[0] == value else read_record(value)[1]

    def _drain_parked(self, txn: Transaction, keys: _RunKeys, run: RunState) -> None:
        """Apply what waited for the registration: step events first, each topic in log order."""
        for k, value in txn.scan(PARKED.prefix(run.run_id)):
            txn.delete(k)
            _, topic, partition, offset = PARKED.parse(k)
            assert isinstance(topic, int) and isinstance(partition, int) and isinstance(offset, int)
            source = SourceRecord(topic, partition, offset, keys.key, value)
            self._current = source
            failure = self._poisoned.get(source.coordinates)
            if failure is not None:
                self._run_dead_letter(
                    txn, run, source, 'apply_error', f'applying the record raised {failure}'
                )
                continue
            record = self._take_decoded(k, value)
            self._apply_registered(txn, keys, run, source, record)

    def _apply_registered(
        self, txn: Transaction, keys: _RunKeys, run: RunState, source: SourceRecord, record: Fields
    ) -> None:
        """Apply one record of a registered run: the owner's by the seq rules, others' apart."""
        if source.topic == EFFECTS and record['status'] == 'resolved':
            try:
                applied = self._apply_resolution(txn, keys, run, source, record)
            except Rejected as rejected:
                self._run_dead_letter(txn, run, source, rejected.reason, rejected.detail)
                return
            if applied:
                self._outcome.applied += 1
            else:
                self._outcome.duplicates += 1
            return
        if source.topic == EVENTS and record['kind'] == 'run_heartbeat':
            self._apply_heartbeat(txn, run, source, record)
            return
        if record['writer_id'] != run.owner:
            self._keep_apart(txn, run, source, record)
            return
        seq, topic = record['seq'], source.topic
        high = run.highs[topic]
        try:
            if seq > high + self.max_seq_jump:
                raise Rejected(
                    'seq_jump',
                    f'seq {seq} of run {run.run_id!r} is more than {self.max_seq_jump} above the highest '
                    f'seq accepted on its topic ({high})',
                )
            if seq > high:
                run.highs[topic] = seq
            if topic == EVENTS:
                applied = self._apply_event(txn, keys, run, source, record)
            else:
                applied = self._apply_transition(txn, keys, run, source, record)
        except Rejected as rejected:
            run.count_rejected(rejected.reason)
            self._run_dead_letter(txn, run, source, rejected.reason, rejected.detail)
            return
        if applied:
            self._outcome.applied += 1
            # What `stale` is judged by, when read. Step events only: one is never withdrawn,
            # while a transition can lose its seq to a later step event, so counting it would
            # make the figure depend on arrival order (every tool call has step events too).
            if topic == EVENTS and record['timestamp'] > run.last_record_at:
                run.last_record_at = record['timestamp']
        else:
            self._outcome.duplicates += 1

    def _apply_heartbeat(
        self, txn: Transaction, run: RunState, source: SourceRecord, heartbeat: Fields
    ) -> None:
        """The owner is alive at the heartbeat's time; nothing else changes (decision 0026).

        A heartbeat holds no seq and is not kept: its time joins the max fold `stale` is read
        from, so any number of them, in any order, costs one run-state write per batch. One from
        another writer says nothing about the owner and goes to the DLQ.
        """
        if heartbeat['writer_id'] != run.owner:
            self._run_dead_letter(
                txn,
                run,
                source,
                'stray_heartbeat',
                f'a heartbeat of writer {heartbeat["writer_id"]!r} for run {run.run_id!r}, '
                f'which writer {run.owner!r} owns',
            )
            return
        if heartbeat['timestamp'] > run.last_record_at:
            run.last_record_at = heartbeat['timestamp']
        self._outcome.applied += 1

    def _keep_apart(self, txn: Transaction, run: RunState, source: SourceRecord, record: Fields) -> None:
        assert source.value is not None
        writer_id = record['writer_id']
        k = APART.key(run.run_id, writer_id, source.topic, record['seq'])
        if txn.get(k) is not None:
            self._outcome.duplicates += 1
            return
        txn.put(k, source.value)
        txn.count_conflict(CONFLICT.key(run.run_id, writer_id))
        if writer_id not in run.conflicting_writers:
            run.conflicting_writers = sorted([*run.conflicting_writers, writer_id])
        self._outcome.applied += 1

    # -- the owner's records: False for a duplicate, `Rejected` for the DLQ ----------------------

    def _apply_event(
        self, txn: Transaction, keys: _RunKeys, run: RunState, source: SourceRecord, event: Fields
    ) -> bool:
        assert source.value is not None
        seq = event['seq']
        event_key = keys.event(seq)
        held = run.holds(seq)
        if held:
            existing = txn.get(event_key)
            if existing is not None:
                if existing == source.value:
                    return False
                raise Rejected('duplicate_seq', f'seq {seq} of run {run.run_id!r} holds another step event')
        snap = event['snapshot']
        if snap is not None and ranges_hold(run.snapshots, snap['snapshot_seq']):
            raise Rejected(
                'snapshot_conflict',
                f'snapshot {snap["snapshot_seq"]} of run {run.run_id!r} was saved already by another event',
            )
        if held:  # by a tool-effect transition: the step event wins
            self._withdraw_transition(txn, keys, run, source.partition, seq)
        else:
            run.claim(seq)
        txn.put(event_key, source.value)
        if self.retention is not None and snap is not None:
            self.retention.referenced(txn, run.run_id, snapshot_media(snap['messages'], snap['media']))
        kind = event['kind']
        if kind in TERMINAL_KINDS:
            if self.retention is not None:
                self.retention.ended(txn, keys.home, run.run_id, event['timestamp'])
            if seq > run.terminal_seq:
                run.terminal_seq = seq
                run.status = TERMINAL_KINDS[kind]
                run.ended_at = event['timestamp']
                run.error = event['error']
        elif kind in TIMED_KINDS:
            _add_usage(run, event)
        elif snap is not None:
            snapshot_seq = snap['snapshot_seq']
            ranges_add(run.snapshots, snapshot_seq)
            entry = SnapshotEntry(
                seq=seq,
                snapshot_seq=snapshot_seq,
                state=snap['state'],
                step_index=event['step_index'],
                prefix_len=snap['prefix_len'],
                timestamp=event['timestamp'],
                idempotency_key=event['idempotency_key'],
            )
            txn.put_state(keys.snapshot(snapshot_seq), entry)
            if self.max_snapshots is not None:
                _retain(txn, keys, run, snapshot_seq, snap['state'], self.max_snapshots)
        return True

    def _apply_transition(
        self, txn: Transaction, keys: _RunKeys, run: RunState, source: SourceRecord, t: Fields
    ) -> bool:
        assert source.value is not None
        seq = t['seq']
        transition_key = keys.transition(seq)
        if run.holds(seq):
            existing = txn.transition(transition_key)
            if existing is not None:
                if existing[1] == source.value:
                    return False
                raise Rejected(
                    'duplicate_seq', f'seq {seq} of run {run.run_id!r} holds another tool-effect transition'
                )
            # Held by a step event, which wins. Kept (dead) so that a repeat is a duplicate.
            txn.put_transition(transition_key, source.offset, source.value)
            raise Rejected(
                'duplicate_seq',
                f'seq {seq} of run {run.run_id!r} holds a step event, which takes precedence',
            )
        run.claim(seq)
        txn.put_transition(transition_key, source.offset, source.value)
        effect_key = keys.effect(t['tool_call_id'])
        effect = txn.get_state(effect_key, EffectState)
        first = effect_key not in keys.effects
        if first:
            keys.effects[effect_key] = _unresolved_keys(effect)
        if effect is None:
            effect = EffectState(
                run_id=run.run_id, tool_call_id=t['tool_call_id'], tool_name=t['tool_name'], tool_name_seq=seq
            )
            txn.put_state(effect_key, effect)
        elif first:  # staged once per batch; later changes are to the staged object
            txn.put_state(effect_key, effect)
        _merge(effect, t)
        return True

    def _apply_resolution(
        self, txn: Transaction, keys: _RunKeys, run: RunState, source: SourceRecord, r: Fields
    ) -> bool:
        """Add an operator's resolution to the call's ledger.

        It decides the status if it answers the call's latest `started` (`EffectState.settle`).
        """
        assert source.value is not None
        call = r['tool_call_id']
        resolution_key = RESOLUTION.key(run.run_id, call, source.offset)
        if txn.get(resolution_key) is not None:
            return False
        effect_key = keys.effect(call)
        effect = txn.get_state(effect_key, EffectState)
        if effect is None:
            raise Rejected(
                'unknown_effect',
                f'run {run.run_id!r} has no tool call {call!r} before this resolution: nothing to resolve',
            )
        if effect_key not in keys.effects:
            keys.effects[effect_key] = _unresolved_keys(effect)
            txn.put_state(effect_key, effect)
        txn.put(resolution_key, source.value)
        effect.resolutions.append(
            {
                'offset': source.offset,
                'seq': r['seq'],
                'resolution': r['resolution'],
                'resolved_by': r['resolved_by'],
                'writer_id': r['writer_id'],
                'at': r['timestamp'],
                'note': r['note'],
            }
        )
        effect.resolutions.sort(key=_by_offset)
        effect.settle()
        return True

    def _withdraw_transition(
        self, txn: Transaction, keys: _RunKeys, run: RunState, partition: int, seq: int
    ) -> None:
        """A step event took this seq: its transition stops counting and goes to the DLQ."""
        stored = txn.transition(keys.transition(seq))
        assert stored is not None
        offset, withdrawn = stored
        t = read_record(withdrawn)[1]
        effect_key = keys.effect(t['tool_call_id'])
        before = txn.get_state(effect_key, EffectState)
        if effect_key not in keys.effects:
            keys.effects[effect_key] = _unresolved_keys(before)
        # Rare (a reused seq), so the call's other live transitions are found by a scan of the run's.
        effect = None
        first_live = None
        for k, other_offset, other_value in txn.transitions(TRANSITION.prefix(run.run_id)):
            other_seq = TRANSITION.parse(k)[1]
            assert isinstance(other_seq, int)
            if other_seq == seq or txn.get(keys.event(other_seq)) is not None:
                continue  # the withdrawn one, or another that a step event displaced
            other = read_record(other_value)[1]
            if other['tool_call_id'] != t['tool_call_id']:
                continue
            first_live = other_offset if first_live is None else min(first_live, other_offset)
            if effect is None:
                effect = EffectState(
                    run_id=run.run_id,
                    tool_call_id=other['tool_call_id'],
                    tool_name=other['tool_name'],
                    tool_name_seq=other['seq'],
                )
            _merge(effect, other)
        # A resolution stays only where a live transition of the call came before it in the
        # log, as if the withdrawn one had never applied (then it would have been dead-lettered).
        for r in before.resolutions if before is not None else ():
            if first_live is not None and r['offset'] > first_live:
                assert effect is not None
                effect.resolutions.append(r)
                continue
            resolution_key = RESOLUTION.key(run.run_id, t['tool_call_id'], r['offset'])
            value = txn.get(resolution_key)
            assert value is not None
            txn.delete(resolution_key)
            self._run_dead_letter(
                txn,
                run,
                SourceRecord(EFFECTS, partition, r['offset'], keys.key, value),
                'unknown_effect',
                f'run {run.run_id!r} has no tool call {t["tool_call_id"]!r} before this resolution: '
                'nothing to resolve',
            )
        if effect is None:
            txn.delete(effect_key)
        else:
            effect.settle()
            txn.put_state(effect_key, effect)
        run.count_rejected('duplicate_seq')
        self._run_dead_letter(
            txn,
            run,
            SourceRecord(EFFECTS, partition, offset, keys.key, withdrawn),
            'duplicate_seq',
            f'seq {seq} of run {run.run_id!r} also holds a step event, which takes precedence',
        )


def _check_event(event: Fields) -> None:
    kind = event['kind']
    if kind not in EVENT_KINDS:
        raise Rejected('unknown_version', f'unknown event kind {kind!r} (a newer writer?)')
    if event['usage'] is not None or event['duration_us'] is not None or event['trace_id'] is not None:
        _check_usage(event)
    snap = event['snapshot']
    if (kind == 'snapshot_saved') != (snap is not None):
        raise Rejected('invalid', 'a snapshot payload belongs to snapshot_saved events, and only to them')
    if snap is None:
        return
    state, prefix_len, snapshot_seq = snap['state'], snap['prefix_len'], snap['snapshot_seq']
    if state not in ('complete', 'interrupted') or prefix_len < 0 or snapshot_seq < 0:
        raise Rejected('invalid', f'invalid snapshot header {state!r} {prefix_len} {snapshot_seq}')
    try:
        tail = json.loads(snap['messages'])
    except ValueError as exc:
        raise Rejected('invalid', f'snapshot messages are not JSON: {exc}') from None
    if not isinstance(tail, list):
        raise Rejected('invalid', 'snapshot messages are not a JSON list')
    bad = next((uri for uri in snap['media'] or () if not is_media_uri(uri)), None)
    if bad is not None:
        raise Rejected('invalid', f'snapshot media lists {bad[:100]!r}, which is not a media+sha256:// URI')


def _check_resolution(t: Fields) -> None:
    """A `resolved` transition names its resolution, operator and note; no other carries them."""
    if t['status'] != 'resolved':
        if any(t[name] is not None for name in _RESOLUTION_FIELDS):
            raise Rejected('invalid', 'resolution, resolved_by and note belong to resolved transitions only')
        return
    if t['resolution'] not in RESOLUTIONS:
        raise Rejected('invalid', f'a resolution is happened or did_not_happen, not {t["resolution"]!r}')
    by, note = t['resolved_by'], t['note']
    if not by or len(by) > MAX_ID_BYTES or not by.isprintable():
        raise Rejected(
            'invalid', f'a resolution needs the operator who made it (resolved_by), got {by!r:.80}'
        )
    if not note or not note.strip() or len(note) > MAX_NOTE_CHARS:
        raise Rejected('invalid', f'a resolution needs a note of 1 to {MAX_NOTE_CHARS} characters')


def _by_offset(r: dict[str, Any]) -> int:
    return int(r['offset'])


def _check_usage(event: Fields) -> None:
    """The schema v3 fields: where they may appear and what values a sum can take."""
    kind, usage, duration = event['kind'], event['usage'], event['duration_us']
    if usage is not None:
        if kind != 'model_request_completed':
            raise Rejected('invalid', f'usage belongs to model_request_completed events, not {kind}')
        for name in _TOKEN_FIELDS:
            if not 0 <= usage[name] < MAX_COUNT:
                raise Rejected('invalid', f'usage {name} {usage[name]} is outside [0, {MAX_COUNT})')
        cost = usage['cost_usd']
        if cost is not None and _cost(cost) is None:
            raise Rejected(
                'invalid', f'usage cost_usd {cost[:100]!r} is not a decimal in [0, {MAX_COST_USD}]'
            )
    if duration is not None:
        if kind not in TIMED_KINDS:
            raise Rejected('invalid', f'duration_us belongs to model request and tool call ends, not {kind}')
        if not 0 <= duration < MAX_COUNT:
            raise Rejected('invalid', f'duration_us {duration} is outside [0, {MAX_COUNT})')
    for name, pattern in _HEX_ID.items():
        value = event[name]
        if value is not None and pattern.fullmatch(value) is None:
            raise Rejected('invalid', f'{name} {value[:100]!r} is not {pattern.pattern} (W3C trace context)')


def _cost(text: str) -> Decimal | None:
    """A cost as the log carries it (decimal text), or None when it is not one we can sum."""
    if len(text) > 64:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite() or not 0 <= value <= MAX_COST_USD or value.as_tuple().exponent < -_COST_PLACES:  # type: ignore[operator]
        return None
    return value


def _add_usage(run: RunState, event: Fields) -> None:
    """Add a model request's or a tool call's end to the run's sums (commutative: order is moot).

    Costs are summed as decimals, exactly (no rounding: a checked cost is below `MAX_COST_USD`
    with at most `_COST_PLACES` places, far inside the sum's precision), so every order of one
    run's events gives the same total.
    """
    sums, kind, duration = run.usage, event['kind'], event['duration_us']
    if kind.startswith('model_request'):
        if kind == 'model_request_completed':
            sums['model_requests'] = sums.get('model_requests', 0) + 1
            usage = event['usage']
            if usage is not None:
                for name in _TOKEN_FIELDS:
                    if usage[name]:
                        sums[name] = sums.get(name, 0) + usage[name]
            cost = None if usage is None or usage['cost_usd'] is None else _cost(usage['cost_usd'])
            if cost is None:
                sums['unpriced_requests'] = sums.get('unpriced_requests', 0) + 1
            else:
                total = cost if run.cost_usd is None else _SUMS.add(Decimal(run.cost_usd), cost)
                run.cost_usd = format(total, 'f')
        if duration is not None:
            sums['model_request_us'] = sums.get('model_request_us', 0) + duration
        return
    sums['tool_calls'] = sums.get('tool_calls', 0) + 1
    if kind == 'tool_call_failed':
        sums['tool_call_failures'] = sums.get('tool_call_failures', 0) + 1
    if duration is not None:
        sums['tool_call_us'] = sums.get('tool_call_us', 0) + duration


def _merge(effect: EffectState, t: Fields) -> None:
    """Fold one transition into the call's state; commutative, so arrival order is moot."""
    ts, seq, status = t['timestamp'], t['seq'], t['status']
    if seq < effect.tool_name_seq:
        effect.tool_name, effect.tool_name_seq = t['tool_name'], seq
    if status == 'started':
        effect.started_at = ts if effect.started_at is None else min(ts, effect.started_at)
    if status != 'annotated' and seq > effect.status_seq:
        effect.status, effect.status_seq, effect.error = status, seq, t['error']
        effect.ended_at = None if status == 'started' else ts
    idempotency_key = t['idempotency_key']
    if idempotency_key is not None and seq > effect.idempotency_key_seq:
        effect.idempotency_key, effect.idempotency_key_seq = idempotency_key, seq
    summary = t['effect_summary']
    if summary is not None and seq > effect.effect_summary_seq:
        effect.effect_summary, effect.effect_summary_seq = summary, seq
    effect.last_seq = max(effect.last_seq, seq)
    if effect.resolutions:
        effect.settle()


def _unresolved_keys(effect: EffectState | None) -> tuple[bytes, ...]:
    if effect is None or not effect.unresolved:
        return ()
    assert effect.started_at is not None
    return (
        UNRESOLVED.key(effect.started_at, effect.run_id, effect.tool_call_id),
        UNRESOLVED_RUN.key(effect.run_id, effect.tool_call_id),
    )


def _reindex_effect(txn: Transaction, before: tuple[bytes, ...], after: tuple[bytes, ...]) -> None:
    """Both unresolved indexes change together, from the same state: they cannot disagree.

    Called once per call and batch, with its keys before the batch and after it: a call that
    starts and completes within one batch never touches the indexes.
    """
    if before == after:
        return
    for k in before:
        txn.delete(k)
    for k in after:
        txn.put(k, b'')


def _retain(
    txn: Transaction, keys: _RunKeys, run: RunState, snapshot_seq: int, state: str, keep: int
) -> None:
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
        entry_key = keys.snapshot(dropped)
        entry = txn.get_state(entry_key, SnapshotEntry)
        if entry is not None:
            entry.retained = False
            txn.put_state(entry_key, entry)
