"""Running the service: which addresses it may bind, and uvicorn started and stopped in-process."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator, Iterator

import uvicorn
from fastapi import FastAPI

from stepstream.errors import UsageError
from stepstream.media import MediaStore, S3MediaStore
from stepstream.projector import ProjectionReader
from stepstream.serve._app import create_app
from stepstream.serve._source import Source
from stepstream.settings import Settings

DEFAULT_HOST = '127.0.0.1'
DEFAULT_PORT = 8321


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the service on this machine."""
    if host == 'localhost':
        return True
    try:
        return ipaddress.ip_address(host.strip('[]')).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_binding(host: str, settings: Settings) -> None:
    """Refuse to serve beyond loopback without a token: the projection holds every prompt and tool result."""
    if not is_loopback(host) and settings.serve_token is None:
        raise UsageError(
            f'serving on {host} (not loopback) needs a bearer token: set STEPSTREAM_SERVE_TOKEN '
            '(or STEPSTREAM_SERVE_TOKEN_FILE, a file holding it); clients then send '
            '"Authorization: Bearer <token>"'
        )


def app_for(
    settings: Settings, reader: ProjectionReader | None = None, media_store: MediaStore | None = None
) -> FastAPI:
    """The service over `settings.db_path` (or over `reader`), with the settings' media store and token.

    A reader passed in stays the caller's to close; one opened here closes with the application.
    """
    store = media_store if media_store is not None else S3MediaStore.from_settings(settings)
    owned = reader is None
    reader = (
        reader
        if reader is not None
        else ProjectionReader.open(settings.db_path, media_store=store, stale_after_s=settings.stale_after_s)
    )
    token = settings.serve_token.get_secret_value() if settings.serve_token is not None else None
    return create_app(Source(settings, reader, store), token=token, on_close=reader.close if owned else None)


class _Server(uvicorn.Server):
    """Uvicorn without its signal handling: the caller decides what a signal means (see `Served.stop`)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Served:
    """A running service: its base URL, a way to stop it, and a way to wait until it stops."""

    def __init__(self, url: str, server: uvicorn.Server, task: asyncio.Task[None]) -> None:
        """Wrap the uvicorn `server` whose `task` serves at `url`."""
        self.url = url
        self._server = server
        self._task = task

    def stop(self) -> None:
        """Finish the requests in flight and stop (safe to call from a signal handler)."""
        self._server.should_exit = True

    async def wait(self) -> None:
        """Until the server has stopped."""
        await asyncio.shield(self._task)


@contextlib.asynccontextmanager
async def running(
    app: FastAPI, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT
) -> AsyncIterator[Served]:
    """Serve `app` with uvicorn in this event loop until the block exits.

    `port=0` takes a free port.

    ```python
    async with running(app_for(settings), port=0) as served:
        print(f'explorer at {served.url}/')
    ```
    """
    config = uvicorn.Config(app, host=host, port=port, log_level='warning', lifespan='on', access_log=False)
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:  # uvicorn offers no event for this; it takes a few milliseconds
        if task.done():
            await task  # raises what stopped it
            raise UsageError(f'the service could not listen on {host}:{port} (is the port taken?)')
        await asyncio.sleep(0.01)
    bound_host, bound_port = server.servers[0].sockets[0].getsockname()[:2]
    shown = f'[{bound_host}]' if ':' in bound_host else bound_host
    try:
        yield Served(f'http://{shown}:{bound_port}', server, task)
    finally:
        server.should_exit = True
        await task
