"""The explorer's pages of deferred calls: what waits (`/deferred`), and the forms that decide a call.

Each deferred call on the Waiting page and on its run's page carries forms: approve (optionally with
changed arguments) or deny an approval; give a question's or an outside call's result, or its
error. A form posts here (same origin only, as the Resolve form), the decision is written as the
API writes it (`Decisions`), and the page that answers says what was recorded, and as whose, or why
not.

Who decided: the service's token is one shared secret that names nobody (it says who may decide,
not who did), so a form takes the person's name (`by`, optional) as the API takes `operator`;
left empty, the service's operator (`STEPSTREAM_OPERATOR`, else its OS user) is recorded.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from stepstream.schemas import DEFERRALS, Decision
from stepstream.serve._decisions import Decisions, Refused
from stepstream.serve._explorer import _page, _same_origin, error_page
from stepstream.serve._resolve_page import named_by

router = APIRouter(include_in_schema=False, default_response_class=HTMLResponse)

WAITING_PAGE = 100
"""The waiting calls one page of the explorer shows; a link leads to the next."""


def _decisions(request: Request) -> Decisions:
    found: Decisions = request.app.state.decisions
    return found


@router.get('/deferred')
async def waiting(
    request: Request,
    agent: str = '',
    conversation: str = '',
    kind: str = '',
    newest: bool = False,
    after: str = '',
) -> Response:
    """The deferred calls that wait for a decision, across runs: longest waiting first, or `newest=1`."""
    filters = {'agent': agent, 'conversation': conversation, 'kind': kind if kind in DEFERRALS else ''}
    page = await _decisions(request).waiting(
        agent_name=agent or None,
        conversation_id=conversation or None,
        kind=filters['kind'] or None,  # type: ignore[arg-type]  # one of DEFERRALS
        newest_first=newest,
        after=after or None,
        limit=WAITING_PAGE,
    )
    query: dict[str, Any] = {k: v for k, v in filters.items() if v} | ({'newest': 1} if newest else {})
    more = f'/deferred?{urlencode({**query, "after": page.next_after})}' if page.next_after else None
    return _page(
        request,
        'waiting.html',
        page=page,
        filters=filters,
        kinds=sorted(DEFERRALS),
        newest=newest,
        more=more,
        operator=_decisions(request).source.settings.serve.operator_name,
    )


@router.post('/runs/{run_id}/calls/{tool_call_id}/decide')
async def decide(request: Request, run_id: str, tool_call_id: str) -> Response:
    """A decide form of a deferred call: write the decision, then say what was recorded (or why not)."""
    if not _same_origin(request):
        return error_page(request, 403, "a decision must be posted from this service's own pages")
    form = {k: v[0] for k, v in parse_qs((await request.body()).decode('utf-8', 'replace')).items()}
    by = None
    try:
        decision, what = decision_of(form)
        by = named_by(form)
        decided = await _decisions(request).decide(
            run_id, tool_call_id, decision=decision, operator=by, **what
        )
    except Refused as exc:
        return _page(
            request, 'decided.html', 409, run_id=run_id, tool_call_id=tool_call_id, conflict=exc.conflict
        )
    except ValueError as exc:
        return error_page(request, 422, str(exc))
    return _page(
        request,
        'decided.html',
        run_id=run_id,
        tool_call_id=tool_call_id,
        decided=decided,
        named=by is not None,
    )


def decision_of(form: dict[str, str]) -> tuple[Decision, dict[str, Any]]:
    """The decision a decide form posted, and what it says (`decision_for`'s keywords).

    `ValueError` for a form no page of ours posts, or arguments (or a JSON result) that do not parse.
    """
    action, note = form.get('decision', ''), form.get('note', '').strip() or None
    if action == 'approve':
        text = form.get('args', '').strip()
        args = _json(text, 'the changed arguments are') if text else None
        if args is not None and not isinstance(args, dict):
            raise ValueError('the changed arguments are a JSON object: {"name": value, ...}')
        return 'approved', {'note': note, 'args': args}
    if action == 'deny':
        return 'denied', {'note': note, 'message': form.get('message', '').strip()}
    if action == 'complete':
        outcome, value = form.get('outcome', ''), form.get('value', '')
        if outcome == 'error':
            return 'failed', {'note': note, 'message': value.strip()}
        if outcome == 'json':
            return 'returned', {'note': note, 'result': _json(value, 'the result is')}
        if outcome == 'text':
            return 'returned', {'note': note, 'result': value}
    raise ValueError('approve, deny or complete the call with one of its forms')


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise ValueError(f'{what} not JSON: {text!r:.80}') from None
