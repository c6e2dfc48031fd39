"""Media offload: large payloads live once in a content-addressed store, the log holds references.

`offload_media` replaces every payload of at least `threshold_bytes` in a message history by a
`media+sha256://` reference, uploads it and lists what it stored (`externalize_media` gives only
the lean messages); `restore_media` puts the payloads back. `snapshot_media` says which objects a
snapshot record needs: the one answer of the media index, `forget` and the media sweep. Stores:
`S3MediaStore` (any S3-compatible service) and `DiskMediaStore` (a local directory), both behind
the `MediaStore` protocol. `MediaExternalizer` is a capability that sends large media to the model
as the store's public URL instead of as bytes in every request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.media._disk import DiskMediaStore
    from stepstream.media._externalizer import MediaExternalizer
    from stepstream.media._references import legacy_media, snapshot_media
    from stepstream.media._s3 import S3MediaStore, StoredPayload
    from stepstream.media._sealed import SealedMediaStore
    from stepstream.media._types import (
        MEDIA_URI_SCHEME,
        NO_CONTEXT,
        REFERENCE_PREFIX,
        KeyStrategy,
        MediaContext,
        MediaIntegrityError,
        MediaNotFound,
        MediaStore,
        PublicUrlResolver,
        default_key_strategy,
        is_media_uri,
        make_static_public_url,
        media_uri_for,
        parse_media_uri,
    )
    from stepstream.media._walker import (
        DEFAULT_THRESHOLD_BYTES,
        Offloaded,
        externalize_media,
        link_media,
        media_read,
        offload_media,
        restore_media,
    )

_WHERE = {
    'DEFAULT_THRESHOLD_BYTES': 'stepstream.media._walker',
    'MEDIA_URI_SCHEME': 'stepstream.media._types',
    'NO_CONTEXT': 'stepstream.media._types',
    'REFERENCE_PREFIX': 'stepstream.media._types',
    'Offloaded': 'stepstream.media._walker',
    'DiskMediaStore': 'stepstream.media._disk',
    'KeyStrategy': 'stepstream.media._types',
    'MediaContext': 'stepstream.media._types',
    'MediaExternalizer': 'stepstream.media._externalizer',
    'MediaIntegrityError': 'stepstream.media._types',
    'MediaNotFound': 'stepstream.media._types',
    'MediaStore': 'stepstream.media._types',
    'PublicUrlResolver': 'stepstream.media._types',
    'S3MediaStore': 'stepstream.media._s3',
    'SealedMediaStore': 'stepstream.media._sealed',
    'StoredPayload': 'stepstream.media._s3',
    'default_key_strategy': 'stepstream.media._types',
    'is_media_uri': 'stepstream.media._types',
    'externalize_media': 'stepstream.media._walker',
    'legacy_media': 'stepstream.media._references',
    'link_media': 'stepstream.media._walker',
    'media_read': 'stepstream.media._walker',
    'offload_media': 'stepstream.media._walker',
    'snapshot_media': 'stepstream.media._references',
    'make_static_public_url': 'stepstream.media._types',
    'media_uri_for': 'stepstream.media._types',
    'parse_media_uri': 'stepstream.media._types',
    'restore_media': 'stepstream.media._walker',
}
"""Where each public name lives: imported on first use, so a reader that only needs a store
(`stepstream runs`) does not import the capability and Pydantic AI with it."""

__all__ = [
    'DEFAULT_THRESHOLD_BYTES',
    'MEDIA_URI_SCHEME',
    'NO_CONTEXT',
    'REFERENCE_PREFIX',
    'DiskMediaStore',
    'KeyStrategy',
    'MediaContext',
    'MediaExternalizer',
    'MediaIntegrityError',
    'MediaNotFound',
    'MediaStore',
    'Offloaded',
    'PublicUrlResolver',
    'S3MediaStore',
    'SealedMediaStore',
    'StoredPayload',
    'default_key_strategy',
    'externalize_media',
    'is_media_uri',
    'legacy_media',
    'link_media',
    'make_static_public_url',
    'media_read',
    'media_uri_for',
    'offload_media',
    'parse_media_uri',
    'restore_media',
    'snapshot_media',
]

__getattr__ = lazy_exports(__name__, _WHERE)
