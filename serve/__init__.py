"""`stepstream serve`: the HTTP face of a projection, a JSON API and the run explorer.

```python
from stepstream.serve import app_for, running

async with running(app_for(settings), port=0) as served:
    print(f'{served.url}/ (explorer), {served.url}/openapi.json (the API)')
```

Every read goes through `ProjectionReader`; the service never writes the projection. Its one
write, an operator's resolution of an unknown effect, is appended to the log like any other.
"""

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
