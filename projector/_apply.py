"""Applying log records to the projection: idempotent, order-safe, deterministic.

Every rule here depends only on the set of records applied, never on their arrival order, so
a clean rebuild from offset zero gives the same state as a projector that crashed and resumed
a hundred times. A run's records are merged by `seq` across both topics; a `seq` that was
applied before is a duplicate and changes nothing; a `seq` that has not arrived while later
ones have is a gap, recorded on the run.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from stepstream.errors import SchemaError
from stepstream.ids import check_run_id
from stepstream.projector._store import SEP, BatchTxn, key
from stepstream.schemas import (
    EVENT_KINDS,
    TOOL_EFFECT_STATUSES,
    LogRecord,
    StepEvent,
    ToolEffectTransition,
    decode,
)

TERMINAL_KINDS = {'run_completed': 'completed', 'run_failed': 'failed'}


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def micros(ts: datetime) -> int:
    """A timestamp as exact integer microseconds since the epoch (how the log carries it)."""
    return (ts - _EPOCH) // _MICROSECOND


def validate(record: LogRecord, kafka_key: bytes | None) -> None:
    """Reject a record the projection cannot apply safely; it goes to the DLQ instead."""
    try:
        check_run_id(record.run_id)
    except ValueError as exc:
        raise SchemaError(str(exc)) from None
    if kafka_key is not None and kafka_key != record.run_id.encode():
        raise SchemaError(f'record key {kafka_key!r} is not its run_id {record.run_id!r}')
    if record.seq < 0:
        raise SchemaError(f'negative seq {record.seq}')
    if isinstance(record, StepEvent):
        if record.kind not in EVENT_KINDS:
            raise SchemaError(f'unknown event kind {record.kind!r}')
        if (record.kind == 'snapshot_saved') != (record.snapshot is not None):
            raise SchemaError('a snapshot payload belongs to snapshot_saved events, and only to them')
        snap = record.snapshot
        if snap is not None:
            if snap.state not in ('complete', 'interrupted') or snap.prefix_len < 0 or snap.snapshot_seq < 0:
                raise SchemaError(
                    f'invalid snapshot header {snap.state!r} {snap.prefix_len} {snap.snapshot_seq}'
                )
            try:
                tail = json.loads(snap.messages)
            except ValueError as exc:
                raise SchemaError(f'snapshot messages are not JSON: {exc}') from None
            if not isinstance(tail, list):
                raise SchemaError('snapshot messages are not a JSON list')
    elif record.status not in TOOL_EFFECT_STATUSES:
        raise SchemaError(f'unknown tool effect status {record.status!r}')


def apply_record(txn: BatchTxn, record: LogRecord, raw: bytes, *, max_snapshots: int | None = None) -> bool:
    """Apply one validated record; returns False for a duplicate (nothing changed).

    A run belongs to the writer of the first `run_started` in its step-events partition (log
    order, so a rebuild agrees). Records that arrive before that registration (the other topic
    can be ahead) are parked and applied when it comes; records of any other writer claiming
    the same run_id are kept apart and the run is listed under conflicts.
    """
    run_key = key(b'r', record.run_id)
    run: dict[str, Any] | None = txn.get_json(run_key)
    owner = run['registration_id'] if run is not None else None
    if owner is None:
        if not (isinstance(record, StepEvent) and record.kind == 'run_started'):
            txn.put(key(b'q', record.run_id, record.writer_id, record.seq), raw)
            return True
        run = run or _new_run(record)
        run['registration_id'] = record.writer_id
        applied = _apply_owned(txn, run, record, raw, max_snapshots)
        _drain_parked(txn, run, max_snapshots)
        txn.put_json(run_key, run)
        return applied
    assert run is not None
    if record.writer_id != owner:
        _keep_apart(txn, run, record.writer_id, record.seq, raw)
        txn.put_json(run_key, run)
        return True
    applied = _apply_owned(txn, run, record, raw, max_snapshots)
    txn.put_json(run_key, run)
    return applied


def _drain_parked(txn: BatchTxn, run: dict[str, Any], max_snapshots: int | None) -> None:
    for k, raw in txn.scan(key(b'q', run['run_id']) + SEP):
        txn.delete(k)
        _, _, writer, seq = k.split(SEP)
        if writer.decode() == run['registration_id']:
            _apply_owned(txn, run, decode(raw), raw, max_snapshots)
        else:
            _keep_apart(txn, run, writer.decode(), int(seq), raw)


def _keep_apart(txn: BatchTxn, run: dict[str, Any], writer_id: str, seq: int, raw: bytes) -> None:
    record_key = key(b'w', run['run_id'], writer_id, seq)
    if txn.get(record_key) is not None:
        return
    txn.put(record_key, raw)
    conflict_key = key(b'k', run['run_id'], writer_id)
    conflict = txn.get_json(conflict_key) or {'records': 0}
    conflict['records'] += 1
    txn.put_json(conflict_key, conflict)
    if writer_id not in run['conflicting_writers']:
        run['conflicting_writers'] = sorted([*run['conflicting_writers'], writer_id])


def _apply_owned(
    txn: BatchTxn, run: dict[str, Any], record: LogRecord, raw: bytes, max_snapshots: int | None
) -> bool:
    if not _claim_seq(run, record.seq):
        return False
    run['event_count'] += 1
    ts = micros(record.timestamp)
    if run['started_at'] is None or ts < run['started_at']:
        _reindex_run(txn, run, ts)
    if isinstance(record, StepEvent):
        _apply_event(txn, run, record, raw, ts, max_snapshots)
    else:
        _apply_effect(txn, record, ts)
    return True


def _new_run(record: LogRecord) -> dict[str, Any]:
    # Every record carries the run envelope, so whichever topic delivers first can register it.
    return {
        'run_id': record.run_id,
        'conversation_id': record.conversation_id,
        'parent_run_id': record.parent_run_id,
        'agent_name': record.agent_name,
        'metadata': {},
        'started_at': None,
        'registration_id': None,
        'status': 'running',
        'terminal_seq': -1,
        'ended_at': None,
        'error': None,
        'event_count': 0,
        'last_seq': -1,
        'missing': [],
        'conflicting_writers': [],
    }


def _claim_seq(run: dict[str, Any], seq: int) -> bool:
    last = run['last_seq']
    if seq > last:
        run['missing'].extend(range(last + 1, seq))
        run['last_seq'] = seq
        return True
    if seq in run['missing']:
        run['missing'].remove(seq)
        return True
    return False


def _index_keys(run: dict[str, Any], ts: int) -> list[bytes]:
    keys = [key(b'a', ts, run['run_id'])]
    if run['conversation_id'] is not None:
        keys.append(key(b'c', run['conversation_id'], ts, run['run_id']))
    if run['parent_run_id'] is not None:
        keys.append(key(b'p', run['parent_run_id'], ts, run['run_id']))
    return keys


def _reindex_run(txn: BatchTxn, run: dict[str, Any], ts: int) -> None:
    """Indexes order runs by their earliest record (the `run_started` once it has arrived)."""
    if run['started_at'] is not None:
        for k in _index_keys(run, run['started_at']):
            txn.delete(k)
    run['started_at'] = ts
    for k in _index_keys(run, ts):
        txn.put(k, b'')


def _apply_event(
    txn: BatchTxn, run: dict[str, Any], event: StepEvent, raw: bytes, ts: int, max_snapshots: int | None
) -> None:
    txn.put(key(b'e', event.run_id, event.seq), raw)
    if event.kind == 'run_started':
        run['metadata'] = dict(event.metadata)
        run['agent_name'] = event.agent_name
    elif event.kind in TERMINAL_KINDS and event.seq > run['terminal_seq']:
        run['terminal_seq'] = event.seq
        run['status'] = TERMINAL_KINDS[event.kind]
        run['ended_at'] = ts
        run['error'] = event.error
    elif event.snapshot is not None:
        snap = event.snapshot
        entry = {
            'seq': event.seq,
            'snapshot_seq': snap.snapshot_seq,
            'state': snap.state,
            'step_index': event.step_index,
            'prefix_len': snap.prefix_len,
            'timestamp': ts,
            'idempotency_key': event.idempotency_key,
            'retained': True,
        }
        txn.put_json(key(b's', event.run_id, snap.snapshot_seq), entry)
        if max_snapshots is not None:
            _retain(txn, run, snap.snapshot_seq, snap.state, max_snapshots)


def _retain(txn: BatchTxn, run: dict[str, Any], snapshot_seq: int, state: str, keep: int) -> None:
    """Keep the newest `keep` snapshots, the newest complete one and the newest overall.

    Retention hides snapshots from the read side; their deltas stay, because later snapshots
    are reconstructed through them (see docs/decisions/0006-snapshot-retention.md). The
    candidates are tracked on the run, so this costs O(keep) per snapshot, not O(snapshots).
    """
    retained: list[int] = run.setdefault('retained_snapshots', [])
    if snapshot_seq in retained:
        return
    retained.append(snapshot_seq)
    retained.sort()
    if state == 'complete' and snapshot_seq > run.get('newest_complete_snapshot', -1):
        run['newest_complete_snapshot'] = snapshot_seq
    keep_set = set(retained[-keep:]) | {retained[-1], run.get('newest_complete_snapshot', -1)}
    for dropped in [s for s in retained if s not in keep_set]:
        retained.remove(dropped)
        entry_key = key(b's', run['run_id'], dropped)
        entry = txn.get_json(entry_key)
        if entry is not None:
            entry['retained'] = False
            txn.put_json(entry_key, entry)


def _apply_effect(txn: BatchTxn, t: ToolEffectTransition, ts: int) -> None:
    """Merge a transition into the call's record; each field keeps the value of its newest `seq`."""
    effect_key = key(b'x', t.run_id, t.tool_call_id)
    effect: dict[str, Any] | None = txn.get_json(effect_key)
    if effect is None:
        effect = {
            'run_id': t.run_id,
            'tool_call_id': t.tool_call_id,
            'tool_name': t.tool_name,
            'status': 'started',
            'status_seq': -1,
            'started_at': None,
            'ended_at': None,
            'idempotency_key': None,
            'idempotency_key_seq': -1,
            'effect_summary': None,
            'effect_summary_seq': -1,
            'error': None,
            'last_seq': -1,
        }
    was_unresolved = effect['status_seq'] >= 0 and effect['status'] == 'started'
    old_started = effect['started_at']
    if t.status == 'started':
        effect['started_at'] = ts if old_started is None else min(ts, old_started)
    if t.status != 'annotated' and t.seq > effect['status_seq']:
        effect['status'] = t.status
        effect['status_seq'] = t.seq
        effect['ended_at'] = ts if t.status != 'started' else None
        effect['error'] = t.error
    for name in ('idempotency_key', 'effect_summary'):
        value = getattr(t, name)
        if value is not None and t.seq > effect[f'{name}_seq']:
            effect[name] = value
            effect[f'{name}_seq'] = t.seq
    effect['last_seq'] = max(effect['last_seq'], t.seq)
    is_unresolved = effect['status'] == 'started' and effect['status_seq'] >= 0
    if was_unresolved:
        txn.delete(key(b'u', old_started or 0, t.run_id, t.tool_call_id))
        txn.delete(key(b'U', t.run_id, t.tool_call_id))
    if is_unresolved:
        txn.put(key(b'u', effect['started_at'] or 0, t.run_id, t.tool_call_id), b'')
        txn.put(key(b'U', t.run_id, t.tool_call_id), b'')
    txn.put_json(effect_key, effect)
