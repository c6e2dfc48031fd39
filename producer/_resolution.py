"""An operator's resolution of an effect in doubt, or a decision on a deferred call: a record on the log.

The projection never changes except by applying the log, so resolving an effect is a write like
any other: a `resolved` transition on the tool-effects topic (schema v2) that says what the
operator found out, who they are, which process wrote it, and why. It is not the run's record:
it takes no seq of the run (its `seq` names the `started` transition it answers), so it cannot
collide with the run's own writer. The caller reads the effect from the projection first; this
module only writes (decision 0022). A decision on a `deferred` call (approve, deny, return an outside
call's result or its error) is the same record answering the call's `deferred` transition (schema
v5, decision 0056): the first one in the log decides, and its note, arguments and result are
redacted as the run's own records are.
"""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic_core import to_json

from stepstream.erasure import SEALED_DECISION_ARGS, SEALED_DECISION_ERROR, SEALED_DECISION_RESULT
from stepstream.errors import EffectInFlight, NotUnknown, NotWaiting
from stepstream.ids import MAX_ID_BYTES
from stepstream.producer._protocol import StepLog
from stepstream.producer._redaction import Redaction
from stepstream.schemas import MAX_NOTE_CHARS, Decision, Resolution, ToolEffectRecord, ToolEffectTransition

if TYPE_CHECKING:
    from stepstream.erasure import ConversationKey


def resolver_id(role: str) -> str:
    """The writer id of a process that writes resolutions: its role, host and pid.

    ```python
    resolver_id('cli')  # 'stepstream-cli@build-7:4711'
    ```
    """
    return f'stepstream-{role}@{socket.gethostname()}:{os.getpid()}'.encode('ascii', 'replace').decode()[
        :MAX_ID_BYTES
    ]


def resolution_for(
    effect: ToolEffectRecord,
    *,
    resolution: Resolution,
    note: str,
    operator: str,
    writer_id: str,
    force: bool = False,
    redaction: Redaction | None = None,
) -> ToolEffectTransition:
    """The `resolved` transition answering `effect`, which must be `unknown_after_crash`.

    Its note is redacted with `redaction` (the default policy when None) before it reaches the log.

    Raises `NotUnknown` for an effect that completed, failed or was resolved already,
    `EffectInFlight` for a call whose run is still live (unless `force`: the operator knows its
    process is gone), and `ValueError` for an empty or too long note or an operator name the
    projector would refuse.
    """
    if effect.status != 'started':
        raise NotUnknown(
            f'tool call {effect.tool_call_id!r} of run {effect.run_id!r} is {effect.status}, not '
            'unknown_after_crash: only an effect that may or may not have happened is resolved by an operator'
        )
    if effect.in_flight and not force:
        raise EffectInFlight(
            f'tool call {effect.tool_call_id!r} of run {effect.run_id!r} is in flight: its run is live '
            '(its writer wrote or sent a heartbeat within the stale threshold), so the call may still '
            'end on its own. Wait until the run reads stale, or, if you know its process is gone, '
            'resolve it with force (`stepstream resolve --force`, "force": true in the API)'
        )
    if not note.strip() or len(note) > MAX_NOTE_CHARS:
        raise ValueError(f'a resolution needs a note of 1 to {MAX_NOTE_CHARS} characters saying why')
    redact = redaction if redaction is not None else Redaction()
    return _answer(
        effect,
        resolution,
        operator,
        writer_id,
        note=redact.text(note),
        idempotency_key=effect.idempotency_key,
    )


async def resolve_tool_effect(
    log: StepLog,
    effect: ToolEffectRecord,
    *,
    resolution: Resolution,
    note: str,
    operator: str,
    writer_id: str,
    force: bool = False,
    redaction: Redaction | None = None,
) -> ToolEffectTransition:
    """Append the operator's resolution of `effect` and wait until the broker acknowledged it.

    `effect` is what the projection shows (`ProjectionReader.get_tool_effect`); the projector
    then applies the record like any other, so the effect reads as `resolved` once it has.
    """
    record = resolution_for(
        effect,
        resolution=resolution,
        note=note,
        operator=operator,
        writer_id=writer_id,
        force=force,
        redaction=redaction,
    )
    await log.wait_acked([await log.append(record)])
    return record


def decision_for(
    effect: ToolEffectRecord,
    *,
    decision: Decision,
    operator: str,
    writer_id: str,
    note: str | None = None,
    args: dict[str, Any] | None = None,
    result: Any = None,
    message: str | None = None,
    redaction: Redaction | None = None,
    key: ConversationKey | None = None,
) -> ToolEffectTransition:
    """The `resolved` transition that decides `effect`, a call that waits (`deferred`, undecided).

    `approved` may carry `args` the call runs with instead of its own; `denied` carries `message`
    (what the model is told), `failed` the outside call's error as `message`, `returned` its `result`
    (any JSON value). The note, the arguments and the result are redacted with `redaction` (the
    default policy when None); with `key` (the run's conversation's, erasure on) the arguments, the
    result and the message are then sealed (decision 0033). Raises `NotWaiting` (with the decision
    that stands, if any) for a call that does not wait, and `ValueError` for what the projector would refuse.
    """
    if effect.status != 'deferred':
        decided = effect.resolution if effect.resolution is not None and effect.deferral else None
        state = (
            f'decided already ({decided.resolution} by {decided.resolved_by})' if decided else effect.status
        )
        raise NotWaiting(
            f'tool call {effect.tool_call_id!r} of run {effect.run_id!r} does not wait for a decision: '
            f'it is {state}',
            decided,
        )
    if decision in ('approved', 'denied') and effect.deferral not in ('approval', None):
        waits = 'an answer' if effect.deferral == 'question' else 'an outside result'
        raise ValueError(
            f'tool call {effect.tool_call_id!r} waits for {waits}, not an approval: '
            'complete it with its result or its error'
        )
    if decision in ('returned', 'failed') and effect.deferral == 'approval':
        raise ValueError(f'tool call {effect.tool_call_id!r} waits for an approval: approve or deny it')
    if (decision in ('denied', 'failed')) != (message is not None):
        raise ValueError('a denial or a failure says why (message), and no other decision does')
    if message is not None and not 0 < len(message) <= MAX_NOTE_CHARS:
        raise ValueError(f'the message is 1 to {MAX_NOTE_CHARS} characters')
    if args is not None and (decision != 'approved' or not isinstance(args, dict)):
        raise ValueError('only an approval carries arguments, as a JSON object')
    if note is not None and (not note.strip() or len(note) > MAX_NOTE_CHARS):
        raise ValueError(f'a note, when given, is 1 to {MAX_NOTE_CHARS} characters')
    redact = redaction if redaction is not None else Redaction()
    content = {
        SEALED_DECISION_ARGS: None if args is None else to_json(redact.value(args)).decode(),
        SEALED_DECISION_RESULT: to_json(redact.value(result)).decode() if decision == 'returned' else None,
        SEALED_DECISION_ERROR: redact.text(message),
    }
    if key is not None:
        where = (effect.run_id, effect.tool_call_id)
        content = {c: None if v is None else key.seal_text(v, *where, c) for c, v in content.items()}
    return _answer(
        effect,
        decision,
        operator,
        writer_id,
        note=redact.text(note),
        args=content[SEALED_DECISION_ARGS],
        result=content[SEALED_DECISION_RESULT],
        error=content[SEALED_DECISION_ERROR],
    )


def _answer(
    effect: ToolEffectRecord,
    resolution: Resolution | Decision,
    operator: str,
    writer_id: str,
    **fields: Any,
) -> ToolEffectTransition:
    """The `resolved` transition answering the transition that decides `effect`'s status, by `operator`.

    A resolution and a decision alike: it takes no seq of the run (its `seq` names what it answers).
    `ValueError` for an operator name the projector would refuse.
    """
    if not operator or len(operator) > MAX_ID_BYTES or not operator.isprintable():
        raise ValueError(f'the operator name {operator!r:.80} is empty, too long or not printable')
    return ToolEffectTransition(
        run_id=effect.run_id,
        seq=effect.status_seq,
        writer_id=writer_id,
        timestamp=datetime.now(UTC),
        tool_call_id=effect.tool_call_id,
        tool_name=effect.tool_name,
        status='resolved',
        resolution=resolution,
        resolved_by=operator,
        **fields,
    )


async def decide_deferred_call(
    log: StepLog,
    effect: ToolEffectRecord,
    *,
    decision: Decision,
    operator: str,
    writer_id: str,
    conversation_id: str | None = None,
    **what: Any,
) -> ToolEffectTransition:
    """Append a decision on `effect` (`decision_for`'s arguments) and wait until the broker acknowledged it.

    With erasure on (the log has a sealer), its content (arguments, result, message) is sealed with
    the key of `conversation_id`, the run's conversation (its `RunRecord.conversation_id`, or its run
    id when it has none), which must then be given. The first decision in the log decides: read the
    call back from the projection once it has applied the record (`ProjectionReader.get_tool_effect`)
    to learn whether this one stands.
    """
    key = None
    content = decision == 'returned' or what.get('args') is not None or what.get('message') is not None
    if log.sealer is not None and content:
        if conversation_id is None:
            raise ValueError(
                "erasure is on: a decision is sealed with the key of its run's conversation (conversation_id)"
            )
        key = await log.sealer.key_for(conversation_id)
    record = decision_for(effect, decision=decision, operator=operator, writer_id=writer_id, key=key, **what)
    await log.wait_acked([await log.append(record)])
    return record
