"""`stepstream serve`: the HTTP face of a projection, a JSON API and the run explorer.

```python
from stepstream.serve import app_for, running

async with running(app_for(settings), port=0) as served:
    print(f'{served.url}/ (explorer), {served.url}/openapi.json (the API)')
```

Every read goes through `ProjectionReader`; the service never writes the projection. Its one
write, an operator's resolution of an unknown effect, is appended to the log like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.serve._app import create_app
    from stepstream.serve._server import (
        DEFAULT_HOST,
        DEFAULT_PORT,
        Served,
        app_for,
        check_binding,
        is_loopback,
        listen,
        running,
        url_of,
    )
    from stepstream.serve._source import Source

_WHERE = {
    'DEFAULT_HOST': 'stepstream.serve._server',
    'DEFAULT_PORT': 'stepstream.serve._server',
    'Served': 'stepstream.serve._server',
    'Source': 'stepstream.serve._source',
    'app_for': 'stepstream.serve._server',
    'check_binding': 'stepstream.serve._server',
    'create_app': 'stepstream.serve._app',
    'is_loopback': 'stepstream.serve._server',
    'listen': 'stepstream.serve._server',
    'running': 'stepstream.serve._server',
    'url_of': 'stepstream.serve._server',
}
"""Where each public name lives: imported on first use, so a command pays only for what it uses."""

__all__ = [
    'DEFAULT_HOST',
    'DEFAULT_PORT',
    'Served',
    'Source',
    'app_for',
    'check_binding',
    'create_app',
    'is_loopback',
    'listen',
    'running',
    'url_of',
]

__getattr__ = lazy_exports(__name__, _WHERE)
