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

The rules are in parts, each a module of functions the `Applier` calls with what they need
(with the projection's options as arguments; they hand back what they displace, never call it):
`_checks.py` (the record-level rules: what a record must be to apply, whatever the state),
`_step_events.py` (registration, step events by seq, the status, snapshots and their
retention), `_tool_effects.py` (transitions, resolutions, the unresolved indexes) and
`_usage.py` (the schema v3 fields: their bounds and the run's sums). The types they share are
in `_batch.py`; the retention policy's expiry is `_retention.py`. The `Applier` here stages a
batch: it groups the records by run, checks each, parks what comes before its run's
registration, applies a registered run's records by the ownership and seq rules, and reports
the dead letters in batch order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter

from stepstream.projector._batch import (
    EFFECTS,
    EVENTS,
    BatchOutcome,
    Rejected,
    Rejection,
    RunKeys,
    SourceRecord,
)
from stepstream.projector._chain import Link, advance_chain, link_of
from stepstream.projector._checks import check_record
from stepstream.projector._conversations import apply_marked
from stepstream.projector._listing import Listed, listed, relist_run
from stepstream.projector._parked import PARKED_DECODED, PARKED_DECODED_BYTES, DecodedParked
from stepstream.projector._resumed import apply_resumed
from stepstream.projector._retention import Retention
from stepstream.projector._step_events import TERMINAL_KINDS, apply_event, register
from stepstream.projector._tool_effects import apply_resolution, apply_transition, reindex_effects
from stepstream.projector._usage import MAX_COST_USD, MAX_COUNT, TIMED_KINDS
from stepstream.schemas import UNCHAINED_KINDS, Fields
from stepstream.settings import check_count
from stepstream.storage import (
    APART,
    CONFLICT,
    CONFLICTING_COUNT,
    PARKED,
    PARKED_COUNT,
    RunState,
    Transaction,
    Transactional,
)

__all__ = [
    'DLQ_REASONS',
    'EFFECTS',
    'EVENTS',
    'MAX_COST_USD',
    'MAX_COUNT',
    'MAX_SEQ_JUMP',
    'PARKED_DECODED',
    'PARKED_DECODED_BYTES',
    'TERMINAL_KINDS',
    'TIMED_KINDS',
    'Applier',
    'BatchOutcome',
    'Rejected',
    'Rejection',
    'SourceRecord',
]

MAX_SEQ_JUMP = 1_000_000
"""How far above the highest seq accepted in its topic a run's next record may be."""

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
    'stray_signature',
    'not_resumable',
    'apply_error',
)
"""Every reason a record can be dead-lettered for (docs/decisions/0010-conflict-rules.md)."""


_by_index = itemgetter(0)


def _beside(event: Fields) -> tuple[str, str]:
    """What an event beside the trail is called, and the reason it is dead-lettered for when stray."""
    if event['kind'] == 'run_heartbeat':
        return 'a heartbeat', 'stray_heartbeat'
    if event['kind'] == 'run_resumed':
        return 'a resumption', 'not_resumable'
    if event['kind'] == 'conversation_marked':
        return 'a conversation mark', 'invalid'
    return 'a signed chain head', 'stray_signature'


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
        check_count(partitions, 'partitions')
        check_count(max_snapshots_per_run, 'max_snapshots_per_run', optional=True)
        check_count(max_seq_jump, 'max_seq_jump')
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
        self._displaced: list[Rejection] = []
        """What the step-event rules displaced while applying one record, to dead-letter."""
        self._parked = DecodedParked()
        """Recently parked records, decoded, for their registration (`_parked.py`)."""
        self._links: dict[int, Link] = {}
        """The current run's records applied in the batch, by seq, for its chain (`_chain.py`)."""

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
            self._apply_run(txn, RunKeys(key, self.partitions), items)
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

    def _apply_run(self, txn: Transaction, keys: RunKeys, items: list[tuple[int, SourceRecord]]) -> None:
        """Apply one key's records of the batch, in order; the run's state is staged once."""
        poisoned = self._poisoned
        retention = self.retention
        topics, partitions = self.topics, self.partitions
        run: RunState | None = None
        was: Listed | None = None  # the run's listing before the batch (`relist_run`)
        loaded = False
        newest = -1  # the newest step event of the key, for the partition's retention clock
        self._links = {}
        for index, source in items:
            self._current, self._index = source, index
            if poisoned and source.coordinates in poisoned:
                self._dead_letter(
                    source, 'apply_error', f'applying the record raised {poisoned[source.coordinates]}'
                )
                continue
            try:
                record = check_record(source, keys, topics, partitions)
            except Rejected as rejected:
                self._dead_letter(source, rejected.reason, rejected.detail)
                continue
            assert source.value is not None and keys.run_id is not None
            if retention is not None and source.topic == EVENTS and record['timestamp'] > newest:
                newest = record['timestamp']
            if not loaded:
                run, loaded = txn.get_state(keys.run, RunState), True
                if run is not None:
                    was = listed(run)
            if run is None:
                if retention is not None and retention.is_expired(txn, keys.run_id):
                    self._outcome.expired_records += 1
                    continue
                if source.topic == EVENTS and record['kind'] in UNCHAINED_KINDS:
                    what, reason = _beside(record)
                    self._dead_letter(
                        source, reason, f'{what} for run {keys.run_id!r}, which has no run_started before it'
                    )
                    continue
                if not (source.topic == EVENTS and record['kind'] == 'run_started'):
                    parked = PARKED.key(keys.run_id, source.topic, source.partition, source.offset)
                    if txn.get(parked) is None:
                        txn.add_count(PARKED_COUNT, 1)
                    txn.put(parked, source.value)
                    self._parked.keep(parked, source.value, record)
                    continue
                run = register(txn, record)
                self._apply_registered(txn, keys, run, source, record)
                self._drain_parked(txn, keys, run)
            else:
                self._apply_registered(txn, keys, run, source, record)
        if newest >= 0:
            retention.saw(keys.home, newest)  # type: ignore[union-attr]
        if run is not None:
            advance_chain(txn, keys, run, self._links)
            relist_run(txn, run, was)
            txn.put_state(keys.run, run)
        if keys.effects:
            assert run is not None  # only a registered run's records change its calls
            reindex_effects(txn, keys, run)

    # -- record-level rules (no state): `_checks.py` ---------------------------------------------

    def check(self, source: SourceRecord) -> Fields:
        """The record's plain fields, or `Rejected` when it cannot apply whatever the state."""
        return check_record(source, RunKeys(source.key, self.partitions), self.topics, self.partitions)

    def _drain_parked(self, txn: Transaction, keys: RunKeys, run: RunState) -> None:
        """Apply what waited for the registration: step events first, each topic in log order."""
        for k, value in txn.scan(PARKED.prefix(run.run_id)):
            txn.delete(k)
            txn.add_count(PARKED_COUNT, -1)
            _, topic, partition, offset = PARKED.parse(k)
            assert isinstance(topic, int) and isinstance(partition, int) and isinstance(offset, int)
            source = SourceRecord(topic, partition, offset, keys.key, value)
            self._current = source
            failure = self._poisoned.get(source.coordinates)
            if failure is not None:
                detail = f'applying the record raised {failure}'
                self._run_dead_letter(txn, run, source, 'apply_error', detail)
                continue
            record = self._parked.take(k, value)
            self._apply_registered(txn, keys, run, source, record)

    # -- a registered run's records: ownership and seqs here, the rules in their modules ---------

    def _apply_registered(
        self, txn: Transaction, keys: RunKeys, run: RunState, source: SourceRecord, record: Fields
    ) -> None:
        """Apply one record of a registered run: the owner's by the seq rules, others' apart."""
        if source.topic == EFFECTS and record['status'] == 'resolved':
            self._apply_beside(txn, run, source, lambda: apply_resolution(txn, keys, run, source, record))
            return
        if source.topic == EVENTS and record['kind'] in UNCHAINED_KINDS:
            if record['kind'] == 'run_resumed':
                self._apply_beside(
                    txn, run, source, lambda: apply_resumed(txn, keys.home, run, record, self.retention)
                )
            elif record['kind'] == 'conversation_marked':
                self._apply_beside(txn, run, source, lambda: apply_marked(run, record))
            else:
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
                displaced = self._displaced
                applied = apply_event(
                    txn, keys, run, source, record, self.retention, self.max_snapshots, displaced
                )
                if displaced:  # transitions the event took the seq of (rare)
                    for dead in displaced:
                        self._run_dead_letter(txn, run, dead.source, dead.reason, dead.detail)
                    displaced.clear()
            else:
                applied = apply_transition(txn, keys, run, source, record)
        except Rejected as rejected:
            run.count_rejected(rejected.reason)
            self._run_dead_letter(txn, run, source, rejected.reason, rejected.detail)
            return
        if applied:
            assert source.value is not None  # checked: a record that applies has a value
            self._outcome.applied += 1
            self._links[seq] = link_of(source.value, record['prev_hash'], topic, source.partition)
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
        another writer says nothing about the owner and goes to the DLQ. A signed chain head
        (`chain_signed`) is read the same way: it is checked by `stepstream audit verify`.
        """
        if heartbeat['writer_id'] != run.owner:
            what, reason = _beside(heartbeat)
            self._run_dead_letter(
                txn,
                run,
                source,
                reason,
                f'{what} of writer {heartbeat["writer_id"]!r} for run {run.run_id!r}, '
                f'which writer {run.owner!r} owns',
            )
            return
        if heartbeat['timestamp'] > run.last_record_at:
            run.last_record_at = heartbeat['timestamp']
        self._outcome.applied += 1

    def _apply_beside(
        self, txn: Transaction, run: RunState, source: SourceRecord, rule: Callable[[], bool]
    ) -> None:
        """Apply a record another process wrote beside the run's trail by its `rule`.

        A resolution or decision, a resumption, a conversation's mark: the rule says applied (True),
        a duplicate (False), or raises `Rejected` for the DLQ.
        """
        try:
            applied = rule()
        except Rejected as rejected:
            self._run_dead_letter(txn, run, source, rejected.reason, rejected.detail)
            return
        if applied:
            self._outcome.applied += 1
        else:
            self._outcome.duplicates += 1

    def _keep_apart(self, txn: Transaction, run: RunState, source: SourceRecord, record: Fields) -> None:
        assert source.value is not None
        writer_id = record['writer_id']
        k = APART.key(run.run_id, writer_id, source.topic, record['seq'])
        if txn.get(k) is not None:
            self._outcome.duplicates += 1
            return
        txn.put(k, source.value)
        txn.count_conflict(CONFLICT.key(run.run_id, writer_id))
        if not run.conflicting_writers:
            txn.add_count(CONFLICTING_COUNT, 1)
        if writer_id not in run.conflicting_writers:
            run.conflicting_writers = sorted([*run.conflicting_writers, writer_id])
        self._outcome.applied += 1
