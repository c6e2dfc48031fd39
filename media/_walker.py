"""Walkers that move large payloads of a message history into a `MediaStore` and back.

The reference representation (docs/decisions/0005-media-references.md, widened by
docs/decisions/0018-offload-everything-large.md): a payload is replaced, in the very field or
item that held it, by `REFERENCE_PREFIX + uri`, a `str` where text was and its UTF-8 bytes in
`BinaryContent.data`. Every other field stays as it was, so the lean history is still a valid
history that Pydantic AI's own JSON round trip preserves. The prefix starts with a NUL character,
which ordinary text does not; a value that does start with the prefix is escaped by doubling it,
so restoring never mistakes a user's value for a reference.

The walk visits every string and bytes value anywhere in a message: part contents, nested
tool-return structures, tool-call arguments, instructions, system prompts, URLs. Inside the
free-form values of a part (`content`, `args`), a list or dict of plain JSON values whose lean
form is still at or above the threshold (say a thousand items of 50 KB) moves as one JSON
payload, `REFERENCE_PREFIX + 'json:' + uri`; it comes back as the value Pydantic AI's JSON gives.
"""

# No `from __future__ import annotations`: `Offloaded` crosses a durable engine's boundary, whose
# converter resolves its field types (in Temporal's sandbox, where this module's globals are not
# found by name), so they are evaluated here, at definition.

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_ai.messages import BinaryContent, ModelMessage

from stepstream.media._restorer import (
    _PREFIX_BYTES,
    _UTF8_ERRORS,
    JSON_MEDIA_TYPE,
    TEXT_MEDIA_TYPE,
    _Key,
    _Linker,
    _replace,
    _Restorer,
)
from stepstream.media._types import (
    JSON_REFERENCE,
    REFERENCE_PREFIX,
    MediaContext,
    MediaNotFound,
    MediaStore,
    media_uri_for,
)
from stepstream.settings import MediaSettings
from stepstream.telemetry import media_offloaded_bytes, media_offloads

LinkFor = Callable[[str, str], Awaitable[str]]
"""`(uri, media_type) -> URL` at which a reader of a linked history fetches that payload."""

__all__ = [
    'DEFAULT_THRESHOLD_BYTES',
    'REFERENCE_PREFIX',
    'Offloaded',
    'externalize_media',
    'link_media',
    'media_read',
    'offload_media',
    'restore_media',
]

DEFAULT_THRESHOLD_BYTES: int = MediaSettings.media_threshold_bytes
"""Payloads of at least this many bytes (UTF-8 for text) move to the media store: the default of
the `media_threshold_bytes` setting (`STEPSTREAM_MEDIA_THRESHOLD_BYTES`), defined there only."""

_MAX_CONCURRENT = 16
"""Store calls in flight per walker call: enough to overlap round trips, few enough for any S3."""
_FREE_FORM_FIELDS = frozenset({'content', 'args'})
"""Fields of a part whose value may be any JSON value, so a list or dict there may become a reference."""
_THREAD_BYTES = 1 << 20
"""Restores that put back at least this many bytes do their CPU work in a worker thread."""


@dataclass(frozen=True, slots=True)
class Offloaded:
    """What `offload_media` made of a history: the lean messages, and every object it stored.

    `media` is known by construction: the walk that replaced a payload by a reference is the one
    that lists it, so it holds the references of every part type and nesting (binaries, whose
    references are bytes that Pydantic AI's JSON writes as base64, included) and the references
    inside a JSON payload, which no reader of the lean messages can see without fetching it.
    """

    messages: list[ModelMessage]
    media: list[str]
    """The URI of every object put in the store for these messages (sorted, each once)."""


async def externalize_media(
    messages: Sequence[ModelMessage],
    store: MediaStore,
    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
    *,
    seal: Callable[[bytes], bytes] | None = None,
) -> list[ModelMessage]:
    """The lean messages of `offload_media(messages, store, threshold_bytes, seal=seal)`."""
    return (await offload_media(messages, store, threshold_bytes, seal=seal)).messages


async def offload_media(
    messages: Sequence[ModelMessage],
    store: MediaStore,
    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
    *,
    seal: Callable[[bytes], bytes] | None = None,
) -> Offloaded:
    """Copies of `messages` whose payloads of `threshold_bytes` or more are references into `store`.

    A payload is any string or bytes value anywhere in a message (text and thinking parts, user
    prompts, system prompts, instructions, tool-call arguments, tool returns at any depth, file
    and speech parts), and a list or dict inside a part's `content` or `args` whose lean JSON is
    still that large. The walk (which hashes every payload) runs in a worker thread, so a 50 MB
    tool return does not stall the event loop. Every distinct payload is uploaded once,
    concurrently, and all uploads finish before this returns, so a record built from the result
    never refers to a missing object; if one fails, its error is raised (`MediaUnavailable` for
    an unreachable store) and nothing is returned.

    The input is not modified. A message, part or sequence with nothing to change is returned as
    the same object: a walk visits every value but copies only what changes. `seal` (erasure on,
    decision 0033) turns each payload into the bytes stored and addressed in its place. Each
    payload stored counts in `stepstream.media.offloads`, its bytes (as stored) in
    `stepstream.media.offloaded_bytes` (`stepstream.telemetry`).

    The result also lists the URI of every object stored (`Offloaded.media`): a record built
    from the lean messages carries that list, so the projection, `forget` and the media sweep know
    what the record needs without reading its content.

    ```python
    offloaded = await offload_media(messages, store)
    record = ModelMessagesTypeAdapter.dump_json(offloaded.messages)  # small, whatever the attachments
    back = await restore_media(ModelMessagesTypeAdapter.validate_json(record), store)
    # `back` equals what the JSON round trip of `messages` itself gives
    ```
    """
    MediaSettings.check_threshold(threshold_bytes, 'threshold_bytes')
    externalizer = _Externalizer(threshold_bytes, seal)
    lean = await asyncio.to_thread(externalizer.messages, messages)
    media = sorted({uri for uri, _ in externalizer.uploads})
    if externalizer.uploads:

        async def upload(key: _Key, data: bytes) -> None:
            uri, media_type = key
            stored = await store.put(data, MediaContext(media_type=media_type))
            if stored != uri:
                raise ValueError(f'{store!r}.put returned {stored!r} for a payload whose URI is {uri}')
            media_offloads.add(1)  # what the store was given, whether or not it held it already
            media_offloaded_bytes.add(len(data))

        await _gather([upload(key, data) for key, data in externalizer.uploads.items()])
    return Offloaded(lean, media)


async def restore_media(messages: Sequence[ModelMessage], store: MediaStore) -> list[ModelMessage]:
    """Copies of `messages` with every reference `externalize_media` left replaced by its payload.

    The result equals the history that was externalized (`==`, including media types, identifiers
    and vendor metadata; a list or dict that moved as one payload comes back as Pydantic AI's
    JSON gives it back), also after the lean history went through Pydantic AI's JSON. Each
    distinct payload is fetched once, concurrently, and verified against its hash. Messages
    without references are returned as the same objects. Restore a history exactly once: a
    restored value that itself starts with `REFERENCE_PREFIX` would be read as escaped again.
    """
    fetched: dict[_Key, bytes] = {}
    while True:
        restorer = _Restorer(fetched)
        if sum(len(data) for data in fetched.values()) >= _THREAD_BYTES:
            restored = await asyncio.to_thread(restorer.messages, messages)
        else:
            restored = restorer.messages(messages)
        if not restorer.wanted:
            return restored
        # A JSON payload may hold references itself: fetch, then walk again with what is known.

        async def fetch(key: _Key) -> bytes:
            uri, media_type = key
            return await store.get(uri, MediaContext(media_type=media_type))

        keys = list(restorer.wanted)
        fetched.update(zip(keys, await _gather([fetch(key) for key in keys]), strict=True))


async def media_read(messages: Sequence[ModelMessage], store: MediaStore) -> set[str]:
    """The URI of every object that reading `messages` back (`restore_media`) would fetch.

    Found the way a reader finds them, not from what a writer declared: each reference in the
    lean messages, and inside each JSON payload they name (fetched, opened and walked in turn).
    Other payloads are not fetched. A JSON payload missing from the store is read, with nothing
    seen inside it. The media sweep checks its candidates against this before it deletes
    anything (docs/decisions/0041-media-known-by-construction.md).
    """
    fetched: dict[_Key, bytes] = {}
    read: set[str] = set()
    while True:
        restorer = _Restorer(fetched)
        restorer.messages(messages)
        read.update(uri for uri, _ in restorer.wanted)
        json_keys = [key for key in restorer.wanted if key[1] == JSON_MEDIA_TYPE and key not in fetched]
        if not json_keys:
            return read

        async def fetch(key: _Key) -> bytes:
            uri, media_type = key
            try:
                return await store.get(uri, MediaContext(media_type=media_type))
            except MediaNotFound:
                return b'null'  # gone: whatever it held is not readable, so nothing in it is read

        fetched.update(zip(json_keys, await _gather([fetch(key) for key in json_keys]), strict=True))


async def link_media(
    messages: Sequence[ModelMessage], store: MediaStore, link_for: LinkFor
) -> list[ModelMessage]:
    """A lean history (references in place) made readable without shipping its large binaries.

    Each offloaded `BinaryContent` in a user prompt or a tool return becomes the URL part of its
    kind (`ImageUrl`, `AudioUrl`, `VideoUrl`, else `DocumentUrl`) at `link_for(uri, media_type)`,
    so the history is still valid Pydantic AI JSON and a browser fetches the bytes itself.
    Offloaded text, and binaries of file and speech parts (whose field admits no URL), are
    restored from `store` as `restore_media` does, hash-checked. Give it a history exactly as
    the log holds it (`reader.list_snapshots(..., restore=False)`), never a restored one.
    """
    fetched: dict[_Key, bytes] = {}
    links: dict[_Key, str] = {}
    while True:
        linker = _Linker(fetched, links)
        linked = linker.messages(messages)
        if not linker.wanted and not linker.linked:
            return linked
        wanted, to_link = list(linker.wanted), list(linker.linked)
        fetched.update(
            zip(
                wanted,
                await _gather([store.get(u, MediaContext(media_type=t)) for u, t in wanted]),
                strict=True,
            )
        )
        links.update(zip(to_link, await _gather([link_for(*key) for key in to_link]), strict=True))


# -- out: payloads to references ----------------------------------------------------------------
# (the way in, references to payloads, is `_Restorer` and `_Linker` in `_restorer.py`)


class _Externalizer:
    """Walks values bottom-up; returns each lean value with the size of its JSON (an estimate)."""

    def __init__(self, threshold_bytes: int, seal: Callable[[bytes], bytes] | None = None) -> None:
        self.threshold_bytes = threshold_bytes
        self.uploads: dict[_Key, bytes] = {}
        self.seal = seal
        self._sealed: dict[bytes, bytes] = {}
        """Payload -> its sealed bytes: a payload repeated in one walk is stored once."""

    def _stored(self, data: bytes) -> bytes:
        """The bytes stored for `data`: itself, or sealed once per walk."""
        if self.seal is None:
            return data
        sealed = self._sealed.get(data)
        if sealed is None:
            sealed = self._sealed[data] = self.seal(data)
        return sealed

    def messages(self, messages: Sequence[ModelMessage]) -> list[ModelMessage]:
        return [self.value(m, free_form=False)[0] for m in messages]

    def _reference(self, data: bytes, media_type: str) -> str:
        data = self._stored(data)
        uri = media_uri_for(data)
        self.uploads.setdefault((uri, media_type), data)
        return REFERENCE_PREFIX + uri

    def text(self, value: str) -> tuple[str, int]:
        if len(value) * 4 >= self.threshold_bytes:  # below that no encoding can reach the threshold
            data = value.encode('utf-8', _UTF8_ERRORS)
            if len(data) >= self.threshold_bytes:
                return self._reference(data, TEXT_MEDIA_TYPE), 80
        if value.startswith(REFERENCE_PREFIX):
            value = REFERENCE_PREFIX + value
        return value, len(value) + 2

    def value(self, value: Any, *, free_form: bool) -> tuple[Any, int]:
        """`(lean value, JSON size)`; `free_form`: inside a value typed `Any` by Pydantic AI."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, BinaryContent):
            return self.binary(value)
        if isinstance(value, bytes):
            # Loose bytes (not `BinaryContent`) stay: Pydantic AI's JSON writes them as UTF-8 text
            # or as base64 depending on the value, so a reference could not come back as they do.
            return value, len(value) * 4 // 3 + 2
        if type(value) is dict:
            items = {k: self.value(v, free_form=free_form) for k, v in value.items()}
            size = sum(len(k) + 4 + s for k, (_, s) in items.items()) + 2
            lean: Any = value
            if any(new is not value[k] for k, (new, _) in items.items()):
                lean = {k: new for k, (new, _) in items.items()}
            return self._maybe_json(lean, size, free_form)
        if type(value) is list or type(value) is tuple:
            entries = [self.value(v, free_form=free_form) for v in value]
            size = sum(s + 1 for _, s in entries) + 2
            lean = value
            if any(new is not old for (new, _), old in zip(entries, value, strict=True)):
                lean = type(value)(new for new, _ in entries)
            return self._maybe_json(lean, size, free_form)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self._dataclass(value)
        return value, 8

    def _dataclass(self, obj: Any) -> tuple[Any, int]:
        changes: dict[str, Any] = {}
        size = 2
        is_part = hasattr(obj, 'part_kind')
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            old = getattr(obj, f.name)
            new, s = self.value(old, free_form=is_part and f.name in _FREE_FORM_FIELDS)
            size += len(f.name) + 4 + s
            if new is not old:
                changes[f.name] = new
        return (_replace(obj, **changes) if changes else obj), size

    def binary(self, content: BinaryContent) -> tuple[BinaryContent, int]:
        data = content.data
        if len(data) >= self.threshold_bytes:
            lean = self._reference(data, content.media_type).encode()
        elif data.startswith(_PREFIX_BYTES):
            lean = _PREFIX_BYTES + data
        else:
            return content, len(data) * 4 // 3 + 100
        # The identifier defaults to a hash of `data`: pin the original's, or the reference's
        # bytes would give the lean content (and, after JSON, the restored one) another identifier.
        return _replace(content, data=lean, identifier=content.identifier), 200

    def _maybe_json(self, lean: Any, size: int, free_form: bool) -> tuple[Any, int]:
        """A free-form list or dict still at or above the threshold moves as one JSON payload."""
        if not free_form or size < self.threshold_bytes or not _plain(lean):
            return lean, size
        data = json.dumps(lean, ensure_ascii=False, separators=(',', ':')).encode('utf-8', _UTF8_ERRORS)
        if len(data) < self.threshold_bytes:
            return lean, len(data)
        data = self._stored(data)
        uri = media_uri_for(data)
        self.uploads.setdefault((uri, JSON_MEDIA_TYPE), data)
        return REFERENCE_PREFIX + JSON_REFERENCE + uri, 90


def _plain(value: Any) -> bool:
    """Whether `value` is made of JSON values only (what `json.dumps` writes as Pydantic AI would)."""
    if value is None or type(value) in (str, int, bool):
        return True
    if type(value) is float:
        return value == value and value not in (float('inf'), float('-inf'))
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if type(value) is list or type(value) is tuple:
        return all(_plain(v) for v in value)
    return False


async def _gather(calls: Sequence[Any]) -> list[Any]:
    """Run the store calls at most `_MAX_CONCURRENT` at a time; raise the first failure."""
    limit = asyncio.Semaphore(_MAX_CONCURRENT)

    async def limited(call: Any) -> Any:
        async with limit:
            return await call

    results = await asyncio.gather(*(limited(c) for c in calls), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
