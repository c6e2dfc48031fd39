"""What an `EmbeddedStack` is asked to run, checked before anything starts, and the `Settings` it hands out.

`StackOptions.check` refuses arguments that cannot work (a durable stack without a data dir, HTTPS
without a CA, a setting the stack owns) with the reason, before a process is spawned; the options
it returns then say which broker, bucket and binaries to use. `StackOptions.settings` is the
`Settings` that points producer, projector and media store at a started stack's services.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepstream.embedded._network import HOST, Ports
from stepstream.embedded._seaweedfs import LOG_BUCKET, REGION
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


@dataclass(frozen=True, slots=True)
class StackOptions:
    """The arguments of an `EmbeddedStack`, checked: see `EmbeddedStack` for what each does."""

    durable: bool
    broker: str
    """`'tansu'` or `'kafka'`: the one asked for, else `STEPSTREAM_EMBEDDED_BROKER`, else Tansu."""
    bucket: str
    startup_timeout_s: float
    tansu_bin: str | None
    weed_bin: str | None
    s3_tls: tuple[Path, Path] | None
    """The certificate and key (PEM) SeaweedFS serves S3 with over HTTPS, or None for plain HTTP."""
    overrides: Mapping[str, Any]
    """The `**settings_overrides`: every other field of `Settings`."""

    @classmethod
    def check(
        cls,
        data_dir: str | Path | None,
        *,
        durable: bool,
        bucket: str,
        broker: str | None,
        startup_timeout_s: float,
        tansu_bin: str | Path | None,
        weed_bin: str | Path | None,
        s3_certfile: str | Path | None,
        s3_keyfile: str | Path | None,
        settings_overrides: dict[str, Any],
    ) -> StackOptions:
        """Refuse `EmbeddedStack` arguments that cannot work, before anything starts.

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
            raise ValueError(
                f'broker must be one of {BROKERS} (or STEPSTREAM_EMBEDDED_BROKER), got {broker!r}'
            )
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
        return cls(
            durable=durable,
            broker=broker,
            bucket=bucket,
            startup_timeout_s=startup_timeout_s,
            tansu_bin=None if tansu_bin is None else str(tansu_bin),
            weed_bin=None if weed_bin is None else str(weed_bin),
            s3_tls=(
                None if s3_certfile is None or s3_keyfile is None else (Path(s3_certfile), Path(s3_keyfile))
            ),
            overrides=dict(settings_overrides),
        )

    def s3_endpoint(self, ports: Ports) -> str:
        """The URL of SeaweedFS's S3 on `ports` (`https://` when it serves TLS)."""
        scheme = 'http' if self.s3_tls is None else 'https'
        return f'{scheme}://{HOST}:{ports.s3}'

    def settings(self, data_dir: Path, ports: Ports, access_key_id: str, secret_access_key: str) -> Settings:
        """The `Settings` of a stack started on `ports` with these S3 keys: the overrides, its services."""
        values: dict[str, Any] = {'db_path': str(data_dir / 'projection')}
        values.update(self.overrides)
        values.update(
            bootstrap_servers=f'{HOST}:{ports.kafka}',
            s3_endpoint=self.s3_endpoint(ports),
            s3_bucket=self.bucket,
            s3_region=REGION,
            s3_access_key_id=access_key_id,
            s3_secret_access_key=secret_access_key,
        )
        return Settings(**values)
