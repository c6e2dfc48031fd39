"""The tool-effect rules of a registered run's owner: transitions, resolutions, the indexes.

Each rule returns False for a duplicate and raises `Rejected` for the DLQ:

- `apply_transition`: a transition holds its seq, unless a step event holds it (step events
  win); the call's state is a max fold over its transitions (`_merge`), so arrival order is moot.
- `apply_resolution`: an operator's `resolved` transition joins the call's ledger, keyed by its
  offset; it decides the status if it answers the call's latest `started` (decision 0022).
- `withdraw_transition`: a step event took a transition's seq; the transition stops counting,
  and so do the resolutions only it came before.
- `reindex_effects`: the unresolved and waiting indexes of the calls a batch changed, once per call
  and batch.
"""

from __future__ import annotations

from typing import Any

from stepstream.projector._batch import EFFECTS, Rejected, Rejection, RunKeys, SourceRecord
from stepstream.schemas import Fields, read_record
from stepstream.storage import (
    COUNT,
    RESOLUTION,
    TRANSITION,
    UNRESOLVED,
    UNRESOLVED_COUNT,
    UNRESOLVED_RUN,
    WAITING,
    WAITING_AGENT,
    WAITING_CONVERSATION,
    WAITING_KIND,
    EffectState,
    RunState,
    Transaction,
    waiting_count,
)


def apply_transition(txn: Transaction, keys: RunKeys, run: RunState, source: SourceRecord, t: Fields) -> bool:
    """Apply the owner's tool-effect transition at its seq: False for a duplicate.

    A different record at a held seq raises `Rejected` (`duplicate_seq`); one at a seq a step
    event holds is kept dead, so that a repeat of it is a duplicate.
    """
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
        keys.effects[effect_key] = effect_index(effect, run)
    if effect is None:
        effect = EffectState(
            run_id=run.run_id, tool_call_id=t['tool_call_id'], tool_name=t['tool_name'], tool_name_seq=seq
        )
        txn.put_state(effect_key, effect)
    elif first:  # staged once per batch; later changes are to the staged object
        txn.put_state(effect_key, effect)
    _merge(effect, t)
    return True


def apply_resolution(txn: Transaction, keys: RunKeys, run: RunState, source: SourceRecord, r: Fields) -> bool:
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
        keys.effects[effect_key] = effect_index(effect, run)
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
            **{name: r[name] for name in ('args', 'result', 'error') if r[name] is not None},
        }
    )
    effect.resolutions.sort(key=_by_offset)
    effect.settle()
    return True


def withdraw_transition(
    txn: Transaction, keys: RunKeys, run: RunState, partition: int, seq: int, displaced: list[Rejection]
) -> None:
    """A step event took this seq: its transition stops counting and goes into `displaced` (for the DLQ)."""
    stored = txn.transition(keys.transition(seq))
    assert stored is not None
    offset, withdrawn = stored
    t = read_record(withdrawn)[1]
    effect_key = keys.effect(t['tool_call_id'])
    before = txn.get_state(effect_key, EffectState)
    if effect_key not in keys.effects:
        keys.effects[effect_key] = effect_index(before, run)
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
        displaced.append(
            Rejection(
                SourceRecord(EFFECTS, partition, r['offset'], keys.key, value),
                'unknown_effect',
                f'run {run.run_id!r} has no tool call {t["tool_call_id"]!r} before this resolution: '
                'nothing to resolve',
            )
        )
    if effect is None:
        txn.delete(effect_key)
    else:
        effect.settle()
        txn.put_state(effect_key, effect)
    run.count_rejected('duplicate_seq')
    displaced.append(
        Rejection(
            SourceRecord(EFFECTS, partition, offset, keys.key, withdrawn),
            'duplicate_seq',
            f'seq {seq} of run {run.run_id!r} also holds a step event, which takes precedence',
        )
    )


def reindex_effects(txn: Transaction, keys: RunKeys, run: RunState) -> None:
    """Index the calls of `run` whose effect the key's records changed in the batch, as they are after it."""
    for effect_key, before in keys.effects.items():
        reindex(txn, before, effect_index(txn.get_state(effect_key, EffectState), run))


def _by_offset(r: dict[str, Any]) -> int:
    return int(r['offset'])


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
        deferred = status == 'deferred'  # what it waits for, kept while it decides the status
        effect.deferral = t['deferral'] if deferred else None
        effect.args = t['args'] if deferred else None
        effect.deferral_metadata = t['deferral_metadata'] if deferred else None
    idempotency_key = t['idempotency_key']
    if idempotency_key is not None and seq > effect.idempotency_key_seq:
        effect.idempotency_key, effect.idempotency_key_seq = idempotency_key, seq
    summary = t['effect_summary']
    if summary is not None and seq > effect.effect_summary_seq:
        effect.effect_summary, effect.effect_summary_seq = summary, seq
    effect.last_seq = max(effect.last_seq, seq)
    if effect.resolutions:
        effect.settle()


def effect_index(effect: EffectState | None, run: RunState) -> tuple[bytes, ...]:
    """Where a call of `run` is listed, with the counts it adds one to: in doubt, or waiting for a decision.

    A waiting call is listed in `WAITING` and, for the filters of `list_waiting`, by its kind, its
    run's agent and its run's conversation (each filed by kind too): the run's agent and
    conversation are its registration's, which no later record changes.
    """
    if effect is None:
        return ()
    if effect.unresolved:
        assert effect.started_at is not None
        return (
            UNRESOLVED.key(effect.started_at, effect.run_id, effect.tool_call_id),
            UNRESOLVED_RUN.key(effect.run_id, effect.tool_call_id),
            UNRESOLVED_COUNT,
        )
    if effect.waiting and effect.deferral is not None and effect.ended_at is not None:
        kind, place = effect.deferral, (effect.ended_at, effect.run_id, effect.tool_call_id)
        keys = [WAITING.key(*place), WAITING_KIND.key(kind, *place), waiting_count(kind)]
        if run.agent_name is not None:
            keys.append(WAITING_AGENT.key(run.agent_name, kind, *place))
        if run.conversation_id is not None:
            keys.append(WAITING_CONVERSATION.key(run.conversation_id, kind, *place))
        return tuple(keys)
    return ()


def reindex(txn: Transaction, before: tuple[bytes, ...], after: tuple[bytes, ...]) -> None:
    """A call's index entries and counts change together, from the same state: they cannot disagree.

    `before` and `after` are `effect_index` of the call before the batch and after it (called once per
    call and batch: a call that starts and completes within one batch never touches the indexes).
    Its entries are deleted and put; a `COUNT` key among them is a count it takes one from or adds one to.
    """
    if before == after:
        return
    counter = COUNT.tag
    for k in before:
        if k not in after:
            if k[:1] == counter:
                txn.add_count(k, -1)
            else:
                txn.delete(k)
    for k in after:
        if k not in before:
            if k[:1] == counter:
                txn.add_count(k, 1)
            else:
                txn.put(k, b'')
