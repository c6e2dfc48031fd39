"""`S3MediaStore`: media in any S3-compatible bucket (AWS S3, R2, MinIO, SeaweedFS), via obstore.

obstore signs and retries every request (docs/decisions/0004-s3-client.md); this module only maps
media URIs to keys and makes the requests. `_s3_attributes` maps `MediaContext` to object
attributes, and `_s3_errors` says what obstore's errors mean; the store raises them naming the
endpoint and bucket that failed.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import obstore
from obstore.exceptions import BaseError as ObstoreError
from obstore.store import S3Store

from stepstream.errors import MediaUnavailable
from stepstream.media._s3_attributes import context_from_attributes, object_attributes
from stepstream.media._s3_errors import diagnose, first_line
from stepstream.media._types import (
    NO_CONTEXT,
    KeyStrategy,
    MediaContext,
    MediaNotFound,
    PublicUrlResolver,
    default_key_strategy,
    media_uri_off_loop,
    parse_media_uri,
    verified,
)

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

    from stepstream.settings import MediaSettings

__all__ = ['S3MediaStore']

# Fail within seconds when S3 is down instead of obstore's default of retrying for minutes: a
# snapshot waits on this, and the run should fail with a clear error while someone can act on it.
_DEFAULT_CLIENT_OPTIONS: dict[str, Any] = {
    'connect_timeout': timedelta(seconds=5),
    'timeout': timedelta(seconds=120),
}
_DEFAULT_RETRY_CONFIG: dict[str, Any] = {
    'max_retries': 3,
    'retry_timeout': timedelta(seconds=15),
    'backoff': {
        'init_backoff': timedelta(milliseconds=100),
        'max_backoff': timedelta(seconds=2),
        'base': 2.0,
    },
}

REFRESH_AFTER = timedelta(hours=1)
"""A `put` of a payload whose object is older than this uploads it again (its age restarts): a
media sweep's grace period must exceed it plus the time from a put to its record being applied."""

_PAYLOAD_KEY = re.compile(r'[0-9a-f]{64}\.bin')


@dataclass(frozen=True, slots=True)
class StoredPayload:
    """One payload object in the bucket, as a listing sees it."""

    digest: str
    key: str
    size: int
    last_modified: datetime


class S3MediaStore:
    """Media as objects in an S3-compatible bucket, one object per distinct payload.

    Objects live at `{key_prefix}/{key_strategy(uri, ctx)}`, by default `<sha256>.bin`. A put
    first asks whether the object is there (HEAD) and uploads only if not, so the same image in a
    thousand messages is uploaded once. `ctx.media_type` becomes the Content-Type, `ctx.filename`
    the Content-Disposition and `ctx.metadata` the user metadata of the object, as of its first
    put. Metadata keys must be lowercase (`[a-z0-9][a-z0-9._-]*`), because S3 lowercases them.

    Credentials left as None come from the usual AWS environment variables or instance role.
    Any failure to reach or use the bucket raises `MediaUnavailable` naming endpoint and bucket;
    obstore retries transient errors first (`retry_config`, `client_options` override the
    defaults of 3 retries within 15 s and a 5 s connect timeout).

    ```python
    store = S3MediaStore.from_settings(Settings.from_env().media)
    uri = await store.put(png, MediaContext(media_type='image/png'))
    ```
    """

    def __init__(
        self,
        *,
        bucket: str,
        endpoint: str | None = None,
        region: str = 'us-east-1',
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        key_prefix: str = '',
        public_url: PublicUrlResolver | None = None,
        key_strategy: KeyStrategy | None = None,
        client_options: ClientConfig | None = None,
        retry_config: RetryConfig | None = None,
        refresh_after: timedelta = REFRESH_AFTER,
    ) -> None:
        """`refresh_after`: a put of a payload whose object is older uploads it again (see `put`)."""
        if not bucket:
            raise ValueError('S3MediaStore needs a bucket name')
        self.bucket = bucket
        self.endpoint = endpoint
        self.key_prefix = key_prefix.strip('/')
        self._public_url = public_url
        self._key_strategy = key_strategy or default_key_strategy
        self.refresh_after = refresh_after
        options: dict[str, Any] = {**_DEFAULT_CLIENT_OPTIONS, **(client_options or {})}
        if endpoint is not None and endpoint.startswith('http://'):
            options.setdefault('allow_http', True)
        config: dict[str, Any] = {'region': region}
        if endpoint is not None:
            config['endpoint'] = endpoint
        if access_key_id is not None:
            config['access_key_id'] = access_key_id
        if secret_access_key is not None:
            config['secret_access_key'] = secret_access_key
        retry: dict[str, Any] = {**_DEFAULT_RETRY_CONFIG, **(retry_config or {})}
        self._store = S3Store(bucket, client_options=options, retry_config=retry, **config)  # type: ignore[arg-type]

    @classmethod
    def from_settings(
        cls,
        media: MediaSettings,
        *,
        key_prefix: str = '',
        public_url: PublicUrlResolver | None = None,
        key_strategy: KeyStrategy | None = None,
    ) -> S3MediaStore:
        """The store the `STEPSTREAM_S3_*` settings (`settings.media`) describe: producer, reader, CLI."""
        from stepstream.s3_client import client_options

        return cls(
            bucket=media.s3_bucket,
            endpoint=media.s3_endpoint,
            region=media.s3_region,
            access_key_id=media.s3_access_key_id,
            secret_access_key=(
                media.s3_secret_access_key.get_secret_value()
                if media.s3_secret_access_key is not None
                else None
            ),
            key_prefix=key_prefix,
            public_url=public_url,
            key_strategy=key_strategy,
            client_options=client_options(media),
        )

    def __repr__(self) -> str:
        return (
            f'S3MediaStore(bucket={self.bucket!r}, endpoint={self.endpoint!r}, '
            f'key_prefix={self.key_prefix!r})'
        )

    @property
    def object_store(self) -> S3Store:
        """The obstore client of the bucket, for stepstream's other objects (shard checkpoints)."""
        return self._store

    @property
    def location(self) -> str:
        """Where the objects live, as error messages name it."""
        where = self.endpoint or 'AWS S3'
        prefix = f', key prefix {self.key_prefix!r}' if self.key_prefix else ''
        return f'S3 bucket {self.bucket!r} at {where}{prefix}'

    def key_for(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> str:
        """The object key of `uri`: `key_prefix` joined with what the key strategy returns."""
        parse_media_uri(uri)
        key = self._key_strategy(uri, ctx).lstrip('/')
        if not key:
            raise ValueError(f'key_strategy returned an empty key for {uri}')
        return f'{self.key_prefix}/{key}' if self.key_prefix else key

    async def put(self, data: bytes, ctx: MediaContext = NO_CONTEXT) -> str:
        """Upload `data` unless an object of the same size is already at its key; return its URI.

        The check makes repeated snapshots of one conversation cost a HEAD, not an upload. An
        object of another size is overwritten, which repairs a truncated upload. An object older
        than `refresh_after` (an hour by default) is uploaded again, so that a payload re-used now
        is young again: a media sweep deletes only objects older than its grace period (decision
        0032).
        """
        uri = await media_uri_off_loop(data)
        key = self.key_for(uri, ctx)
        attributes = object_attributes(ctx)
        try:
            meta = await obstore.head_async(self._store, key)
        except FileNotFoundError:
            meta = None
        except (ObstoreError, OSError) as exc:
            self._fail('check whether it already holds', uri, exc)
        if (
            meta is not None
            and meta['size'] == len(data)
            and datetime.now(UTC) - meta['last_modified'] < self.refresh_after
        ):
            return uri
        try:
            await obstore.put_async(self._store, key, data, attributes=attributes)
        except FileNotFoundError as exc:  # S3 answers NoSuchBucket to a PUT with 404
            self._fail('store', uri, exc, missing_bucket=True)
        except (ObstoreError, OSError) as exc:
            self._fail('store', uri, exc)
        return uri

    async def get(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bytes:
        """The bytes of `uri`, verified against its SHA-256 (`MediaIntegrityError` otherwise)."""
        key = self.key_for(uri, ctx)
        try:
            result = await obstore.get_async(self._store, key)
            data = bytes(await result.bytes_async())
        except FileNotFoundError as exc:
            self._not_found(uri, exc)
        except (ObstoreError, OSError) as exc:
            self._fail('read', uri, exc)
        return await verified(uri, data, self.location)

    async def check(self) -> None:
        """Fail now, with `MediaUnavailable`, if the bucket is missing or the credentials are refused.

        One LIST request. An `EventLog` whose capabilities use its settings' bucket calls it at
        start, so that a wrong key or bucket name is found before a run, not at its first large
        payload minutes later.
        """
        try:
            await obstore.list_with_delimiter_async(self._store, prefix=self.key_prefix or None)
        except (ObstoreError, OSError) as exc:
            self._list_failed(exc)

    async def exists(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bool:
        """Whether an object is stored at the key of `uri` (one HEAD request)."""
        key = self.key_for(uri, ctx)
        try:
            await obstore.head_async(self._store, key)
        except FileNotFoundError:
            return False
        except (ObstoreError, OSError) as exc:
            self._fail('look up', uri, exc)
        return True

    async def public_url(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> str | None:
        """The resolver's URL for `uri`, or None without a `public_url=` resolver."""
        key = self.key_for(uri, ctx)
        return None if self._public_url is None else await self._public_url(uri, ctx, key)

    async def get_metadata(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> MediaContext:
        """Content-Type, filename and user metadata of the stored object (no body is transferred)."""
        key = self.key_for(uri, ctx)
        try:
            result = await obstore.get_async(self._store, key, options={'head': True})
        except FileNotFoundError as exc:
            self._not_found(uri, exc)
        except (ObstoreError, OSError) as exc:
            self._fail('read the metadata of', uri, exc)
        return context_from_attributes(dict(result.attributes))

    async def payloads(self) -> AsyncIterator[StoredPayload]:
        """Every object of the default key layout (`<sha256>.bin` under `key_prefix`) in the bucket.

        Other objects (shard checkpoints under `_checkpoints/`, anything else) are not listed; nor
        is anything when a custom `key_strategy` decides the keys (`MediaUnavailable`).
        """
        if self._key_strategy is not default_key_strategy:
            raise MediaUnavailable(
                f'{self.location} uses a custom key_strategy: its keys do not say which payload they '
                'hold, so it cannot be swept'
            )
        prefix = f'{self.key_prefix}/' if self.key_prefix else ''
        try:
            async for chunk in obstore.list(self._store, prefix=prefix or None):
                for meta in chunk:
                    name = meta['path'][len(prefix) :]
                    if _PAYLOAD_KEY.fullmatch(name):
                        yield StoredPayload(name[:64], meta['path'], meta['size'], meta['last_modified'])
        except (ObstoreError, OSError) as exc:
            self._list_failed(exc)

    async def delete(self, uri: str) -> None:
        """Delete the payload of `uri` (one already gone is fine).

        The one way media leaves the bucket: the retention sweep's (decision 0032) and
        `stepstream forget`'s (decision 0033).
        """
        try:
            await obstore.delete_async(self._store, self.key_for(uri))
        except FileNotFoundError:
            return
        except (ObstoreError, OSError) as exc:
            self._fail('delete', uri, exc)

    def _not_found(self, uri: str, exc: BaseException) -> NoReturn:
        # A GET names the missing bucket in its error body; a HEAD cannot tell the two apart.
        if 'NoSuchBucket' in str(exc):
            self._fail('read', uri, exc, missing_bucket=True)
        raise MediaNotFound(uri, self.location) from exc

    def _list_failed(self, exc: BaseException) -> NoReturn:
        what, advice = diagnose(exc, missing_bucket=False)
        raise MediaUnavailable(
            f'could not list {self.location}: {what} ({first_line(exc)}). {advice}.'
        ) from exc

    def _fail(self, action: str, uri: str, exc: BaseException, *, missing_bucket: bool = False) -> NoReturn:
        what, advice = diagnose(exc, missing_bucket=missing_bucket)
        raise MediaUnavailable(
            f'could not {action} media {uri} in {self.location}: {what} ({first_line(exc)}). {advice}.'
        ) from exc
