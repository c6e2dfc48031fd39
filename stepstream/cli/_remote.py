"""The CLI as a client of the read service: a view asked of `serve` instead of a projection opened here.

`serve` holds the projection open and current, so a view it answers costs one loopback request,
where opening every shard as a RocksDB secondary costs half a second. The service runs the very
view the CLI would (`stepstream.console`, `GET /api/console/{view}`), so the answer is the same
text. This module imports only the standard library: a view asked this way never loads the read
model, Pydantic or asyncio.

Which service: `STEPSTREAM_SERVE_URL` when set; otherwise the stack's `serve` (`stack up`) when
the command's settings are the stack's own (a flag or variable that changes what the projection
reads, such as `--db-path` or `--stale-after-s`, makes the CLI read it itself). A service that
does not answer, refuses or fails is no error: the CLI reads the projection itself, and says why
it could not there if it cannot either.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

from stepstream.console import VIEW_HEADER
from stepstream.settings import ServeSettings, Settings

TIMEOUT_S = 30.0
"""How long a view may take the service before the CLI reads the projection itself."""
CONNECT_TIMEOUT_S = 0.5
"""A service on loopback answers at once; one that does not is not there."""


@dataclass(frozen=True, slots=True)
class Answer:
    """What the service said: the view's text (`ok`), or why the run is not there."""

    ok: bool
    text: str


def service_url(stack_dir: str, settings: Settings) -> str | None:
    """The read service a view should ask, or None to read the projection here."""
    if settings.serve.serve_url is not None:
        return settings.serve.serve_url
    from stepstream.cli.stack import running_stack
    from stepstream.errors import UsageError

    try:
        stack = running_stack(stack_dir)
    except UsageError:
        return None
    if stack.explorer_url is None or stack.settings != settings:
        return None
    return stack.explorer_url


def ask(url: str, view: str, query: dict[str, str], serve: ServeSettings) -> Answer | None:
    """`GET {url}/api/console/{view}[/{run_id}]?{query}`: the view's text, its `NotFound`, or None.

    None means: read the projection here (no answer, a refusal, a failure).
    """
    parts = urllib.parse.urlsplit(url)
    connection_type = http.client.HTTPSConnection if parts.scheme == 'https' else http.client.HTTPConnection
    connection = connection_type(parts.netloc, timeout=CONNECT_TIMEOUT_S)
    headers = {'Accept': 'text/plain'}
    if serve.serve_token is not None:
        headers['Authorization'] = f'Bearer {serve.serve_token.get_secret_value()}'
    path = f'{parts.path.rstrip("/")}/api/console/{urllib.parse.quote(view)}'
    run_id = query.pop('run_id', None)
    if run_id is not None:  # a view of one run: its own path, as the API's other run reads
        path += '/' + urllib.parse.quote(run_id, safe='')
    if query:
        path += '?' + urllib.parse.urlencode(query)
    try:
        connection.connect()
        if connection.sock is not None:
            connection.sock.settimeout(TIMEOUT_S)
        connection.request('GET', path, headers=headers)
        response = connection.getresponse()
        body = response.read().decode('utf-8', 'replace')
    except (OSError, http.client.HTTPException):
        return None  # not there, or gone mid-answer: read the projection here
    finally:
        connection.close()
    if response.status == 200:
        return Answer(True, body)
    if response.status in (400, 404) and response.getheader(VIEW_HEADER) == view:  # the view's NotFound
        detail = _detail(body)
        return Answer(False, detail) if detail is not None else None
    return None  # refused (401), unavailable (503), failed (500): the CLI reads it itself


def _detail(body: str) -> str | None:
    try:
        problem: Any = json.loads(body)
    except ValueError:
        return None
    detail = problem.get('detail') if isinstance(problem, dict) else None
    return detail if isinstance(detail, str) else None
