"""The JSON API: one route per read of the projection, each answering a model of `_models`."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from stepstream.console import VIEW_HEADER, ViewArgs, conversations, show
from stepstream.errors import BadCursor, NotFound
from stepstream.schemas import ChainStatus, Deferral, RunStatus
from stepstream.serve._group_conversations import conversation_reads
from stepstream.serve._models import (
    Counts,
    DeadLetters,
    Event,
    Lineage,
    Problem,
    Resolved,
    ResolveRequest,
    Run,
    RunPage,
    Snapshot,
    SnapshotPage,
    Status,
    ToolEffect,
)
from stepstream.serve._public import public_detail
from stepstream.serve._source import Source

NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {'model': Problem, 'description': 'No such run or snapshot in the projection.'}
}
UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {'model': Problem, 'description': 'A shard this read needs is not readable here (ShardUnavailable).'}
}
RunId = Annotated[str, Path(description='The run_id.')]
SAFE_MEDIA_TYPES = ('image/', 'audio/', 'video/')
"""Media types served as themselves; anything else is a download, never rendered in our origin."""

router = APIRouter(prefix='/api', responses=UNAVAILABLE)


def source(request: Request) -> Source:
    """The service's `Source` (set by `create_app`)."""
    found: Source = request.app.state.source
    return found


BAD_AFTER: dict[int | str, dict[str, Any]] = {
    400: {'model': Problem, 'description': "An `after` that is no page's `next_after` (says why)."}
}


@router.get('/runs', response_model=RunPage, summary='List runs', responses=BAD_AFTER)
async def list_runs(
    request: Request,
    conversation_id: str | None = None,
    parent_run_id: str | None = None,
    status: RunStatus | None = None,
    agent_name: str | None = None,
    chain: Annotated[
        ChainStatus | None,
        Query(description='Only runs whose hash chain reads so (`broken`: an index of its own).'),
    ] = None,
    order: Annotated[
        Literal['started', '-started'],
        Query(description='-started (the default, as the explorer): newest first; started: oldest first'),
    ] = '-started',
    after: Annotated[str | None, Query(description="The previous page's next_after.")] = None,
    after_started: Annotated[
        datetime | None,
        Query(
            description='With `after`: its started_at. The page then starts at that place in the order '
            'even if `after` is not a run this service holds (how group members merge their pages).'
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> RunPage:
    """Runs matching every filter, newest first as in the explorer (`order=started`: oldest first)."""
    return await source(request).runs(
        conversation_id=conversation_id,
        parent_run_id=parent_run_id,
        status=status,
        agent_name=agent_name,
        chain=chain,
        newest_first=order == '-started',
        after=after,
        after_started=after_started,
        limit=limit,
    )


@router.get('/runs/{run_id}', response_model=Run, summary='One run', responses=NOT_FOUND)
async def get_run(request: Request, run_id: RunId) -> Run:
    """A run's lineage and status."""
    return await source(request).run(run_id)


@router.get(
    '/runs/{run_id}/events', response_model=list[Event], summary='Events of a run', responses=NOT_FOUND
)
async def list_events(request: Request, run_id: RunId) -> list[Event]:
    """The run's step events in seq order."""
    return await source(request).events(run_id)


@router.get(
    '/runs/{run_id}/tool-effects',
    response_model=list[ToolEffect],
    summary='Tool effects of a run',
    responses=NOT_FOUND,
)
async def list_tool_effects(request: Request, run_id: RunId) -> list[ToolEffect]:
    """Every tool effect of the run, in the order the calls started."""
    return await source(request).effects(run_id)


@router.get(
    '/runs/{run_id}/snapshots', response_model=SnapshotPage, summary='Snapshots of a run', responses=NOT_FOUND
)
async def list_snapshots(
    request: Request,
    run_id: RunId,
    after: Annotated[
        int | None, Query(ge=-1, description='Only snapshots with a later snapshot_seq.')
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> SnapshotPage:
    """The run's retained snapshots (complete and interrupted), oldest first, without messages."""
    return await source(request).snapshots(run_id, after=after, limit=limit)


@router.get(
    '/runs/{run_id}/snapshots/latest', response_model=Snapshot, summary='Latest snapshot', responses=NOT_FOUND
)
async def latest_snapshot(request: Request, run_id: RunId) -> Snapshot:
    """The newest snapshot of any state, with its messages."""
    return await source(request).snapshot_json(run_id)


@router.get(
    '/runs/{run_id}/snapshots/{snapshot_seq}',
    response_model=Snapshot,
    summary='One snapshot',
    responses=NOT_FOUND,
)
async def get_snapshot(request: Request, run_id: RunId, snapshot_seq: Annotated[int, Path(ge=0)]) -> Snapshot:
    """One retained snapshot with its messages (Pydantic AI's JSON, media as links)."""
    return await source(request).snapshot_json(run_id, snapshot_seq)


@router.get('/runs/{run_id}/lineage', response_model=Lineage, summary='Lineage of a run', responses=NOT_FOUND)
async def lineage(request: Request, run_id: RunId) -> Lineage:
    """The root of the run's lineage and the whole tree under it."""
    return await source(request).lineage(run_id)


@router.post(
    '/runs/{run_id}/tool-effects/{tool_call_id}/resolution',
    response_model=Resolved,
    summary='Resolve an unknown effect',
    responses={
        **NOT_FOUND,
        400: {'model': Problem, 'description': 'A note of blanks, or an operator name the log refuses.'},
        409: {
            'model': Problem,
            'description': 'The effect is not unknown_after_crash: it ended, was resolved, is deferred '
            '(it waits for a decision or a result), or is still in flight (its run is live; `force` '
            'overrides that, never the others).',
        },
    },
)
async def resolve(
    request: Request,
    run_id: RunId,
    tool_call_id: Annotated[str, Path(description='The tool call whose effect is unknown_after_crash.')],
    body: ResolveRequest,
) -> Resolved:
    """Record whether an `unknown_after_crash` effect happened, who says so and why.

    The resolution is appended to the tool-effects topic (an audited write, never a change of the
    projection); the answer comes once the broker acknowledged it, with the effect as this
    service's projection shows it then (`applied`: whether it shows the resolution yet).
    """
    try:
        return await source(request).resolve(
            run_id,
            tool_call_id,
            resolution=body.resolution,
            note=body.note,
            operator=body.operator,
            force=body.force,
        )
    except ValueError as exc:  # a note of blanks, an operator name the log would refuse
        raise HTTPException(400, str(exc)) from None


@router.get('/unresolved', response_model=list[ToolEffect], summary='Unresolved tool effects')
async def unresolved(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=1000, description='At most this many calls.')] = 1000,
    after_started: Annotated[
        datetime | None, Query(description="The previous page's last call's started_at.")
    ] = None,
    after_run_id: Annotated[str | None, Query(description="The previous page's last call's run_id.")] = None,
    after_tool_call_id: Annotated[
        str | None, Query(description="The previous page's last call's tool_call_id.")
    ] = None,
) -> list[ToolEffect]:
    """The tool calls that have not ended, across all runs, oldest first: a page of `limit`.

    Each row says whether it is `in_flight` (its run is live) or `unknown_after_crash`. A full
    page may have more after it: ask again with its last call's `started_at`, `run_id` and
    `tool_call_id` as `after_started`, `after_run_id` and `after_tool_call_id`. `after_started`
    alone starts at the calls that started then; the ids mean nothing without it.
    """
    after = None if after_started is None else (after_started, after_run_id or '', after_tool_call_id or '')
    return await source(request).unresolved(limit=limit, after=after)


@router.get('/conflicts', response_model=list[Run], summary='Run id conflicts')
async def conflicts(request: Request) -> list[Run]:
    """Runs whose run_id was claimed by more than one writer."""
    return await source(request).conflicts()


@router.get('/dlq', response_model=DeadLetters, summary='Dead letters')
async def dead_letters(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> DeadLetters:
    """The newest records of the `{prefix}.dlq` topic, with why each was dead-lettered."""
    return await source(request).dead_letters(limit)


@router.get('/counts', response_model=Counts | None, summary='Runs per status and agent, calls in doubt')
async def counts(request: Request) -> Counts | None:
    """Tallies the projector keeps as it applies: no run is read to count them.

    In a group, every member's summed. Null when a shard predates the counts (rebuild it) or is
    not readable.
    """
    return await source(request).counts()


@router.get('/status', response_model=Status, summary='Projection status and lag')
async def status(request: Request) -> Status:
    """Applied offsets, lag per partition, apply rate, DLQ and conflict counts, shards."""
    return await source(request).status()


@router.get(
    '/media/{sha256}',
    summary='Offloaded media',
    response_class=Response,
    responses={
        200: {
            'content': {'application/octet-stream': {}},
            'description': 'The bytes, checked against sha256.',
        },
        **NOT_FOUND,
        422: {'model': Problem, 'description': 'Not a SHA-256.'},
    },
)
async def media(
    request: Request,
    sha256: Annotated[str, Path(pattern='^[0-9a-f]{64}$')],
    media_type: Annotated[str, Query(max_length=200)] = 'application/octet-stream',
) -> Response:
    """The payload whose SHA-256 this is, verified before it is sent.

    Images, audio and video are sent as their type; anything else as a download, so a payload
    cannot run as a page of this origin.
    """
    data = await source(request).media(sha256, media_type)
    safe = media_type.startswith(SAFE_MEDIA_TYPES) and media_type != 'image/svg+xml'
    headers = {
        'X-Content-Type-Options': 'nosniff',
        'Content-Security-Policy': "sandbox; default-src 'none'",
        'Cache-Control': 'private, max-age=31536000, immutable',
    }
    if not safe:
        headers['Content-Disposition'] = f'attachment; filename="{sha256[:16]}.bin"'
    return Response(data, media_type=media_type if safe else 'application/octet-stream', headers=headers)


CONSOLE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        'content': {'text/plain': {'schema': {'type': 'string'}}},
        'description': 'What `stepstream VIEW ...` prints.',
    },
    **NOT_FOUND,
    **BAD_AFTER,
    409: {
        'model': Problem,
        'description': "A group member's service (but for `conversations`): the CLI reads the shards itself.",
    },
}


@router.get(
    '/console/{view}',
    response_class=Response,
    summary='A CLI view over every run, as the CLI prints it',
    responses=CONSOLE_RESPONSES,
)
async def console(
    request: Request,
    view: Annotated[
        Literal['runs', 'unresolved', 'conflicts', 'deferred', 'conversations'], Path(description='The view.')
    ],
    conversation_id: str | None = None,
    parent_run_id: str | None = None,
    status: RunStatus | None = None,
    agent_name: str | None = None,
    chain: ChainStatus | None = None,
    json: bool = False,
    limit: Annotated[int | None, Query(ge=1, le=1000, description='`runs`: the page size (50).')] = None,
    after: Annotated[
        str | None,
        Query(description='`runs`: after this run; `deferred`, `conversations`: a cursor.'),
    ] = None,
    oldest_first: Annotated[bool, Query(description='`runs`: in the order they started.')] = False,
    deferral: Annotated[Deferral | None, Query(description='`deferred`: calls of this kind.')] = None,
    newest_first: Annotated[bool, Query(description='`deferred`: the last to start waiting first.')] = False,
    archived: Annotated[
        Literal['true', 'false'] | None, Query(description='`conversations`: only archived, or only not.')
    ] = None,
    search: Annotated[
        str | None, Query(max_length=1000, description='`conversations`: only those holding these words.')
    ] = None,
    wide: Annotated[
        bool, Query(description='A table with every column, each id in full (else 120 columns).')
    ] = False,
) -> Response:
    """The text (with `json`, the JSON) `stepstream VIEW` prints, read from this service's projection.

    The CLI asks this when a stack's or a configured service is at hand, rather than opening the
    shards itself (`stepstream.console`: the same view function either way).
    """
    args = ViewArgs(
        conversation_id=conversation_id,
        parent_run_id=parent_run_id,
        status=status,
        agent_name=agent_name,
        chain=chain,
        json=json,
        limit=limit,
        after=after,
        oldest_first=oldest_first,
        deferral=deferral,
        newest_first=newest_first,
        archived=archived,
        search=search,
        wide=wide,
    )
    return await _console(request, view, args)


@router.get(
    '/console/{view}/{run_id}',
    response_class=Response,
    summary='A CLI view of one run, as the CLI prints it',
    responses=CONSOLE_RESPONSES,
)
async def console_run(
    request: Request,
    view: Annotated[
        Literal['tree', 'events', 'snapshot', 'effects', 'unresolved'], Path(description='The view.')
    ],
    run_id: RunId,
    include_interrupted: bool = False,
    json: bool = False,
    wide: Annotated[
        bool, Query(description='A table with every column, each id in full (else 120 columns).')
    ] = False,
) -> Response:
    """`stepstream VIEW RUN` as the CLI prints it, read from this service's projection.

    A run this service does not hold is a 404 whose `detail` is the CLI's message, with no path of
    the server in it (`public_detail`).
    """
    return await _console(
        request, view, ViewArgs(run_id=run_id, include_interrupted=include_interrupted, json=json, wide=wide)
    )


async def _console(request: Request, view: str, args: ViewArgs) -> Response:
    found = source(request)
    if found.peers is not None and view != 'conversations':
        return JSONResponse({'detail': 'a group member serves its own shards only'}, status_code=409)
    headers = {VIEW_HEADER: view}
    try:
        if view == 'conversations':  # a group member's service merges every member's
            text = await conversations(args, conversation_reads(found), found.settings)
        else:
            text = await show(view, args, found.reader, found.settings)
    except BadCursor as exc:  # a cursor outside the list: a bad parameter
        detail = public_detail(request, 400, str(exc))
        return JSONResponse({'detail': detail}, status_code=400, headers=headers)
    except (NotFound, LookupError) as exc:  # a run it does not hold
        detail = public_detail(request, 404, str(exc))
        return JSONResponse({'detail': detail}, status_code=404, headers=headers)
    return PlainTextResponse(text, headers=headers)
