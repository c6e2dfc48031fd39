"""What a client may be told when a read fails: the message without the server's paths.

The read model's messages are written for the operator at the terminal, so they name where things
are (`no run 'x' in the projection at /var/lib/stepstream/projection`, a media directory, a
shard's directory, an S3 bucket's endpoint). A browser or an API client of the service must not
learn the server's layout: every problem the service answers (an error page, a JSON `detail`)
goes through `Withheld.public`, which puts a name in place of each place it knows and of any
other absolute path, and the whole message is logged on the server instead.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from fastapi import Request

from stepstream.media import DiskMediaStore, MediaStore, SealedMediaStore

log = logging.getLogger('stepstream.serve')

SERVICE_ROUTES = frozenset(
    {'api', 'runs', 'static', 'deferred', 'unresolved', 'status', 'docs', 'login', 'conversations'}
)
"""First segments of this service's own URL paths: `/api/runs/x` in a message is no server path."""

_ABSOLUTE = re.compile(r"(?<![\w.:/~%\]-])/(?P<first>[^\s/'\"`<>]+)/[^\s'\"`<>]*[^\s'\"`<>.,;:)\]]")
"""An absolute POSIX path of two segments or more, not inside a URL or a relative path."""

SERVER_PATH = '[a path on the server]'


class Withheld:
    """The places of one service that its answers never name, each with what is said instead."""

    def __init__(self, places: list[tuple[str, str]]) -> None:
        """`places`: (text, its name) pairs; the longest text is replaced first."""
        self.places = sorted({p for p in places if p[0]}, key=lambda p: -len(p[0]))

    @classmethod
    def of(cls, db_path: str, root: Path | None, media_store: MediaStore | None) -> Withheld:
        """The places of a service over the projection `db_path` (opened at `root`) and `media_store`."""
        places: list[tuple[str, str]] = []
        for path in (db_path, root):
            if path is None:
                continue
            places.append((str(Path(path).absolute()), '[the projection directory]'))
            if '/' in str(path):  # as given, when relative; a bare name could be any word of a message
                places.append((str(path), '[the projection directory]'))
        store = media_store.inner if isinstance(media_store, SealedMediaStore) else media_store
        location = getattr(store, 'location', None)  # S3 and disk stores name where they keep payloads
        if isinstance(location, str):
            places.append((location, '[the media store]'))
        if isinstance(store, DiskMediaStore):
            places.append((str(store.directory), '[the media directory]'))
        return cls(places)

    def public(self, detail: str) -> str:
        """`detail` with each known place, and any other absolute path, replaced by a name."""
        for text, name in self.places:
            detail = detail.replace(text, name)

        def path(found: re.Match[str]) -> str:
            return found[0] if found['first'] in SERVICE_ROUTES else SERVER_PATH

        return _ABSOLUTE.sub(path, detail)

    def answer(self, status: int, where: str, detail: str) -> str:
        """What a client is told of a failed request (`public`); the whole `detail` is logged here."""
        shown = self.public(detail)
        if shown != detail or status >= 500:
            log.warning('%s answered %d: %s', where, status, detail)
        return shown


def public_detail(request: Request, status: int, detail: str) -> str:
    """What the client of `request` is told of its failure (the app's `Withheld`, `create_app`)."""
    withheld: Withheld = request.app.state.withheld
    return withheld.answer(status, f'{request.method} {request.url.path}', detail)
