"""Running the service: which addresses it may bind, and uvicorn started and stopped in-process."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator, Iterator

import uvicorn
from fastapi import FastAPI

from stepstream.errors import UsageError
from stepstream.media import MediaStore, S3MediaStore
from stepstream.projector import Membership, ProjectorObserver
from stepstream.readmodel import ProjectionReader
from stepstream.serve._app import create_app
from stepstream.serve._group import Peers
from stepstream.serve._source import Source
from stepstream.settings import ServeSettings, Settings

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


def check_binding(host: str, serve: ServeSettings) -> None:
    """Refuse to serve beyond loopback without a token: the projection holds every prompt and tool result."""
    if not is_loopback(host) and serve.serve_token is None:
        raise UsageError(
            f'serving on {host} (not loopback) needs a bearer token: set STEPSTREAM_SERVE_TOKEN '
            '(or STEPSTREAM_SERVE_TOKEN_FILE, a file holding it); clients then send '
            '"Authorization: Bearer <token>"'
        )


def app_for(
    settings: Settings,
    reader: ProjectionReader | None = None,
    media_store: MediaStore | None = None,
    membership: Membership | None = None,
    observer: ProjectorObserver | None = None,
) -> FastAPI:
    """The service over `projection.db_path` (or over `reader`), with the settings' media store and token.

    A reader passed in stays the caller's to close; one opened here closes with the application.
    With `membership` (a group member's, see `GroupMember.membership`), the service answers for
    the whole group: it forwards a run's reads to the member owning its partition and merges
    lists from every member; `observer` (its projector's) joins the service's `/metrics` and
    answers `/healthz` and `/readyz`.
    """
    store = media_store if media_store is not None else S3MediaStore.from_settings(settings.media)
    owned = reader is None
    reader = reader if reader is not None else ProjectionReader.from_settings(settings, media_store=store)
    token = settings.serve.serve_token.get_secret_value() if settings.serve.serve_token is not None else None
    peers = None
    if membership is not None:
        peers = Peers(membership, token=token, timeout_s=settings.kafka.ack_timeout_s * 3)
    source = Source(settings, reader, store, peers=peers)
    return create_app(source, token=token, on_close=reader.aclose if owned else None, observer=observer)


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


def listen(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> socket.socket:
    """A listening socket for `running(sock=)`: a group member must know its URL before it joins.

    `port=0` takes a free port. Raises `UsageError` when the address is taken.
    """
    family = socket.AF_INET6 if ':' in host.strip('[]') else socket.AF_INET
    # The protocol named, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose protocol
    # is TCP, and without it every response waits on Nagle and the peer's delayed ACK (~40 ms a
    # request, paid twice by a group's merged pages: bench/run_pages.py).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip('[]'), port))
    except OSError as exc:
        sock.close()
        raise UsageError(
            f'the service could not listen on {host}:{port} (is the port taken?): {exc}'
        ) from None
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket) -> str:
    """The base URL of a socket from `listen`."""
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f'[{bound_host}]' if ':' in bound_host else bound_host
    return f'http://{shown}:{bound_port}'


@contextlib.asynccontextmanager
async def running(
    app: FastAPI, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, sock: socket.socket | None = None
) -> AsyncIterator[Served]:
    """Serve `app` with uvicorn in this event loop until the block exits.

    `port=0` takes a free port; `sock` (from `listen`) serves on a socket bound already.

    ```python
    async with running(app_for(settings), port=0) as served:
        print(f'explorer at {served.url}/')
    ```
    """
    config = uvicorn.Config(app, host=host, port=port, log_level='warning', lifespan='on', access_log=False)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock] if sock is not None else None))
    while not server.started:  # uvicorn offers no event for this; it takes a few milliseconds
        if task.done():
            await task  # raises what stopped it
            raise UsageError(f'the service could not listen on {host}:{port} (is the port taken?)')
        await asyncio.sleep(0.01)
    try:
        yield Served(url_of(server.servers[0].sockets[0]), server, task)
    finally:
        server.should_exit = True
        await task
