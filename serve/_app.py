"""The ASGI application: the JSON API, the run explorer, and the bearer-token gate in front of both."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from stepstream.errors import BadCursor, NotFound, NotUnknown, StepStreamError
from stepstream.projector import ProjectorObserver
from stepstream.readmodel import ShardUnavailable
from stepstream.serve import (
    _api,
    _conversations,
    _explorer,
    _group_conversations,
    _ops,
    _resolve_page,
    _waiting_api,
    _waiting_pages,
)
from stepstream.serve._auth import authorized
from stepstream.serve._decisions import Decisions
from stepstream.serve._group import FORWARDED_HEADER, forwarded
from stepstream.serve._public import Withheld, public_detail
from stepstream.serve._source import Source

PUBLIC_PATHS = ('/login', '/static/')
PAGE_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src * data:; media-src * data:; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)


def create_app(
    source: Source,
    *,
    token: str | None = None,
    on_close: Callable[[], Awaitable[None]] | None = None,
    observer: ProjectorObserver | None = None,
) -> FastAPI:
    """The service over `source`: JSON under `/api`, the explorer at `/`, the schema at `/openapi.json`.

    With `token`, every request must carry `Authorization: Bearer <token>` (or the cookie
    `/login` sets), except `/metrics`, `/healthz` and `/readyz`; `on_close` runs when the
    application shuts down. `observer` (a group member's projector's) answers those three with
    the projector's metrics and probes besides the service's own.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await source.aclose()
            if on_close is not None:
                await on_close()

    app = FastAPI(
        title='stepstream',
        summary='The read model of a stepstream projection: runs, lineage, events, snapshots, tool effects.',
        version='1',
        docs_url=None,  # FastAPI's page loads Swagger UI from a CDN: ours is `_explorer.docs`
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.source = source
    app.state.decisions = Decisions(source)
    app.state.token = token
    app.state.withheld = Withheld.of(
        source.settings.projection.db_path, source.reader.root, source.media_store
    )
    instruments = _ops.Instruments(observer.registry if observer is not None else None)
    app.state.instruments = instruments
    app.state.probes = observer if observer is not None else _ops.ReaderProbes(source.reader)
    app.include_router(_ops.router)
    app.include_router(_api.router)
    app.include_router(_waiting_api.router)
    app.include_router(_explorer.router)
    app.include_router(_resolve_page.router)
    app.include_router(_waiting_pages.router)
    app.include_router(_conversations.api)
    app.include_router(_conversations.pages)
    app.include_router(_group_conversations.router)
    swagger = _explorer.swagger_ui_assets()
    if swagger is not None:
        app.mount('/static/swagger-ui', StaticFiles(directory=swagger), name='swagger-ui')
    app.mount('/static', StaticFiles(directory=Path(__file__).parent / 'static'), name='static')

    @app.exception_handler(BadCursor)
    async def bad_cursor(request: Request, exc: BadCursor) -> Response:
        return _problem(request, 400, str(exc))  # a bad `after`, never a 404 ("not here" to members)

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound) -> Response:
        return _problem(request, 404, str(exc))

    @app.exception_handler(NotUnknown)
    async def not_unknown(request: Request, exc: NotUnknown) -> Response:
        return _problem(request, 409, str(exc))

    @app.exception_handler(ShardUnavailable)
    async def shard_unavailable(request: Request, exc: ShardUnavailable) -> Response:
        return _problem(request, 503, str(exc))

    @app.exception_handler(StepStreamError)
    async def broken(request: Request, exc: StepStreamError) -> Response:
        return _problem(request, 500, str(exc))

    @app.middleware('http')
    async def gate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        return await instruments.observe(request, lambda: _gated(request, call_next, token))

    return app


async def _gated(
    request: Request, call_next: Callable[[Request], Awaitable[Response]], token: str | None
) -> Response:
    """The bearer-token gate, then the route, then the headers every page carries."""
    if (
        token is not None
        and not request.url.path.startswith(PUBLIC_PATHS)
        and request.url.path not in _ops.OPS_PATHS
        and not authorized(request, token)
    ):
        if request.url.path.startswith('/api') or request.url.path == '/openapi.json':
            return JSONResponse(
                {'detail': 'a bearer token is required: Authorization: Bearer <STEPSTREAM_SERVE_TOKEN>'},
                status_code=401,
                headers={'WWW-Authenticate': 'Bearer'},
            )
        target = request.url.path + (f'?{request.url.query}' if request.url.query else '')
        return RedirectResponse(f'/login?next={quote(target)}', status_code=303)
    # A member's request on a client's behalf: answered from this member's shards only.
    forwarded.set(request.headers.get(FORWARDED_HEADER) == '1')
    response = await call_next(request)
    response.headers.setdefault('Content-Security-Policy', PAGE_POLICY)
    response.headers.setdefault('X-Content-Type-Options', 'nosniff')
    response.headers.setdefault('Referrer-Policy', 'no-referrer')
    return response


def _problem(request: Request, status: int, detail: str) -> Response:
    if request.url.path.startswith('/api'):
        return JSONResponse({'detail': public_detail(request, status, detail)}, status_code=status)
    return _explorer.error_page(request, status, detail)
