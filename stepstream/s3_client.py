"""How every S3 client stepstream makes connects: the one place S3 client options are built.

The media store (`S3MediaStore.from_settings`), and through it the producer's offload, the
projector and its shard checkpoints, `stepstream serve`, the CLI and the bucket check at
`EventLog` start, build their obstore client with `client_options(settings.media)`; so does the
embedded stack's readiness probe. A setting that changes how S3 is reached (plain HTTP, a
private CA) therefore reaches all of them or none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.errors import MediaUnavailable
from stepstream.settings import MediaSettings

if TYPE_CHECKING:
    from obstore.store import ClientConfig

_PEM_CERTIFICATE = '-----BEGIN CERTIFICATE-----'


def client_options(media: MediaSettings) -> ClientConfig:
    """The obstore `client_options` for the S3 endpoint the settings name.

    Plain HTTP only for an `http://` endpoint; the CA file, when set, is added to the system's
    trusted roots (obstore's `root_certificate`), so certificate checking always stays on.

    ```python
    store = S3Store(bucket, endpoint=media.s3_endpoint, client_options=client_options(media))
    ```
    """
    options: ClientConfig = {}
    if (media.s3_endpoint or '').startswith('http://'):
        options['allow_http'] = True
    if media.s3_cafile:
        options['root_certificate'] = _read_ca(media.s3_cafile)
    return options


def _read_ca(path: str) -> str:
    try:
        with open(path, encoding='ascii', errors='replace') as f:
            pem = f.read()
    except OSError as exc:
        raise MediaUnavailable(f'STEPSTREAM_S3_CAFILE={path!r} cannot be read: {exc.strerror}') from None
    if _PEM_CERTIFICATE not in pem:
        raise MediaUnavailable(
            f'STEPSTREAM_S3_CAFILE={path!r} holds no PEM certificate ({_PEM_CERTIFICATE} ...): '
            'name the CA certificate that signed the S3 endpoint'
        )
    return pem
