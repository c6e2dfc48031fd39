"""The step-event rules of a registered run's owner: registration, events, status, snapshots.

- `register`: a run is registered by the first `run_started` in its partition; its writer owns
  it, and the run is listed (`_listing`: by its start, status, agent, conversation, parent).
- `apply_event`: a step event holds its seq (displacing a tool-effect transition there, which
  `withdraw_transition` dead-letters); the terminal event with the highest seq gives the status;
  model request and tool call ends add to the run's sums (`add_usage`); a snapshot is saved once
  per `snapshot_seq`, and with a retention policy its media are indexed (decisions 0010, 0032).
- `_retain`: with `max_snapshots_per_run`, which snapshots the read side still lists
  (docs/decisions/0006-snapshot-retention.md).
- `_keyed_again`: a snapshot whose idempotency key the run applied already is kept for the deltas
  after it, never listed (decision 0058).

`apply_event` returns False for a duplicate and raises `Rejected` for the DLQ.
"""

from __future__ import annotations

from stepstream.media import snapshot_media
from stepstream.projector._batch import Rejected, Rejection, RunKeys, SourceRecord
from stepstream.projector._chain import rewind_chain
from stepstream.projector._conversations import note_prompts
from stepstream.projector._listing import list_run
from stepstream.projector._retention import Retention
from stepstream.projector._tool_effects import withdraw_transition
from stepstream.projector._usage import TIMED_KINDS, add_usage
from stepstream.schemas import Fields
from stepstream.storage import SNAPSHOT_KEY, RunState, SnapshotEntry, Transaction, ranges_add, ranges_hold

TERMINAL_KINDS = {
    'run_completed': 'completed',
    'run_failed': 'failed',
    'run_cancelled': 'cancelled',
    'run_waiting': 'waiting',
}


def register(txn: Transaction, started: Fields) -> RunState:
    """Register the run of a `run_started`: its state, owned by its writer, listed (`list_run`)."""
    run = RunState(
        run_id=started['run_id'],
        owner=started['writer_id'],
        started_at=started['timestamp'],
        conversation_id=started['conversation_id'],
        parent_run_id=started['parent_run_id'],
        agent_name=started['agent_name'],
        metadata=dict(started['metadata']),
    )
    list_run(txn, run)
    return run


def apply_event(
    txn: Transaction,
    keys: RunKeys,
    run: RunState,
    source: SourceRecord,
    event: Fields,
    retention: Retention | None,
    max_snapshots: int | None,
    displaced: list[Rejection],
) -> bool:
    """Apply the owner's step event at its seq: False for a duplicate.

    `retention` (None: keep every run) and `max_snapshots` (None: list them all) are the
    projection's options. A transition this event displaces goes into `displaced`, with any
    resolution that only it made valid, for the caller to dead-letter.
    """
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
        withdraw_transition(txn, keys, run, source.partition, seq, displaced)
        rewind_chain(txn, keys, run, seq)
    else:
        run.claim(seq)
    txn.put(event_key, source.value)
    if retention is not None and snap is not None:
        retention.referenced(txn, run.run_id, snapshot_media(snap['messages'], snap['media']))
    kind = event['kind']
    if kind in TERMINAL_KINDS:
        if retention is not None and kind != 'run_waiting':  # a run that waits is kept while it waits
            retention.ended(txn, keys.home, run.run_id, event['timestamp'])
        if seq > run.terminal_seq:
            run.terminal_seq = seq
            run.status = TERMINAL_KINDS[kind]  # its listings move at the batch's end (`relist_run`)
            run.ended_at = event['timestamp']
            run.error = event['error']
    elif kind in TIMED_KINDS:
        add_usage(run, event)
    elif snap is not None:
        snapshot_seq = snap['snapshot_seq']
        ranges_add(run.snapshots, snapshot_seq)
        if run.conversation_id is not None:  # its title (until one is set) and what search finds it by
            note_prompts(run, snapshot_seq, snap['messages'])
        entry = SnapshotEntry(
            seq=seq,
            snapshot_seq=snapshot_seq,
            state=snap['state'],
            step_index=event['step_index'],
            prefix_len=snap['prefix_len'],
            timestamp=event['timestamp'],
            idempotency_key=event['idempotency_key'],
        )
        if _keyed_again(txn, run, event['idempotency_key']):
            entry.retained = False  # its delta stays: the next snapshot's is relative to it
            txn.put_state(keys.snapshot(snapshot_seq), entry)
        else:
            txn.put_state(keys.snapshot(snapshot_seq), entry)
            if max_snapshots is not None:
                _retain(txn, keys, run, snapshot_seq, snap['state'], max_snapshots)
    return True


def _retain(txn: Transaction, keys: RunKeys, run: RunState, snapshot_seq: int, state: str, keep: int) -> None:
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


def _keyed_again(txn: Transaction, run: RunState, key: str | None) -> bool:
    """Whether a snapshot keyed `key` repeats one the run applied, and if not, remember its key.

    As the reference's stores decide: a key `N:...` (a non-negative sequence, as capabilities
    write) repeats when `N` is below the highest sequence applied, or equal with the same key; only
    the keys at that sequence are kept. Any other key repeats when the run applied it before, kept
    in `SNAPSHOT_KEY` for as long as the run is (retention of its snapshots does not forget it).
    """
    if key is None:
        return False
    head, colon, _ = key.partition(':')
    sequence = int(head) if colon and head.isdecimal() else None
    if sequence is None:
        k = SNAPSHOT_KEY.key(run.run_id, key)
        if txn.get(k) is not None:
            return True
        txn.put(k, b'')
        return False
    if sequence < run.snapshot_key_high or (
        sequence == run.snapshot_key_high and key in run.snapshot_keys_at_high
    ):
        return True
    if sequence > run.snapshot_key_high:
        run.snapshot_key_high, run.snapshot_keys_at_high = sequence, [key]
    else:
        run.snapshot_keys_at_high.append(key)
    return False
