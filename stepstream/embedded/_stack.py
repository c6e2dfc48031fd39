"""`EmbeddedStack`: the broker and SeaweedFS composed into one stack with one `Settings`.

Its arguments are checked, and its `Settings` made, by `_options.StackOptions`; each child's command
line and readiness probe are `_launch.Launch`'s. This module decides when the two children start,
are waited for, restart and stop.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from stepstream.embedded import _seaweedfs
from stepstream.embedded._dirs import StackDirs
from stepstream.embedded._launch import Binaries, Launch
from stepstream.embedded._network import pick_ports
from stepstream.embedded._options import StackOptions
from stepstream.embedded._processes import (
    BROKER,
    S3,
    Child,
    EmbeddedStackError,
    terminate,
    wait_until_ready,
)
from stepstream.settings import Settings


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
        self._options = StackOptions.check(
            data_dir,
            durable=durable,
            bucket=bucket,
            broker=broker,
            startup_timeout_s=startup_timeout_s,
            tansu_bin=tansu_bin,
            weed_bin=weed_bin,
            s3_certfile=s3_certfile,
            s3_keyfile=s3_keyfile,
            settings_overrides=settings_overrides,
        )
        self._lock = threading.RLock()
        self._dirs = StackDirs(None if data_dir is None else Path(data_dir).absolute())
        self._launch: Launch | None = None
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
        return self._options.broker

    @property
    def durable(self) -> bool:
        """Whether the Kafka log lives in SeaweedFS under `data_dir` (and so survives a restart)."""
        return self._options.durable

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
            binaries = Binaries.resolve(self._options)
            try:
                self._dirs.prepare()
                assert self._dirs.socket_dir is not None
                for attempt in (1, 2):
                    ports = pick_ports(_seaweedfs.COMPONENTS)
                    self._launch = Launch(
                        self._options, binaries, ports, self.data_dir, self._dirs.socket_dir
                    )
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
                self._launch = None
                self._dirs.release()
                raise
            assert self._launch is not None
            self._settings = self._launch.settings()
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
            if self._options.durable:
                terminate([broker])
                terminate([s3])
            else:
                terminate([broker, s3])
            self._settings = None
            self._launch = None
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
            self._start_again(BROKER, 'the broker', 'stop_broker')

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
            self._start_again(S3, 'S3', 'stop_s3')

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
        return f'EmbeddedStack({where}, data_dir={self._dirs.data_dir}, durable={self._options.durable})'

    # -- startup --------------------------------------------------------------------------------

    def _require_started(self) -> None:
        if self._settings is None:
            raise EmbeddedStackError('the stack is not started')

    def _start_again(self, service: str, name: str, stopper: str) -> None:
        self._require_started()
        if service in self._children:
            raise EmbeddedStackError(f'{name} is already running; call {stopper}() first')
        self._spawn(service)
        try:
            self._wait(service, time.monotonic() + self._options.startup_timeout_s)
        except BaseException:
            terminate([self._children.pop(service, None)])
            raise

    def _start_services(self) -> None:
        deadline = time.monotonic() + self._options.startup_timeout_s
        self._spawn(S3)
        if self._options.durable:
            # Tansu's s3 engine reads the log from SeaweedFS at startup, so S3 must answer first.
            self._wait(S3, deadline)
            self._spawn(BROKER)
        else:
            self._spawn(BROKER)
            self._wait(S3, deadline)
        self._wait(BROKER, deadline)

    def _spawn(self, service: str) -> None:
        assert self._launch is not None
        self._children[service] = self._launch.spawn(service)

    def _wait(self, service: str, deadline: float) -> None:
        assert self._launch is not None
        wait_until_ready(
            self._children[service],
            list(self._children.values()),
            self._launch.probe(service),
            deadline=deadline,
            timeout_s=self._options.startup_timeout_s,
            logs_removed=self._dirs.temporary,
        )


_LIVE_STACKS: set[EmbeddedStack] = set()


@atexit.register
def _stop_live_stacks() -> None:
    for stack in list(_LIVE_STACKS):
        with contextlib.suppress(Exception):
            stack.stop()
