"""The console's parts without a broker: a view's arguments on the wire, and what the client takes
from a service (tests/test_console.py proves the whole path on both brokers' stacks)."""

from __future__ import annotations

import argparse
import http.server
import threading
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepstream.cli import _remote
from stepstream.console import VIEW_HEADER, ViewArgs
from stepstream.settings import Settings

pytestmark = pytest.mark.fast

NAMES = st.text(st.characters(codec='utf-8', exclude_categories=('Cs',)), min_size=1, max_size=40)


@given(
    run_id=st.none() | NAMES,
    conversation_id=st.none() | NAMES,
    status=st.none() | st.sampled_from(['running', 'stale', 'completed', 'failed', 'cancelled']),
    include_interrupted=st.booleans(),
    json=st.booleans(),
    page=st.tuples(st.none() | st.integers(1, 1000), st.none() | NAMES, st.booleans()),
)
def test_view_args_survive_the_query_string(
    run_id: str | None,
    conversation_id: str | None,
    status: str | None,
    include_interrupted: bool,
    json: bool,
    page: tuple[int | None, str | None, bool],
) -> None:
    limit, after, oldest_first = page
    args = ViewArgs(
        run_id=run_id,
        conversation_id=conversation_id,
        status=status,
        include_interrupted=include_interrupted,
        json=json,
        limit=limit,
        after=after,
        oldest_first=oldest_first,
    )
    assert ViewArgs.from_query(args.query()) == args
    namespace = argparse.Namespace(run_id=run_id, conversation_id=conversation_id, json=json, view='runs')
    assert ViewArgs.of(namespace) == ViewArgs(run_id=run_id, conversation_id=conversation_id, json=json)


def test_a_query_a_view_does_not_take_is_refused() -> None:
    with pytest.raises(ValueError, match="'db_path' is not an argument"):
        ViewArgs.from_query({'db_path': '/etc'})
    with pytest.raises(ValueError, match='json is a flag'):
        ViewArgs.from_query({'json': 'yes'})
    with pytest.raises(ValueError, match='limit is a whole number'):
        ViewArgs.from_query({'limit': 'many'})
    with pytest.raises(ValueError, match='limit must be at least 1'):
        ViewArgs.from_query({'limit': '0'})


class Canned(http.server.BaseHTTPRequestHandler):
    """Answers every GET with the class's status, body and headers."""

    status = 200
    body = b''
    headers_out: dict[str, str] = {}
    seen: list[str] = []

    def do_GET(self) -> None:
        type(self).seen.append(self.path)
        self.send_response(self.status)
        for name, value in self.headers_out.items():
            self.send_header(name, value)
        self.send_header('Content-Length', str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def service() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Canned)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{server.server_address[1]}'
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ('status', 'body', 'headers', 'expected'),
    [
        (200, b'run_id  agent', {}, _remote.Answer(True, 'run_id  agent')),
        (404, b'{"detail": "no run \'x\'"}', {VIEW_HEADER: 'tree'}, _remote.Answer(False, "no run 'x'")),
        (404, b'{"detail": "Not Found"}', {}, None),  # an older service without the route
        (
            400,
            b'{"detail": "after=\'x\' is not a run"}',
            {VIEW_HEADER: 'tree'},
            _remote.Answer(False, "after='x' is not a run"),
        ),
        (400, b'{"detail": "bad"}', {}, None),
        (401, b'{"detail": "a bearer token is required"}', {}, None),
        (409, b'{"detail": "a group member"}', {VIEW_HEADER: 'tree'}, None),
        (500, b'{"detail": "S3 is down"}', {}, None),
        (503, b'{"detail": "shard moving"}', {}, None),
    ],
)
def test_only_the_views_own_answers_are_taken(
    service: str, status: int, body: bytes, headers: dict[str, str], expected: _remote.Answer | None
) -> None:
    Canned.status, Canned.body, Canned.headers_out, Canned.seen = status, body, headers, []
    query = ViewArgs(run_id='run/1 é', json=True).query()
    assert _remote.ask(service, 'tree', query, Settings().serve) == expected
    assert Canned.seen == ['/api/console/tree/run%2F1%20%C3%A9?json=true']


def test_a_service_that_is_not_there_is_read_around() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        port = probe.getsockname()[1]
    assert _remote.ask(f'http://127.0.0.1:{port}', 'runs', {}, Settings().serve) is None


def test_a_configured_service_is_asked_whatever_the_stack() -> None:
    settings = Settings(serve_url='http://viewer.internal:8321')
    assert _remote.service_url('/nonexistent-stack-dir', settings) == 'http://viewer.internal:8321'
    assert _remote.service_url('/nonexistent-stack-dir', Settings()) is None
    with pytest.raises(ValueError, match=r'STEPSTREAM_SERVE_URL .* must be an http'):
        Settings(serve_url='viewer:8321')
