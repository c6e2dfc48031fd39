"""The explorer's resolve form of a call in doubt: the resolution written, and the page that says so.

The form sits on the run's page under each call in doubt and posts here (same origin only); the
resolution is written as the API writes it (`Source.resolve`), and the page that answers names what
was recorded and as whose (`decided.html`, a decision's page too).

Who resolved: the service's token is one shared secret that names nobody, so the form takes the
person's name (`by`, optional), as the decision forms do (`named_by`); left empty, the service's
operator (`STEPSTREAM_OPERATOR`, else its OS user) is recorded.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from stepstream.serve._explorer import _page, _same_origin, _source, error_page

router = APIRouter(include_in_schema=False, default_response_class=HTMLResponse)


MAX_BY_CHARS = 200
"""The longest name a form's `by` may give (the API's `operator` takes as long)."""


def named_by(form: dict[str, str]) -> str | None:
    """Who a form says acts (`by`), or None (the service's operator); `ValueError` for too long a name.

    The service's token names nobody (it says who may write, not who did), so a form asks.
    """
    by = form.get('by', '').strip() or None
    if by is not None and len(by) > MAX_BY_CHARS:
        raise ValueError(f'a name of at most {MAX_BY_CHARS} characters, got {len(by)}')
    return by


@router.post('/runs/{run_id}/effects/{tool_call_id}/resolve')
async def resolve(request: Request, run_id: str, tool_call_id: str) -> Response:
    """The resolve form of a highlighted unknown effect: append the resolution, say what was recorded.

    The page that answers names the resolution, its note, the call's status now and who is recorded
    as resolving it (`by`, else the service's operator), as a decision's does.
    """
    if not _same_origin(request):
        return error_page(request, 403, "a resolution must be posted from this service's own pages")
    form = {k: v[0] for k, v in parse_qs((await request.body()).decode('utf-8', 'replace')).items()}
    resolution, note = form.get('resolution', ''), form.get('note', '')
    if resolution not in ('happened', 'did_not_happen') or not note.strip():
        return error_page(request, 422, 'say whether the side effect happened, and why (a note)')
    try:
        by = named_by(form)
        resolved = await _source(request).resolve(
            run_id,
            tool_call_id,
            resolution='happened' if resolution == 'happened' else 'did_not_happen',
            note=note,
            operator=by,
        )
    except ValueError as exc:  # a name the log would refuse
        return error_page(request, 422, str(exc))
    return _page(
        request,
        'decided.html',
        run_id=run_id,
        tool_call_id=tool_call_id,
        decided=resolved,
        resolution=True,
        named=by is not None,
    )
