"""Servers the tests start as processes of their own: free ports, a logged spawn, a clean stop.

One place for what the engine servers, the schema registry, the Apache Kafka brokers of the
cluster and security tests, and the compose test's broker each need.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HOST = '127.0.0.1'


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def spawn(
    command: list[str], log: Path, *, env: dict[str, str] | None = None, new_session: bool = False
) -> subprocess.Popen[bytes]:
    """Start `command` with stdout and stderr appended to `log` and no stdin.

    `new_session`: in a process group of its own, so a signal to the tests' group does not reach it.
    """
    with open(log, 'ab') as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=new_session,
        )


def stop(*processes: subprocess.Popen[bytes] | None, grace_s: float = 15.0) -> None:
    """SIGTERM every process still running, then SIGKILL what has not exited within `grace_s`."""
    alive = [p for p in processes if p is not None and p.poll() is None]
    for process in alive:
        process.send_signal(signal.SIGTERM)
    for process in alive:
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_port(process: subprocess.Popen[bytes], port: int, log: Path, ready_s: float = 120.0) -> None:
    """Return once something accepts connections on `port`; fail with the log if the process exits."""
    deadline = time.monotonic() + ready_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f'the server exited with {process.returncode}: {log.read_text()[-3000:]}')
        try:
            with socket.create_connection((HOST, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f'nothing listens on {port} after {ready_s}s: {log.read_text()[-3000:]}'
                ) from error
            time.sleep(0.05)  # a readiness probe's interval, not a wait for an outcome


@contextmanager
def running(
    command: list[str], log: Path, *, port: int | None = None, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `command` until the block ends (once it listens on `port`, when one is given); then stop it."""
    process = spawn(command, log, env=env)
    try:
        if port is not None:
            wait_for_port(process, port, log)
        yield process
    finally:
        stop(process)
