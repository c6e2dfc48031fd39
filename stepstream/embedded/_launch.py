"""How a stack's two children are launched: their command lines, environments, logs and probes.

`EmbeddedStack` decides when to start, wait for and stop each child; a `Launch` says how, for the
ports, binaries and S3 keys of one attempt to start (`spawn(service)` and `probe(service)`, the
service being `BROKER` or `S3`), and which `Settings` then reach them.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stepstream.embedded import _seaweedfs, _tansu, apache_kafka
from stepstream.embedded._network import Ports, kafka_probe
from stepstream.embedded._options import StackOptions
from stepstream.embedded._processes import BROKER, S3, Child, child_env, spawn
from stepstream.embedded._seaweedfs import LOG_BUCKET
from stepstream.s3_client import client_options
from stepstream.settings import Settings


@dataclass(frozen=True, slots=True)
class Binaries:
    """The programs a stack runs, found once per start: the broker's, SeaweedFS's, Kafka's jars."""

    broker: str
    weed: str
    kafka_lib: Path | None = None

    @classmethod
    def resolve(cls, options: StackOptions) -> Binaries:
        """The binaries `options` ask for (Apache Kafka's jars are fetched once with Maven)."""
        if options.broker == 'kafka':
            broker, kafka_lib = apache_kafka.resolve()
            return cls(broker, _seaweedfs.resolve(options.weed_bin), kafka_lib)
        return cls(_tansu.resolve(options.tansu_bin), _seaweedfs.resolve(options.weed_bin))


@dataclass(frozen=True, slots=True)
class Launch:
    """One start's children: `options`' services from `binaries` on `ports`, with fresh S3 keys."""

    options: StackOptions
    binaries: Binaries
    ports: Ports
    data_dir: Path
    socket_dir: Path
    access_key_id: str = field(default_factory=lambda: 'ss' + secrets.token_hex(8))
    secret_access_key: str = field(default_factory=lambda: secrets.token_hex(20))

    def settings(self) -> Settings:
        """The `Settings` that point at these children."""
        return self.options.settings(self.data_dir, self.ports, self.access_key_id, self.secret_access_key)

    def spawn(self, service: str) -> Child:
        """Start `service`'s child (it may not answer yet: see `probe`)."""
        return self._spawn_s3() if service == S3 else self._spawn_broker()

    def probe(self, service: str) -> Callable[[], None]:
        """A real request to `service` that fails until it answers."""
        if service == BROKER:
            port = self.ports.kafka
            return lambda: kafka_probe(port)
        log = self._bucket(LOG_BUCKET) if self.options.durable else None
        options = client_options(self.settings().media)  # as every S3 client of these settings
        return _seaweedfs.ready_probe(self.ports.s3, options, self._bucket(self.options.bucket), log)

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        return child_env(self.data_dir / 'tmp', extra)

    def _bucket(self, name: str) -> _seaweedfs.Bucket:
        endpoint = self.options.s3_endpoint(self.ports)
        return _seaweedfs.Bucket(endpoint, name, self.access_key_id, self.secret_access_key)

    def _spawn_s3(self) -> Child:
        bucket = self.options.bucket
        buckets = [bucket, LOG_BUCKET] if self.options.durable else [bucket]
        command = _seaweedfs.command(
            self.binaries.weed,
            data_dir=self.data_dir,
            ports=self.ports.weed,
            buckets=buckets,
            socket_dir=self.socket_dir,
            tls=self.options.s3_tls,
        )
        env = self._env(
            {'AWS_ACCESS_KEY_ID': self.access_key_id, 'AWS_SECRET_ACCESS_KEY': self.secret_access_key}
        )
        child = self._start(
            S3, _seaweedfs.TITLE, _seaweedfs.LOG_NAME, command, env, _seaweedfs.leftovers(self.ports.weed)
        )
        child.leftover_prefix = _seaweedfs.LEFTOVER_PREFIX
        return child

    def _spawn_broker(self) -> Child:
        if self.options.broker == 'kafka':
            assert self.binaries.kafka_lib is not None
            command = apache_kafka.node_command(
                self.binaries.broker,
                self.binaries.kafka_lib,
                self.data_dir / 'kafka',
                port=self.ports.kafka,
                controller_port=self.ports.controller,
                log_path=self.data_dir / apache_kafka.LOG_NAME,
                env=self._env({}),
            )
            return self._start(BROKER, apache_kafka.TITLE, apache_kafka.LOG_NAME, command, self._env({}))
        log_bucket = self._bucket(LOG_BUCKET) if self.options.durable else None
        command, extra = _tansu.command(self.binaries.broker, self.ports.kafka, log_bucket=log_bucket)
        return self._start(BROKER, _tansu.TITLE, _tansu.LOG_NAME, command, self._env(extra))

    def _start(
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
