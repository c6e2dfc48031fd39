"""The media vocabulary every store and walker shares: URIs, `MediaContext`, the store seam, errors.

A payload is named by the SHA-256 of its bytes, never by where it lives. Identical bytes get one
name however many messages, runs or processes refer to them, and moving the media to another
bucket or directory changes configuration, not a single record in the log.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable
from urllib.parse import quote

from stepstream.errors import StepStreamError

__all__ = [
    'NO_CONTEXT',
    'KeyStrategy',
    'MediaContext',
    'MediaIntegrityError',
    'MediaNotFound',
    'MediaStore',
    'PublicUrlResolver',
    'default_key_strategy',
    'make_static_public_url',
    'media_uri_for',
    'parse_media_uri',
]

MEDIA_URI_SCHEME = 'media+sha256://'

REFERENCE_PREFIX = '\x00stepstream:'
"""Starts every reference a walker leaves in a message (`REFERENCE_PREFIX + 'media+sha256://<hex>'`)
and every escaped value (docs/decisions/0005-media-references.md)."""

JSON_REFERENCE = 'json:'
"""After `REFERENCE_PREFIX`: the reference names a JSON payload that stands for a list or dict."""

_URI = re.compile(r'media\+sha256://([0-9a-f]{64})')


_EMPTY: Mapping[str, str] = MappingProxyType({})


def media_uri_for(data: bytes) -> str:
    """The content address of `data`: `media+sha256://<64 lowercase hex>`.

    The same bytes get the same URI in every store, so a URI written to the log today still
    names the payload after the media moves to another bucket.
    """
    return MEDIA_URI_SCHEME + hashlib.sha256(data).hexdigest()


def parse_media_uri(uri: str) -> str:
    """The SHA-256 hex digest a media URI names; `ValueError` for anything else.

    Stores validate every URI before turning it into a key, so a string read back from a record
    can never become an arbitrary object key or file path.

    ```python
    parse_media_uri('media+sha256://' + 'ab' * 32)  # -> 'abab...ab'
    ```
    """
    match = _URI.fullmatch(uri) if isinstance(uri, str) else None
    if match is None:
        raise ValueError(
            f'{uri!r} is not a media URI: expected {MEDIA_URI_SCHEME} followed by the 64 lowercase '
            'hex digits of the SHA-256 of the payload, e.g. what media_uri_for(data) returns'
        )
    return match.group(1)


def is_media_uri(value: str) -> bool:
    """Whether `value` is exactly a media URI (no surrounding text)."""
    return _URI.fullmatch(value) is not None


@dataclass(frozen=True, kw_only=True)
class MediaContext:
    """What the caller knows about a payload, passed to every store call and callback.

    `media_type` becomes the object's Content-Type, `filename` its Content-Disposition, and
    `metadata` its user metadata (S3 `x-amz-meta-*`, or the sidecar file of a disk store). Key
    strategies and public-URL resolvers receive it too, so a layout or URL can depend on the media
    type without a new parameter anywhere. `metadata` is copied into a read-only mapping.
    """

    media_type: str | None = None
    filename: str | None = None
    metadata: Mapping[str, str] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        bad = [(k, v) for k, v in self.metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise TypeError(
                f'MediaContext.metadata maps strings to strings; got {bad[0][0]!r}: {bad[0][1]!r}'
            )
        if self.metadata is not _EMPTY:
            object.__setattr__(self, 'metadata', MappingProxyType(dict(self.metadata)))


NO_CONTEXT = MediaContext()
"""The default `ctx` of every store call: nothing known about the payload."""

KeyStrategy = Callable[[str, MediaContext], str]
"""`(uri, ctx) -> key`: where a payload lives inside a store, e.g. to match an existing layout.

The key is relative to the store's root (a disk store's directory, an S3 store's `key_prefix`).
A strategy that uses `ctx` must be given the same context on `get` as on `put`.
"""

PublicUrlResolver = Callable[[str, MediaContext, str], Awaitable[str | None]]
"""`async (uri, ctx, key) -> url | None`: a URL a model or browser can fetch the payload from.

`key` is the object's full key in the store (an S3 store's `key_prefix` included), which is what
a CDN path or a presigned URL needs. Return None when there is no URL for this payload.
"""


def default_key_strategy(uri: str, ctx: MediaContext) -> str:
    """The default layout: `<sha256>.bin`, whatever the media type.

    The extension is fixed so that a payload's key does not depend on what a caller claimed its
    type was: the same bytes are found again under one key.
    """
    return parse_media_uri(uri) + '.bin'


def make_static_public_url(base_url: str, key_prefix: str = '') -> PublicUrlResolver:
    """A resolver for a public bucket or a CDN: `{base_url}/{key_prefix}{key}`.

    `key` already includes the store's own `key_prefix`; pass `key_prefix` here only when the
    CDN serves the bucket under an extra path. For presigned URLs write your own async resolver.

    ```python
    store = S3MediaStore(..., public_url=make_static_public_url('https://cdn.example.com/media'))
    await store.public_url(uri)  # -> 'https://cdn.example.com/media/<sha256>.bin'
    ```
    """
    base = base_url.rstrip('/')
    prefix = key_prefix.strip('/')
    prefix = prefix + '/' if prefix else ''

    async def resolve(uri: str, ctx: MediaContext, key: str) -> str:
        parse_media_uri(uri)
        return f'{base}/{quote(prefix + key, safe="/")}'

    return resolve


@runtime_checkable
class MediaStore(Protocol):
    """The storage seam of media offload: content-addressed bytes, all calls async.

    `put` returns the payload's URI and stores the bytes once however often it is called; `get`
    returns exactly the bytes the URI names (checked against the hash) or raises
    `MediaNotFound`/`MediaIntegrityError`; a store that cannot be reached raises
    `stepstream.errors.MediaUnavailable`. Every call takes the `MediaContext` of the payload.
    """

    async def put(self, data: bytes, ctx: MediaContext = NO_CONTEXT) -> str:
        """Store `data` unless it is already there; return its URI."""
        ...

    async def get(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bytes:
        """The bytes `uri` names, verified against its hash."""
        ...

    async def exists(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bool:
        """Whether the payload is stored."""
        ...

    async def public_url(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> str | None:
        """A URL to fetch the payload from, or None when the store has no resolver."""
        ...

    async def get_metadata(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> MediaContext:
        """The media type, filename and metadata the payload was first stored with."""
        ...


class MediaNotFound(LookupError, StepStreamError):
    """A media URI names a payload the store does not hold.

    The log refers to it, so it was deleted, or the reader points at another bucket or directory
    than the writer did.
    """

    def __init__(self, uri: str, where: str) -> None:
        super().__init__(
            f'media {uri} is not in {where}: it was deleted or never written there; check that '
            'the reader uses the same bucket, key_prefix and key_strategy as the writer'
        )
        self.uri = uri


class MediaIntegrityError(StepStreamError):
    """The bytes a store returned do not hash to the URI they were read for.

    Raised instead of handing corrupted media to a model. The stored object was altered outside
    stepstream; a `put` of the original payload repairs a truncated object by itself (its size
    differs), any other corruption once the object is deleted.
    """

    def __init__(self, uri: str, actual_uri: str, where: str) -> None:
        super().__init__(
            f'media {uri} in {where} is corrupted: its bytes hash to {actual_uri}. The stored object '
            'was changed outside stepstream; delete it and put the original payload again'
        )
        self.uri = uri
        self.actual_uri = actual_uri


_THREAD_HASH_BYTES = 1 << 20


async def media_uri_off_loop(data: bytes) -> str:
    """`media_uri_for`, in a worker thread for payloads of 1 MiB and more.

    hashlib releases the GIL on large inputs, so hashing a big image does not stall the event
    loop that runs the agents.
    """
    if len(data) >= _THREAD_HASH_BYTES:
        return await asyncio.to_thread(media_uri_for, data)
    return media_uri_for(data)


async def verified(uri: str, data: bytes, where: str) -> bytes:
    """`data` if it hashes to `uri`, else `MediaIntegrityError`."""
    actual = await media_uri_off_loop(data)
    if actual != uri:
        raise MediaIntegrityError(uri, actual, where)
    return data
