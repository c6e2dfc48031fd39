"""`stepstream stack up|down|env`: an embedded stack that outlives the command that started it.

`stack up` starts a background process (`python -m stepstream.cli.stack DIR`) that runs the whole
system: a durable `EmbeddedStack` (broker and S3) under `DIR/stack`, and, as supervised child
processes, a `stepstream projector` that keeps `DIR/projection` current and a `stepstream serve`
(the run explorer and JSON API) over it; a child that dies is started again. It writes the
settings that reach the stack to `DIR/stack.env`: every `stepstream` command run beside it reads
that file (flags and `STEPSTREAM_*` variables win), so after `make run` the CLI finds the demo's
log, and `stack env` prints the `export` lines for other tools and terminals. Readers (the CLI,
`serve`, `ProjectionReader.open`) open the projection as RocksDB secondaries while the stack's
projector writes it; only a second projector is refused. `stack down` stops the process, which
stops its children; the log and the projection stay under `DIR` for the next `stack up`.

Layout of `DIR` (created readable by its owner only, since `stack.env` holds the S3 secret):
`stack.env` (the settings, present while the stack is up), `stack.pid` (the background
process), `stack.log` (its output and its supervisor's), `projector.log` and `serve.log` (the
children's output), `explorer.url` (where `serve` listens), `metrics.url` (where the projector
serves `/metrics`, `/healthz` and `/readyz`), `stack/` (the `EmbeddedStack` data
dir), `projection/` (the projection `db_path` points at).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stepstream.cli._common import program
from stepstream.errors import StepStreamError, UsageError
from stepstream.settings import ENV_PREFIX, Settings

if TYPE_CHECKING:
    from stepstream.embedded import Child

DEFAULT_STACK_DIR = '.stepstream'
ENV_FILE = 'stack.env'
PID_FILE = 'stack.pid'
LOG_FILE = 'stack.log'
URL_FILE = 'explorer.url'
EXPLORER_PORT = 8321
"""The explorer's port when it is free; otherwise the stack's `serve` takes any free one."""
METRICS_FILE = 'metrics.url'
METRICS_PORT = 9464
"""The projector's `--metrics-port` when it is free (the port Prometheus exporters conventionally take)."""
_SERVICE_MODULE = 'stepstream.cli.stack'
_STARTUP_TIMEOUT_S = 180.0  # Apache Kafka may resolve its jars from Maven on the first start
_STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RunningStack:
    """A stack started by `stack up`: where it lives, its process and its settings."""

    directory: Path
    pid: int
    environ: dict[str, str]
    """The `STEPSTREAM_*` variables that point at it."""
    explorer_url: str | None = None
    """Where the stack's `serve` answers (the run explorer at `/`, the API under `/api`)."""
    metrics_url: str | None = None
    """Where the stack's projector serves `/metrics`, `/healthz` and `/readyz`."""

    @property
    def settings(self) -> Settings:
        """Settings for the stack's broker, S3 bucket and projection."""
        return Settings.from_env(self.environ)

    def export_lines(self) -> str:
        """Shell `export` lines, for `eval "$(stepstream stack env)"`."""
        return '\n'.join(f'export {name}={shlex.quote(value)}' for name, value in self.environ.items())

    def describe(self) -> str:
        """What `stack up` prints: where things are and how to use and stop the stack."""
        s = self.settings
        explorer = self.explorer_url or f'none answering yet: see {self.directory / "serve.log"}'
        me = program()
        return (
            f'stack up (pid {self.pid}) under {self.directory}\n'
            f'  Kafka: {s.kafka.bootstrap_servers}   S3: {s.media.s3_endpoint} (bucket {s.media.s3_bucket})\n'
            f"  projection: {s.projection.db_path} (kept current by the stack's projector)\n"
            f'  run explorer: {explorer}\n'
            + (
                f'  projector metrics: {self.metrics_url}metrics (probes /healthz, /readyz)\n'
                if self.metrics_url
                else ''
            )
            + f'stepstream commands run here use it; elsewhere: eval "$({me} stack env '
            f'--stack-dir {self.directory})"\n'
            f'stop it with: {me} stack down'
        )


def stack_environ(directory: str | Path) -> dict[str, str]:
    """The settings of the stack running under `directory`, below the process environment.

    Returns `{**stack.env, **os.environ}` while a stack is up there, else just `os.environ`, so
    that `Settings.from_args(args, stack_environ(dir))` prefers flags, then variables, then the
    stack.
    """
    try:
        running = running_stack(directory)
    except UsageError:
        return dict(os.environ)
    return {**running.environ, **os.environ}


def running_stack(directory: str | Path) -> RunningStack:
    """The stack `stack up` started under `directory`, or `UsageError` if none is running."""
    root = Path(directory).absolute()
    try:
        pid = int((root / PID_FILE).read_text().strip())
        environ = _read_env(root / ENV_FILE)
    except (OSError, ValueError):
        where = 'no such folder' if not root.exists() else 'no stack was started there'
        raise UsageError(
            f'no stack is running under {root} ({where}): start one with '
            f'`stepstream stack up{_flag(directory)}`{_projection_hint(root)}'
        ) from None
    if not _is_stack_process(pid):
        raise UsageError(
            f'the stack under {root} is not running any more (pid {pid} is gone): '
            f'start it again with `stepstream stack up{_flag(directory)}`{_projection_hint(root)}'
        )
    return RunningStack(root, pid, environ, _read_url(root / URL_FILE), _read_url(root / METRICS_FILE))


def _flag(directory: str | Path) -> str:
    """` --stack-dir DIR` for a folder other than the default, to paste into a command."""
    return '' if str(directory) == DEFAULT_STACK_DIR else f' --stack-dir {directory}'


def _projection_hint(root: Path) -> str:
    """How to read a stopped stack's projection, when it left one."""
    projection = root / 'projection'
    return f', or read its projection as it stands with --db-path {projection}' if projection.is_dir() else ''


def _read_url(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def stack_up(directory: str | Path, *, broker: str | None = None, quiet: bool = False) -> RunningStack:
    """Start a stack under `directory` in the background, or return the one already running there.

    Waits until the stack answers (its settings file appears); a stack that fails to start
    raises `StepStreamError` with the end of its log.
    """
    root = Path(directory).absolute()
    with contextlib.suppress(UsageError):
        return running_stack(root)
    _make_private_dir(root)
    for stale in (ENV_FILE, PID_FILE):
        (root / stale).unlink(missing_ok=True)
    if not quiet:
        print(f'starting the embedded stack under {root} ...', flush=True)
    env = dict(os.environ)
    if broker is not None:
        env['STEPSTREAM_EMBEDDED_BROKER'] = broker
    with open(root / LOG_FILE, 'ab') as log:
        process = subprocess.Popen(
            [sys.executable, '-m', _SERVICE_MODULE, str(root)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # not in the terminal's process group: Ctrl-C there leaves it up
        )
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while not (root / ENV_FILE).exists():
        code = process.poll()
        if code is not None:
            raise StepStreamError(
                f'the stack under {root} did not start (exit code {code}); the end of {root / LOG_FILE}:\n'
                + _tail(root / LOG_FILE)
            )
        if time.monotonic() > deadline:
            _stop_pid(process.pid)
            raise StepStreamError(
                f'the stack under {root} did not come up within {_STARTUP_TIMEOUT_S:g}s; '
                f'the end of {root / LOG_FILE}:\n' + _tail(root / LOG_FILE)
            )
        time.sleep(0.1)
    running = running_stack(root)
    _wait_answering(running.explorer_url, deadline)
    return running


def _wait_answering(url: str | None, deadline: float) -> None:
    """Wait until the explorer accepts connections (so the URL `stack up` prints works at once)."""
    if url is None:
        return
    host, _, port = url.removeprefix('http://').rstrip('/').rpartition(':')
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
            return
        time.sleep(0.1)


def stack_down(directory: str | Path) -> str:
    """Stop the stack running under `directory`; returns what happened, in one line."""
    root = Path(directory).absolute()
    try:
        running = running_stack(root)
    except UsageError:
        for stale in (ENV_FILE, PID_FILE):
            (root / stale).unlink(missing_ok=True)
        return f'no stack is running under {root}'
    _stop_pid(running.pid)
    return f'stopped the stack under {root} (pid {running.pid}); its log and projection stay there'


def _stop_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    while _is_stack_process(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # its children die with it (PR_SET_PDEATHSIG)
            break
        time.sleep(0.1)


def _is_stack_process(pid: int) -> bool:
    """Whether `pid` is alive and is a stack process (not another process that reused the pid)."""
    try:
        cmdline = Path(f'/proc/{pid}/cmdline').read_bytes().split(b'\0')
    except OSError:
        if sys.platform == 'linux':
            return False
        try:  # elsewhere: trust the pid file
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return _SERVICE_MODULE.encode() in cmdline


def _make_private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def _read_env(path: Path) -> dict[str, str]:
    environ = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition('=')
        if sep and name.startswith(ENV_PREFIX):
            environ[name] = value
    return environ


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors='replace')
    except OSError as exc:
        return f'    (could not read it: {exc})'
    return '\n'.join('    ' + line for line in text.splitlines()[-lines:])


class _Supervised:
    """A child of the stack (`stepstream projector`, `stepstream serve`), started again if it dies."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], root: Path) -> None:
        self.name, self.argv, self.env, self.root = name, argv, env, root
        self.child: Child | None = None
        self.started_at = 0.0

    def start(self) -> None:
        from stepstream.embedded import spawn

        self.child = spawn(
            self.name,
            f'stepstream {self.name}',
            self.argv,
            env=self.env,
            cwd=self.root,
            log_path=self.root / f'{self.name}.log',
        )
        self.started_at = time.monotonic()
        print(f'started {self.name} (pid {self.child.process.pid})', flush=True)

    def check(self) -> None:
        """Start the child again if it exited (not sooner than 2 s after its last start)."""
        if self.child is None or self.child.process.poll() is None:
            return
        if time.monotonic() - self.started_at < _RESTART_PAUSE_S:
            return
        print(
            f'{self.name} (pid {self.child.process.pid}) exited with code {self.child.process.returncode}; '
            f'starting it again (see {self.root / (self.name + ".log")})',
            flush=True,
        )
        self.start()


_RESTART_PAUSE_S = 2.0
_WHERE = ('BOOTSTRAP_SERVERS', 'S3_', 'DB_PATH', 'TOPIC_PREFIX', 'PARTITIONS', 'SECURITY_', 'SASL_', 'SSL_')


def _port(preferred: int) -> int:
    """`preferred` if nothing listens there on loopback, else a free port."""
    for port in (preferred, 0):
        with socket.socket() as sock:
            try:
                sock.bind(('127.0.0.1', port))
            except OSError:
                continue
            found: int = sock.getsockname()[1]
            return found
    raise StepStreamError('no free loopback port for the stack')


def _wait_for_projection(path: Path, projector: _Supervised, asked: threading.Event) -> None:
    """Wait until the projector made its shards, so that `serve` finds a projection to open."""
    from stepstream.storage import shard_paths

    deadline = time.monotonic() + 60
    while not shard_paths(path) and time.monotonic() < deadline and not asked.is_set():
        projector.check()
        time.sleep(0.1)


def serve(directory: str | Path) -> None:
    """The background process of `stack up`: the stack, a projector and `serve`, until SIGTERM.

    The children are started again when they die; on SIGTERM they stop first, then the stack.
    """
    from stepstream.embedded import EmbeddedStack, terminate

    root = Path(directory).absolute()
    received: list[signal.Signals] = []
    asked = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum))
        asked.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    stack = EmbeddedStack(root / 'stack', durable=True, partitions=3)
    stack.start()
    children: list[_Supervised] = []
    try:
        (root / PID_FILE).write_text(f'{os.getpid()}\n')
        settings = stack.settings.replace(db_path=str(root / 'projection'))
        _make_private_dir(root / 'projection')
        # Where the system is (broker, S3, projection) comes from the stack; tunables such as
        # STEPSTREAM_STALE_AFTER_S from the environment `stack up` ran in, as for every command.
        stack_env = settings.to_env()
        where = {k: v for k, v in stack_env.items() if k.removeprefix(ENV_PREFIX).startswith(_WHERE)}
        env = {**stack_env, **os.environ, **where}
        command = [sys.executable, '-m', 'stepstream.cli']
        metrics_port = _port(METRICS_PORT)
        projector = _Supervised(
            'projector',
            [*command, 'projector', '--metrics-port', str(metrics_port), '--stack-dir', str(root)],
            env,
            root,
        )
        port = _port(EXPLORER_PORT)
        server = _Supervised(
            'serve', [*command, 'serve', '--port', str(port), '--stack-dir', str(root)], env, root
        )
        children = [projector, server]
        projector.start()
        _wait_for_projection(root / 'projection', projector, asked)
        server.start()
        (root / URL_FILE).write_text(f'http://127.0.0.1:{port}/\n')
        (root / METRICS_FILE).write_text(f'http://127.0.0.1:{metrics_port}/\n')
        env_path = root / ENV_FILE
        partial = env_path.with_suffix('.tmp')
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, 'w') as f:
            f.writelines(f'{name}={value}\n' for name, value in settings.to_env().items())
        partial.replace(env_path)  # appears whole: `stack up` waits for this file
        print(
            f'stack up: {settings.kafka.bootstrap_servers}, {settings.media.s3_endpoint}, http://127.0.0.1:{port}/',
            flush=True,
        )
        while not asked.wait(0.5):
            for child in children:
                child.check()
    finally:
        (root / ENV_FILE).unlink(missing_ok=True)
        (root / URL_FILE).unlink(missing_ok=True)
        (root / METRICS_FILE).unlink(missing_ok=True)
        terminate([c.child for c in children])
        stack.stop()
        (root / PID_FILE).unlink(missing_ok=True)
        print(f'stack down ({received[0].name if received else "error"})', flush=True)


if __name__ == '__main__':
    serve(sys.argv[1])
