"""Our read model's records as the reference's: what maps to what, and what has no counterpart.

Each function takes a record the `ProjectionReader` returns and gives the pydantic-ai-harness
record of the same fact. A field the reference's record lacks is dropped, never renamed into
another; a status or kind the reference lacks reads as what the reference itself records for the
same run (the tables below; docs/migrating.md shows them, decision 0059 says why).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from stepstream.erasure import ContentErased
from stepstream.reference._harness import harness
from stepstream.schemas import DECISIONS, REFERENCE_EVENT_KINDS

if TYPE_CHECKING:
    from pydantic_ai_harness.step_persistence import ContinuableSnapshot as ReferenceSnapshot
    from pydantic_ai_harness.step_persistence import RunRecord as ReferenceRun
    from pydantic_ai_harness.step_persistence import StepEvent as ReferenceEvent
    from pydantic_ai_harness.step_persistence import ToolEffectRecord as ReferenceEffect

    from stepstream.schemas import ContinuableSnapshot, RunRecord, StepEvent, ToolEffectRecord

OWN_METADATA = 'stepstream.'
"""The metadata keys stepstream adds (`stepstream.redaction`, `stepstream.resumes`, ...): dropped."""

EVENT_KIND: Mapping[str, str | None] = {
    'run_started': 'run_started',
    'run_completed': 'run_completed',
    'run_failed': 'run_failed',
    'model_request_started': 'model_request_started',
    'model_request_completed': 'model_request_completed',
    'model_request_failed': 'model_request_failed',
    'tool_call_started': 'tool_call_started',
    'tool_call_completed': 'tool_call_completed',
    'tool_call_failed': 'tool_call_failed',
    # The reference's `after_run` ends a run whose output is `DeferredToolRequests` as completed.
    'run_waiting': 'run_completed',
    # The reference's `on_run_error` sees a cancelled run as failed with `CancelledError()`.
    'run_cancelled': 'run_failed',
    # No counterpart: the reference records a deferred call's start and nothing more, keeps no
    # snapshot events (its snapshots are their own records), and has no heartbeats, signed chain
    # heads, resumption marks or conversation marks (its conversation store is apart).
    'tool_call_deferred': None,
    'snapshot_saved': None,
    'run_heartbeat': None,
    'chain_signed': None,
    'run_resumed': None,
    'conversation_marked': None,
}
"""Our event kind -> the reference's (`None`: the event is left out of `list_events`)."""
assert {k for k, v in EVENT_KIND.items() if v == k} == REFERENCE_EVENT_KINDS

EFFECT_STATUS: Mapping[str, str] = {
    'started': 'started',
    'annotated': 'started',  # annotated while it runs: it has not ended
    'completed': 'completed',
    'failed': 'failed',
    # The reference keeps a deferred call `started` for good (its body raised `CallDeferred`, or it
    # waits for an approval): it never ends in that run, whatever is decided for it later.
    'deferred': 'started',
}
"""Our effect status -> the reference's; `resolved` goes by what resolved it (`RESOLVED`)."""

RESOLVED: Mapping[str, str] = {
    'happened': 'completed',
    'did_not_happen': 'failed',
    **dict.fromkeys(DECISIONS, 'started'),  # a decided deferred call: as `deferred`
}
"""An operator's resolution of a call in doubt, or a decision on a deferred call -> the reference's status."""

NO_TIME = datetime.min.replace(tzinfo=UTC)
"""The `started_at` of a run whose start the projection has not seen (a gap): it sorts first."""


def user_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """The metadata the user gave, without the keys stepstream adds."""
    return {k: v for k, v in metadata.items() if not k.startswith(OWN_METADATA)}


def run_record(run: RunRecord) -> ReferenceRun:
    """The reference's `RunRecord`: lineage, the user's metadata, the start and who registered it.

    Status, end, usage, chain, seq and the rest stay in our record; `registration_id` is the
    writer that registered the run, as the reference's is its registration.
    """
    started = run.started_at or run.ended_at or run.last_record_at or NO_TIME
    record: ReferenceRun = harness().RunRecord(
        run_id=run.run_id,
        conversation_id=run.conversation_id,
        parent_run_id=run.parent_run_id,
        agent_name=run.agent_name,
        metadata=user_metadata(run.metadata),
        started_at=started,
        registration_id=run.registration_id,
    )
    return record


def events(trail: Sequence[StepEvent]) -> list[ReferenceEvent]:
    """The run's events the reference has a kind for, in log order, with the reference's keys.

    Our capability keys an event by its `seq` (`{seq}:{step}:{kind}:{tool_call_id}`), which counts
    every record of the run; the reference's by its place among the run's events. A key in our
    capability's form is given in the reference's; any other key (an imported one) as stored.
    """
    StepEvent = harness().StepEvent
    out: list[ReferenceEvent] = []
    for event in trail:
        kind = EVENT_KIND.get(event.kind)
        if kind is None:
            continue
        key = event.idempotency_key
        tool_call = event.tool_call_id or ''
        if key == f'{event.seq}:{event.step_index}:{event.kind}:{tool_call}':
            key = f'{len(out)}:{event.step_index}:{kind}:{tool_call}'
        out.append(
            StepEvent(
                run_id=event.run_id,
                kind=kind,
                step_index=event.step_index,
                timestamp=event.timestamp,
                conversation_id=event.conversation_id,
                parent_run_id=event.parent_run_id,
                agent_name=event.agent_name,
                tool_call_id=event.tool_call_id,
                tool_name=event.tool_name,
                error=event.error,
                metadata=user_metadata(event.metadata),
                idempotency_key=key,
            )
        )
    return out


def snapshot(snap: ContinuableSnapshot) -> ReferenceSnapshot:
    """The reference's `ContinuableSnapshot`: the full history, its state and the reference's key.

    Raises `ContentErased` for a snapshot whose content `stepstream forget` erased: an empty
    history would continue a run from nothing.
    """
    if snap.erased:
        raise ContentErased(
            f'the content of run {snap.run_id!r} (conversation {snap.conversation_id!r}) was erased: '
            'its structure remains, its messages cannot be continued from'
        )
    key = snap.idempotency_key
    if key == f'{snap.seq}:{snap.step_index}:snapshot_saved:':
        key = f'{snap.snapshot_seq}:{snap.step_index}:{snap.state}'
    made: ReferenceSnapshot = harness().ContinuableSnapshot(
        run_id=snap.run_id,
        step_index=snap.step_index,
        messages=list(snap.messages),
        conversation_id=snap.conversation_id,
        parent_run_id=snap.parent_run_id,
        agent_name=snap.agent_name,
        timestamp=snap.timestamp or NO_TIME,
        state=snap.state,
        idempotency_key=key,
    )
    return made


def effect_status(effect: ToolEffectRecord) -> str:
    """The reference's status of a call: `started` (not ended), `completed` or `failed`."""
    if effect.status == 'resolved':
        decided = effect.resolution.resolution if effect.resolution is not None else None
        return RESOLVED.get(decided or '', 'started')
    return EFFECT_STATUS[effect.status]


def effect(record: ToolEffectRecord) -> ReferenceEffect | None:
    """The reference's `ToolEffectRecord` of one call, or None for a call that never started in its run.

    A call that waited for an approval before it ran has no `started` transition: the reference's
    ledger records a call as its body starts, so it has no record of it. A failed call's error is
    its `effect_summary` when it has none of its own (the reference keeps the error there); a call
    the reference sees as not ended has no `ended_at`.
    """
    if record.started_at is None:
        return None
    status = effect_status(record)
    summary = record.effect_summary
    if summary is None and status == 'failed':
        summary = record.error
    made: ReferenceEffect = harness().ToolEffectRecord(
        tool_call_id=record.tool_call_id,
        tool_name=record.tool_name,
        run_id=record.run_id,
        status=status,
        started_at=record.started_at,
        ended_at=None if status == 'started' else record.ended_at,
        idempotency_key=record.idempotency_key,
        effect_summary=summary,
    )
    return made
