"""`EmbeddedStack`: the broker and SeaweedFS composed into one stack with one `Settings`."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from stepstream.embedded import _seaweedfs, _tansu, apache_kafka
from stepstream.embedded._dirs import StackDirs
from stepstream.embedded._network import HOST, Ports, kafka_probe, pick_ports
from stepstream.embedded._processes import (
    BROKER,
    S3,
    Child,
    EmbeddedStackError,
    child_env,
    spawn,
    terminate,
    wait_until_ready,
)
from stepstream.embedded._seaweedfs import LOG_BUCKET, REGION
from stepstream.s3_client import client_options
from stepstream.settings import Settings

BROKERS = ('tansu', 'kafka')
"""The embedded brokers: Tansu (the default, from a PyPI wheel) and Apache Kafka (a JVM and Maven)."""

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

    `s3_certfile` and `s3_keyfile` (PEM) make SeaweedFS serve S3 over HTTPS only, with an
    `https://` endpoint in `settings`; the certificate must name 127.0.0.1, and the CA that signed
    it is the `s3_cafile` setting, which the stack's own readiness check trusts too.

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
        s3_certfile: str | Path | None = None,
        s3_keyfile: str | Path | None = None,
        broker: str | None = None,
        **settings_overrides: Any,
    ) -> None:
        broker = _check_options(
            data_dir,
            durable=durable,
            bucket=bucket,
            broker=broker,
            startup_timeout_s=startup_timeout_s,
            s3_certfile=s3_certfile,
            s3_keyfile=s3_keyfile,
            settings_overrides=settings_overrides,
        )

        self._durable = durable
        self._broker = broker
        self._kafka_lib: Path | None = None
        self._bucket = bucket
        self._startup_timeout_s = startup_timeout_s
        self._tansu_bin = None if tansu_bin is None else str(tansu_bin)
        self._weed_bin = None if weed_bin is None else str(weed_bin)
        self._s3_tls = (
            None if s3_certfile is None or s3_keyfile is None else (Path(s3_certfile), Path(s3_keyfile))
        )
        self._overrides = dict(settings_overrides)

        self._lock = threading.RLock()
        self._dirs = StackDirs(None if data_dir is None else Path(data_dir).absolute())
        self._ports: Ports | None = None
        self._access_key_id = ''
        self._secret_access_key = ''
        self._binaries: dict[str, str] = {}
        self._children: dict[str, Child] = {}
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
        if self._dirs.data_dir is None:
            raise EmbeddedStackError('the stack has no data directory until it is started')
        return self._dirs.data_dir

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
            if self._broker == 'kafka':
                broker, self._kafka_lib = apache_kafka.resolve()
            else:
                broker = _tansu.resolve(self._tansu_bin)
            self._binaries = {BROKER: broker, S3: _seaweedfs.resolve(self._weed_bin)}
            self._access_key_id = 'ss' + secrets.token_hex(8)
            self._secret_access_key = secrets.token_hex(20)
            try:
                self._dirs.prepare()
                for attempt in (1, 2):
                    self._ports = pick_ports(_seaweedfs.COMPONENTS)
                    try:
                        self._start_services()
                        break
                    except EmbeddedStackError as exc:
                        if attempt == 2 or not exc.port_in_use:
                            raise
                        terminate(list(self._children.values()))
                        self._children.clear()
            except BaseException:  # including Ctrl-C halfway: leave nothing running or locked
                terminate(list(self._children.values()))
                self._children.clear()
                self._ports = None
                self._dirs.release()
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
            broker = self._children.pop(BROKER, None)
            s3 = self._children.pop(S3, None)
            if self._durable:
                terminate([broker])
                terminate([s3])
            else:
                terminate([broker, s3])
            self._settings = None
            self._ports = None
            self._dirs.release()
            _LIVE_STACKS.discard(self)

    def stop_broker(self) -> None:
        """Stop only Tansu, e.g. to test what a producer does while Kafka is down.

        `start_broker()` brings it back on the same port, so clients holding `settings` reconnect.
        Without `durable=True` the restarted broker starts with an empty log.
        """
        with self._lock:
            self._require_started()
            terminate([self._children.pop(BROKER, None)])

    def start_broker(self) -> None:
        """Start Tansu again (after `stop_broker()`) on the same port, and wait until it answers."""
        with self._lock:
            self._start_again(BROKER, 'the broker', 'stop_broker', self._spawn_broker, self._wait_broker)

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
            terminate([self._children.pop(S3, None)])

    def start_s3(self) -> None:
        """Start SeaweedFS again (after `stop_s3()`) on the same ports, and wait until it answers."""
        with self._lock:
            self._start_again(S3, 'S3', 'stop_s3', self._spawn_weed, self._wait_s3)

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
        where = self._settings.kafka.bootstrap_servers if self._settings else 'stopped'
        return f'EmbeddedStack({where}, data_dir={self._dirs.data_dir}, durable={self._durable})'

    # -- startup --------------------------------------------------------------------------------

    def _require_started(self) -> None:
        if self._settings is None:
            raise EmbeddedStackError('the stack is not started')

    def _start_again(
        self,
        service: str,
        name: str,
        stopper: str,
        spawn: Callable[[], None],
        wait: Callable[[float], None],
    ) -> None:
        self._require_started()
        if service in self._children:
            raise EmbeddedStackError(f'{name} is already running; call {stopper}() first')
        spawn()
        try:
            wait(time.monotonic() + self._startup_timeout_s)
        except BaseException:
            terminate([self._children.pop(service, None)])
            raise

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
        return child_env(self.data_dir / 'tmp', extra)

    def _bucket_access(self, name: str) -> _seaweedfs.Bucket:
        assert self._ports is not None
        return _seaweedfs.Bucket(self._s3_endpoint, name, self._access_key_id, self._secret_access_key)

    @property
    def _s3_endpoint(self) -> str:
        assert self._ports is not None
        scheme = 'http' if self._s3_tls is None else 'https'
        return f'{scheme}://{HOST}:{self._ports.s3}'

    def _spawn_weed(self) -> None:
        assert self._ports is not None and self._dirs.socket_dir is not None
        buckets = [self._bucket, LOG_BUCKET] if self._durable else [self._bucket]
        command = _seaweedfs.command(
            self._binaries[S3],
            data_dir=self.data_dir,
            ports=self._ports.weed,
            buckets=buckets,
            socket_dir=self._dirs.socket_dir,
            tls=self._s3_tls,
        )
        env = self._child_env(
            {'AWS_ACCESS_KEY_ID': self._access_key_id, 'AWS_SECRET_ACCESS_KEY': self._secret_access_key}
        )
        child = self._spawn(
            S3, _seaweedfs.TITLE, _seaweedfs.LOG_NAME, command, env, _seaweedfs.leftovers(self._ports.weed)
        )
        child.leftover_prefix = _seaweedfs.LEFTOVER_PREFIX
        self._children[S3] = child

    def _spawn_broker(self) -> None:
        assert self._ports is not None
        if self._broker == 'kafka':
            assert self._kafka_lib is not None
            command = apache_kafka.node_command(
                self._binaries[BROKER],
                self._kafka_lib,
                self.data_dir / 'kafka',
                port=self._ports.kafka,
                controller_port=self._ports.controller,
                log_path=self.data_dir / apache_kafka.LOG_NAME,
                env=self._child_env({}),
            )
            self._children[BROKER] = self._spawn(
                BROKER, apache_kafka.TITLE, apache_kafka.LOG_NAME, command, self._child_env({})
            )
            return
        log_bucket = self._bucket_access(LOG_BUCKET) if self._durable else None
        command, extra = _tansu.command(self._binaries[BROKER], self._ports.kafka, log_bucket=log_bucket)
        self._children[BROKER] = self._spawn(
            BROKER, _tansu.TITLE, _tansu.LOG_NAME, command, self._child_env(extra)
        )

    def _spawn(
        self,
        service: str,
        title: str,
        log_name: str,
        command: list[str],
        env: dict[str, str],
        leftovers: tuple[Path, ...] = (),
    ) -> Child:
        return spawn(
            service,
            title,
            command,
            env=env,
            cwd=self.data_dir,
            log_path=self.data_dir / log_name,
            leftovers=leftovers,
        )

    def _wait_s3(self, deadline: float) -> None:
        assert self._ports is not None
        log = self._bucket_access(LOG_BUCKET) if self._durable else None
        options = client_options(self._build_settings().media)  # as every S3 client of these settings
        probe = _seaweedfs.ready_probe(self._ports.s3, options, self._bucket_access(self._bucket), log)
        self._wait(S3, probe, deadline)

    def _wait_broker(self, deadline: float) -> None:
        assert self._ports is not None
        port = self._ports.kafka
        self._wait(BROKER, lambda: kafka_probe(port), deadline)

    def _wait(self, service: str, probe: Callable[[], None], deadline: float) -> None:
        wait_until_ready(
            self._children[service],
            list(self._children.values()),
            probe,
            deadline=deadline,
            timeout_s=self._startup_timeout_s,
            logs_removed=self._dirs.temporary,
        )

    def _build_settings(self) -> Settings:
        assert self._ports is not None
        values: dict[str, Any] = {'db_path': str(self.data_dir / 'projection')}
        values.update(self._overrides)
        values.update(
            bootstrap_servers=f'{HOST}:{self._ports.kafka}',
            s3_endpoint=self._s3_endpoint,
            s3_bucket=self._bucket,
            s3_region=REGION,
            s3_access_key_id=self._access_key_id,
            s3_secret_access_key=self._secret_access_key,
        )
        return Settings(**values)


def _check_options(
    data_dir: str | Path | None,
    *,
    durable: bool,
    bucket: str,
    broker: str | None,
    startup_timeout_s: float,
    s3_certfile: str | Path | None,
    s3_keyfile: str | Path | None,
    settings_overrides: dict[str, Any],
) -> str:
    """Refuse `EmbeddedStack` arguments that cannot work, before anything starts; returns the broker.

    The broker is the one asked for, else `STEPSTREAM_EMBEDDED_BROKER`, else Tansu.
    """
    if durable and data_dir is None:
        raise ValueError(
            'EmbeddedStack(durable=True) needs a data_dir: the log must outlive the stack somewhere'
        )
    if bucket == LOG_BUCKET:
        raise ValueError(f'bucket {bucket!r} is reserved for the durable Kafka log; pick another name')
    broker = broker or os.environ.get('STEPSTREAM_EMBEDDED_BROKER') or 'tansu'
    if broker not in BROKERS:
        raise ValueError(f'broker must be one of {BROKERS} (or STEPSTREAM_EMBEDDED_BROKER), got {broker!r}')
    if (s3_certfile is None) != (s3_keyfile is None):
        raise ValueError('EmbeddedStack needs both s3_certfile and s3_keyfile to serve S3 over HTTPS')
    if s3_certfile is not None and durable:
        raise ValueError(
            "EmbeddedStack(durable=True) keeps Tansu's log in S3 over plain HTTP; it cannot be "
            'combined with s3_certfile'
        )
    if s3_certfile is not None and not settings_overrides.get('s3_cafile'):
        raise ValueError(
            'EmbeddedStack(s3_certfile=...) needs s3_cafile=, the CA that signed the certificate '
            '(no public CA signs one for 127.0.0.1)'
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
    return broker


_LIVE_STACKS: set[EmbeddedStack] = set()


@atexit.register
def _stop_live_stacks() -> None:
    for stack in list(_LIVE_STACKS):
        with contextlib.suppress(Exception):
            stack.stop()
