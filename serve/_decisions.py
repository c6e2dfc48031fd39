"""Decisions on deferred calls over HTTP: what waits across runs, and a person's decision, written to the log.

The write is `Resolutions`' (the service's one log, started on the first write), the record the
producer's `decide_deferred_call` (decision 0056): the first decision in the log decides, later ones
are history. So a decision is answered once the projection shows it: it stands (`Decided`), or an
earlier one won (`Refused`, with the one that stands). In a group, the member that owns the run's
partition writes it, as it does a resolution; the list of what waits merges every member's part.
"""

from __future__ import annotations

import heapq
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from stepstream.errors import NotFound, NotWaiting
from stepstream.producer import Redaction, decide_deferred_call, resolver_id
from stepstream.readmodel import WaitingCall, decode_waiting_cursor, encode_waiting_cursor
from stepstream.schemas import Decision, Deferral, EffectResolution, ToolEffectRecord, ToolEffectTransition
from stepstream.serve._models import Decided, DecisionConflict, Deferred, DeferredPage, ToolEffect
from stepstream.serve._models import Resolution as ResolutionModel
from stepstream.serve._source import Source

DECISION_PATHS: dict[Decision, str] = {'approved': 'approve', 'denied': 'deny', 'returned': 'complete'}
"""The API's route (under `/api/runs/{run_id}/calls/{tool_call_id}/`) of each decision a person makes;
`failed` is `complete` with an `error`."""


class Refused(Exception):
    """A decision that does not decide its call: the 409's body says why and which one stands."""

    def __init__(self, conflict: DecisionConflict) -> None:
        """Refused for the reason `conflict` gives."""
        super().__init__(conflict.detail)
        self.conflict = conflict


def deferred(call: WaitingCall, now: datetime) -> Deferred:
    """The API's shape of a waiting call, with how long it had waited at `now`."""
    shape = Deferred.of(call)
    shape.waited_s = round(max((now - call.waiting_since).total_seconds(), 0.0), 3)
    return shape


def _order(call: Deferred) -> tuple[datetime, str, str]:
    """The order of the `WAITING` index: since when, then run and call."""
    return (call.waiting_since, call.run_id, call.tool_call_id)


class Decisions:
    """The waiting calls and the decisions on them, for one service's `Source`.

    It reaches the source's group routing (`_owner`, `_there`, `_merging`, `_everyone`) and its
    `Resolutions` (the log it writes with): decisions are the source's second write.
    """

    def __init__(self, source: Source) -> None:
        """Answer for `source`'s projection (and its group's)."""
        self.source = source

    async def waiting(
        self,
        *,
        agent_name: str | None = None,
        conversation_id: str | None = None,
        kind: Deferral | None = None,
        newest_first: bool = False,
        after: str | None = None,
        limit: int = 50,
    ) -> DeferredPage:
        """One page of the calls that wait (oldest first, or newest), with the cursor of the next.

        `BadCursor` (400) for an `after` no page gave. In a group, every member's page is merged.
        """
        source = self.source
        cursor = None if after is None else decode_waiting_cursor(after)
        found = await source.reader.list_waiting(
            newest_first=newest_first,
            limit=limit + 1,
            after=cursor,
            agent_name=agent_name,
            conversation_id=conversation_id,
            deferral=kind,
        )
        now = datetime.now(UTC)
        parts = [[deferred(c, now) for c in found]]
        more = len(found) > limit
        if source._merging():
            params = {
                'agent': agent_name,
                'conversation': conversation_id,
                'kind': kind,
                'newest': newest_first,
                'after': after,
                'limit': limit,
            }
            for answer in await source._everyone('/api/deferred', params):
                page = DeferredPage.model_validate(answer)
                parts.append(page.calls)
                more = more or page.next_after is not None
        merged = list(heapq.merge(*parts, key=_order, reverse=newest_first))
        calls = merged[:limit]
        more = more or len(merged) > limit
        last = calls[-1] if calls else None
        return DeferredPage(
            calls=calls,
            next_after=encode_waiting_cursor(_order(last)) if more and last is not None else None,
        )

    async def decide(
        self, run_id: str, tool_call_id: str, *, decision: Decision, operator: str | None, **what: Any
    ) -> Decided:
        """Write `decision` on the call (`decision_for`'s `note`, `args`, `result`, `message`).

        `NotFound` for an unknown run or call, `Refused` when the call does not wait (never
        deferred, or decided already) or an earlier decision won, `ValueError` for a decision the
        call cannot take. Returns once the projection shows it (`applied`) or the settings' timeout
        passed.
        """
        source = self.source
        if url := source._owner(run_id):
            return await self._forward(url, run_id, tool_call_id, decision, operator, what)
        run = await source.run_record(run_id)
        effect = await source.reader.get_tool_effect(run_id, tool_call_id)
        if effect is None:
            raise NotFound(f'run {run_id!r} has no tool call {tool_call_id!r} in the projection')
        resolutions = source._resolutions
        try:
            record = await decide_deferred_call(
                await resolutions.writer(),
                effect,
                decision=decision,
                operator=operator or source.settings.serve.operator_name,
                writer_id=resolver_id('serve'),
                conversation_id=run.conversation_id or run_id,
                redaction=Redaction.from_settings(source.settings),
                **what,
            )
        except NotWaiting as exc:
            raise Refused(_conflict(str(exc), exc.decision)) from None
        shown = await resolutions.wait_shown(record)
        now = shown or effect
        written = _written(now, record)
        if shown is not None and not written.applied:
            standing = shown.resolution
            who = f'{standing.resolution} by {standing.resolved_by}' if standing is not None else shown.status
            detail = (
                f'tool call {tool_call_id!r} of run {run_id!r} was decided first ({who}): '
                'this decision is history'
            )
            raise Refused(_conflict(detail, standing, written))
        return Decided(written=written, applied=shown is not None, effect=ToolEffect.of(now))

    async def _forward(
        self, url: str, run_id: str, call: str, decision: Decision, operator: str | None, what: dict[str, Any]
    ) -> Decided:
        """The decision written by the member that owns the run (its 409 body kept whole)."""
        body: dict[str, Any] = {'note': what.get('note'), 'operator': operator}
        if decision == 'approved':
            body['args'] = what.get('args')
        elif decision == 'denied':
            body['message'] = what.get('message')
        elif decision == 'returned':
            body['result'] = what.get('result')
        else:
            body['error'] = what.get('message')
        route = DECISION_PATHS.get(decision, 'complete')
        path = f'/api/runs/{quote(run_id, safe="")}/calls/{quote(call, safe="")}/{route}'
        try:
            answer = await self.source._there(url, path, method='POST', body=body)
        except NotWaiting as exc:
            raise Refused(DecisionConflict.model_validate(exc.decision)) from None
        return Decided.model_validate(answer)


def _written(effect: ToolEffectRecord, record: ToolEffectTransition) -> ResolutionModel:
    """`record` as the call's ledger keeps it, or as written when the projection does not show it yet."""
    for r in effect.resolutions:
        if (r.writer_id, r.resolved_at) == (record.writer_id, record.timestamp):
            return ResolutionModel.of(r)
    return ResolutionModel(
        resolution=record.resolution or 'approved',  # a decision always says which
        resolved_by=record.resolved_by or '',
        writer_id=record.writer_id,
        resolved_at=record.timestamp,
        note=record.note or '',
        resolves_seq=record.seq,
        args=record.args,
        result=record.result,
        error=record.error,
        applied=False,
    )


def _conflict(
    detail: str, standing: object | None, written: ResolutionModel | None = None
) -> DecisionConflict:
    decision = ResolutionModel.of(standing) if isinstance(standing, EffectResolution) else None
    return DecisionConflict(detail=detail, decision=decision, written=written)
