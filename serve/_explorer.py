"""The run explorer: server-rendered pages over the same `Source` the JSON API reads.

No build step: Jinja templates and one small script and stylesheet, committed beside this file.
Every page is a plain GET, so a link to it can be shared; the forms that post are `/login`, the
resolve form of an unknown effect (`_resolve_page`) and the decide forms (`_waiting_pages`), both
same origin only.
"""

from __future__ import annotations

import asyncio
import importlib.util
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from stepstream.console import other_topic_seqs, seq_note, timeline, waits_for
from stepstream.errors import NotFound
from stepstream.ids import short_id
from stepstream.producer import FORKED_FROM
from stepstream.schemas import CHAIN_STATUSES, RUN_STATUSES
from stepstream.serve._auth import TOKEN_COOKIE, token_matches
from stepstream.serve._models import Run
from stepstream.serve._public import public_detail
from stepstream.serve._run_view import (
    duration_ms,
    json_text,
    link_delegates,
    millis,
    money,
    siblings,
    tool_io,
    totals,
    waterfall,
)
from stepstream.serve._source import Source
from stepstream.serve._views import diff, message_views

templates = Jinja2Templates(directory=Path(__file__).parent / 'templates')


def trace_href(template: str | None, trace_id: str | None, span_id: str | None) -> str | None:
    """The trace viewer's link for an event's trace (`settings.serve.trace_url`), or None without one."""
    if template is None or trace_id is None:
        return None
    return template.replace('{trace_id}', quote(trace_id, safe='')).replace(
        '{span_id}', quote(span_id or '', safe='')
    )


def ago(ts: datetime | None) -> str:
    """How long ago `ts` was, for a person (`3.2 s ago`), or `never`."""
    if ts is None:
        return 'never'
    seconds = max((datetime.now(UTC) - ts).total_seconds(), 0.0)
    return f'{seconds:.1f} s ago' if seconds < 120 else f'{seconds / 60:.0f} min ago'


templates.env.globals['trace_href'] = trace_href
templates.env.globals['ago'] = ago
templates.env.globals['millis'] = millis
templates.env.globals['money'] = money
templates.env.globals['json_text'] = json_text
templates.env.globals['waits_for'] = waits_for
templates.env.filters['short_id'] = short_id  # the CLI's tables shorten ids the same way
router = APIRouter(include_in_schema=False, default_response_class=HTMLResponse)


def _source(request: Request) -> Source:
    found: Source = request.app.state.source
    return found


def _page(request: Request, name: str, code: int = 200, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, name, context, status_code=code)


def error_page(request: Request, status_code: int, detail: str) -> Response:
    """The explorer's page for a failed read (no such run, a shard not readable here, ...).

    The page never names a place on the server (`public_detail`): the log has the whole message.
    """
    shown = public_detail(request, status_code, detail)
    return _page(request, 'error.html', status_code, status_code=status_code, detail=shown)


@router.get('/')
async def runs(
    request: Request,
    conversation_id: str = '',
    agent_name: str = '',
    status: str = '',
    parent_run_id: str = '',
    chain: str = '',
    after: str = '',
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    rows: bool = False,
    flat: bool = False,
) -> Response:
    """The runs, newest first, with filters; `rows=1` gives only the table body (live refresh).

    A delegate is drawn under its parent when both are on the page; `flat=1` lists every run
    in its own place.
    """
    filters = {
        'conversation_id': conversation_id,
        'agent_name': agent_name,
        'status': status if status in RUN_STATUSES else '',
        'parent_run_id': parent_run_id,
        'chain': chain if chain in CHAIN_STATUSES else '',
    }
    source = _source(request)
    page, counts = await asyncio.gather(
        source.runs(
            conversation_id=conversation_id or None,
            parent_run_id=parent_run_id or None,
            status=filters['status'] or None,
            agent_name=agent_name or None,
            chain=filters['chain'] or None,
            newest_first=True,
            after=after or None,
            limit=limit,
        ),
        source.counts(),
    )
    query: dict[str, Any] = {k: v for k, v in filters.items() if v} | ({'flat': 1} if flat else {})
    more = f'/?{urlencode({**query, "after": page.next_after})}' if page.next_after else None
    live = f'/?{urlencode({**query, "rows": 1, **({"after": after} if after else {})})}'
    name = '_runs_rows.html' if rows else 'runs.html'
    now = datetime.now(UTC)
    listed = [(0, r) for r in page.runs] if flat else nested(page.runs)
    other_view = (
        f'/?{urlencode({k: v for k, v in query.items() if k != "flat"} | ({} if flat else {"flat": 1}))}'
    )
    return _page(
        request,
        name,
        page=page,
        listed=[(depth, r, duration_ms(r, now)) for depth, r in listed],
        flat=flat,
        other_view=other_view,
        filters=filters,
        statuses=RUN_STATUSES,
        chains=CHAIN_STATUSES,
        counts=counts,
        more=more,
        live=live,
    )


def nested(runs: list[Run]) -> list[tuple[int, Run]]:
    """The runs with each delegate under its parent (when its parent is among them), with depths.

    Parents keep their place in the list; a parent's delegates follow it in the order they started.
    """
    ids = {r.run_id for r in runs}
    children: dict[str, list[Run]] = {}
    for r in runs:
        if r.parent_run_id is not None and r.parent_run_id in ids and r.parent_run_id != r.run_id:
            children.setdefault(r.parent_run_id, []).append(r)
    out: list[tuple[int, Run]] = []
    seen: set[str] = set()

    def add(run: Run, depth: int) -> None:
        if run.run_id in seen:
            return
        seen.add(run.run_id)
        out.append((depth, run))
        for child in sorted(children.get(run.run_id, []), key=_started):
            add(child, depth + 1)

    for r in runs:
        if r.parent_run_id is None or r.parent_run_id not in ids:
            add(r, 0)
    for r in runs:  # a cycle of parents (a hostile log) still lists every run
        add(r, 0)
    return out


def _started(run: Run) -> tuple[str, str]:
    return (run.started_at.isoformat() if run.started_at else '', run.run_id)


@router.get('/runs/{run_id}')
async def run(request: Request, run_id: str) -> Response:
    """A run: status, lineage, the timeline of its steps and effects, its snapshots.

    Its siblings are the other runs of its conversation, but for its parent and its children; a
    delegating call links the child runs it started (`link_delegates`: placed by time).

    The timeline has each resolution and decision on its calls at its time, among its events.

    Its calls in doubt come first, each with a Resolve form; then those in flight, and those
    deferred (each saying what it waits for, with its arguments), neither of which can be resolved.
    """
    source = _source(request)
    record = await source.run(run_id)
    lineage = await source.lineage(run_id)
    children = (await source.runs(parent_run_id=run_id, limit=1000)).runs
    conversation = []
    if record.conversation_id is not None:
        conversation = (await source.runs(conversation_id=record.conversation_id, limit=1000)).runs
    parent = None
    if record.parent_run_id is not None:
        parent = next((n.run for n in lineage.tree if n.run.run_id == record.parent_run_id), None)
    effects = await source.effects(run_id)
    events = await source.events(run_id)
    snapshots = (await source.snapshots(run_id, limit=1000)).snapshots
    latest, io = None, {}
    if snapshots:
        snap = await source.snapshot(run_id, snapshots[-1].snapshot_seq)
        latest, io = message_views(snap.messages), tool_io(snap.messages)
    now = datetime.now(UTC)
    by_call = {e.tool_call_id: e for e in effects}
    spans = waterfall(record, events, by_call, io, now)
    link_delegates(record, spans, children)
    return _page(
        request,
        'run.html',
        run=record,
        lineage=lineage,
        parent=parent,
        children=children,
        siblings=siblings(record, conversation, children),
        forks=[r for r in conversation if r.metadata.get(FORKED_FROM) == run_id],
        events=timeline(events, effects),
        seq_note=seq_note(
            other_topic_seqs(events, record.last_seq, record.gaps),
            'the Tool effects table below shows those calls',
        ),
        trace_url=source.settings.serve.trace_url,
        effects=by_call,
        totals=totals(record, now, effects),
        spans=spans,
        unknown=[e for e in effects if e.unknown_after_crash],
        in_flight=[e for e in effects if e.in_flight],
        deferred=[e for e in effects if e.status == 'deferred'],
        snapshots=snapshots,
        latest=latest,
        operator=source.settings.serve.operator_name,
    )


@router.get('/runs/{run_id}/snapshots/{snapshot_seq}')
async def snapshot(request: Request, run_id: str, snapshot_seq: int) -> Response:
    """One snapshot's history, rendered."""
    source = _source(request)
    record = await source.run(run_id)
    snap = await source.snapshot(run_id, snapshot_seq)
    summaries = (await source.snapshots(run_id, limit=1000)).snapshots
    return _page(
        request,
        'snapshot.html',
        run=record,
        snapshot=snap,
        history=message_views(snap.messages),
        snapshots=summaries,
    )


@router.get('/runs/{run_id}/diff')
async def snapshot_diff(
    request: Request, run_id: str, a: int | None = None, b: int | None = None
) -> Response:
    """Two snapshots of a run side by side: what stayed, what changed, what was added."""
    source = _source(request)
    record = await source.run(run_id)
    summaries = (await source.snapshots(run_id, limit=1000)).snapshots
    if not summaries:
        raise NotFound(f'run {run_id!r} has no snapshots to compare')
    seqs = [s.snapshot_seq for s in summaries]
    b = seqs[-1] if b is None else b
    a = (seqs[-2] if len(seqs) > 1 else seqs[-1]) if a is None else a
    left, right = await source.snapshot(run_id, a), await source.snapshot(run_id, b)
    return _page(
        request, 'diff.html', run=record, a=a, b=b, seqs=seqs, rows=diff(left.messages, right.messages)
    )


def _same_origin(request: Request) -> bool:
    """Whether a form post comes from a page of this service (no other site may post one).

    Without a token the service has no other gate, so a page elsewhere must not make a browser
    on this machine post a resolution. Browsers say where a request comes from in
    `Sec-Fetch-Site`; older ones send `Origin` (which our `no-referrer` policy may turn to `null`).
    """
    site = request.headers.get('sec-fetch-site')
    if site is not None:
        return site == 'same-origin'
    origin = request.headers.get('origin')
    if origin is None:
        return True  # not a browser's form post (curl, a script with the token)
    return urlsplit(origin).netloc == request.headers.get('host', '')


UNRESOLVED_PAGE = 200
"""The unresolved calls one page of the explorer shows; a link leads to the next."""


@router.get('/unresolved')
async def unresolved(
    request: Request,
    after_started: datetime | None = None,
    after_run_id: str = '',
    after_tool_call_id: str = '',
) -> Response:
    """The tool calls that have not ended, across runs: in doubt (`unknown_after_crash`) or in flight.

    Oldest first, a page at a time; the link under a full page starts after its last call.
    """
    after = None if after_started is None else (after_started, after_run_id, after_tool_call_id)
    effects = await _source(request).unresolved(limit=UNRESOLVED_PAGE + 1, after=after)
    more = None
    if len(effects) > UNRESOLVED_PAGE:
        effects = effects[:UNRESOLVED_PAGE]
        last = effects[-1]
        cursor = {'after_started': last.started_at, 'after_run_id': last.run_id}
        more = f'/unresolved?{urlencode({**cursor, "after_tool_call_id": last.tool_call_id})}'
    return _page(request, 'unresolved.html', effects=effects, more=more)


@router.get('/status')
async def status(request: Request, rows: bool = False) -> Response:
    """Lag per partition, apply rate, DLQ counts and the newest dead letters."""
    source = _source(request)
    name = '_status_body.html' if rows else 'status.html'
    return _page(
        request,
        name,
        status=await source.status(),
        dlq=await source.dead_letters(50),
        conflicts=await source.conflicts(),
    )


@router.get('/docs')
async def docs(request: Request) -> Response:
    """The API's interactive docs: Swagger UI over `/openapi.json`, from this service's own files."""
    if swagger_ui_assets() is None:
        return error_page(
            request,
            404,
            "the API docs need Swagger UI's files: pip install 'stepstream[serve]' (swagger-ui-py)",
        )
    return _page(request, 'docs.html')


@router.get('/login')
async def login_form(request: Request, next: str = '/') -> Response:
    """Asks for the service's bearer token (kept in a cookie for the explorer's pages)."""
    return _page(request, 'login.html', next=_local(next), failed=False)


@router.post('/login')
async def login(request: Request) -> Response:
    """Checks the token; on success sets the cookie and goes where the person was going."""
    form = parse_qs((await request.body()).decode('utf-8', 'replace'))
    given, target = form.get('token', [''])[0], _local(form.get('next', ['/'])[0])
    token: str | None = request.app.state.token
    if token is None:
        return RedirectResponse(target, status_code=303)
    if not token_matches(given, token):
        return _page(request, 'login.html', 401, next=target, failed=True)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(TOKEN_COOKIE, given, httponly=True, samesite='strict', path='/')
    return response


def _local(target: str) -> str:
    """Only a path of this service: `/login?next=` must never send a person elsewhere."""
    local = target.startswith('/') and not target.startswith('//') and '\\' not in target
    return target if local else '/'


def swagger_ui_assets() -> Path | None:
    """Where the swagger-ui-py package keeps Swagger UI's files (the `serve` extra installs it).

    Found without importing the package (its `__init__` loads handlers for other frameworks);
    None when it is missing, and `/docs` then says how to install it.
    """
    spec = importlib.util.find_spec('swagger_ui')
    if spec is None or not spec.submodule_search_locations:
        return None
    static = Path(next(iter(spec.submodule_search_locations))) / 'static'
    return static if (static / 'swagger-ui-bundle.js').is_file() else None
