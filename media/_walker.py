"""Walkers that move large payloads of a message history into a `MediaStore` and back.

The reference representation (docs/decisions/0005-media-references.md): a payload is replaced,
in the very field that held it, by `REFERENCE_PREFIX + uri`, a `str` in a text field and its
UTF-8 bytes in `BinaryContent.data`. Every other field (media type, identifier, vendor metadata,
the part and message around it) stays as it was, so the lean history is still a valid history
that Pydantic AI's own JSON round trip preserves. The prefix starts with a NUL character, which
ordinary text does not; a value that does start with the prefix is escaped by doubling it, so
restoring never mistakes a user's value for a reference.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from pydantic_ai.messages import (
    AudioUrl,
    BaseToolReturnPart,
    BinaryContent,
    DocumentUrl,
    FilePart,
    FileUrl,
    ImageUrl,
    ModelMessage,
    SpeechPart,
    TextContent,
    TextPart,
    ThinkingPart,
    UserPromptPart,
    VideoUrl,
)

from stepstream.media._types import MediaContext, MediaStore, is_media_uri, media_uri_for

LinkFor = Callable[[str, str], Awaitable[str]]
"""`(uri, media_type) -> URL` at which a reader of a linked history fetches that payload."""

__all__ = ['DEFAULT_THRESHOLD_BYTES', 'REFERENCE_PREFIX', 'externalize_media', 'link_media', 'restore_media']

DEFAULT_THRESHOLD_BYTES = 64 * 1024
"""Payloads of at least this many bytes (UTF-8 for text) move to the media store."""

REFERENCE_PREFIX = '\x00stepstream:'
"""Starts every reference (`REFERENCE_PREFIX + 'media+sha256://<hex>'`) and every escaped value."""

TEXT_MEDIA_TYPE = 'text/plain; charset=utf-8'
"""The media type text payloads are stored with."""

_PREFIX_BYTES = REFERENCE_PREFIX.encode()
_MAX_CONCURRENT = 16
"""Store calls in flight per walker call: enough to overlap round trips, few enough for any S3."""
# Lone surrogates (text decoded with `surrogateescape`) must survive the trip too.
_UTF8_ERRORS = 'surrogatepass'

_T = TypeVar('_T')
_Key = tuple[str, str]
"""(uri, media type) of one store call: a custom key strategy may place a payload by media type."""


async def externalize_media(
    messages: Sequence[ModelMessage],
    store: MediaStore,
    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
) -> list[ModelMessage]:
    """Copies of `messages` whose payloads of `threshold_bytes` or more are references into `store`.

    Payloads are `BinaryContent.data` (in user prompts, tool returns, file and speech parts) and
    text: `TextPart`/`ThinkingPart` content, a string user prompt or tool return, and the strings
    and `TextContent` items of user prompt and tool return sequences. Every distinct payload is
    uploaded once, concurrently, and all uploads finish before this returns, so a record built
    from the result never refers to a missing object; if one fails, its error is raised
    (`MediaUnavailable` for an unreachable store) and nothing is returned.

    The input is not modified. A message, part or sequence with nothing to change is returned as
    the same object: a walk visits every part but copies only what changes.

    ```python
    lean = await externalize_media(messages, store)
    record = ModelMessagesTypeAdapter.dump_json(lean)       # small, whatever the attachments
    back = await restore_media(ModelMessagesTypeAdapter.validate_json(record), store)
    # `back` equals what the JSON round trip of `messages` itself gives
    ```
    """
    if isinstance(threshold_bytes, bool) or not isinstance(threshold_bytes, int) or threshold_bytes <= 0:
        raise ValueError(f'threshold_bytes must be a positive int, got {threshold_bytes!r}')
    externalizer = _Externalizer(threshold_bytes)
    lean = [_message(m, externalizer) for m in messages]
    if externalizer.uploads:

        async def upload(key: _Key, data: bytes) -> None:
            uri, media_type = key
            stored = await store.put(data, MediaContext(media_type=media_type))
            if stored != uri:
                raise ValueError(f'{store!r}.put returned {stored!r} for a payload whose URI is {uri}')

        await _gather([upload(key, data) for key, data in externalizer.uploads.items()])
    return lean


async def restore_media(messages: Sequence[ModelMessage], store: MediaStore) -> list[ModelMessage]:
    """Copies of `messages` with every reference `externalize_media` left replaced by its payload.

    The result equals the history that was externalized (`==`, including media types, identifiers
    and vendor metadata), also after the lean history went through Pydantic AI's JSON. Each
    distinct payload is fetched once, concurrently, and verified against its hash. Messages
    without references are returned as the same objects. Restore a history exactly once: a
    restored value that itself starts with `REFERENCE_PREFIX` would be read as escaped again.
    """
    collector = _Restorer(fetched=None)
    unescaped = [_message(m, collector) for m in messages]
    if not collector.wanted:
        return unescaped

    async def fetch(key: _Key) -> bytes:
        uri, media_type = key
        return await store.get(uri, MediaContext(media_type=media_type))

    keys = list(collector.wanted)
    fetched = dict(zip(keys, await _gather([fetch(key) for key in keys]), strict=True))
    restorer = _Restorer(fetched=fetched)
    return [_message(m, restorer) for m in messages]


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
    collector = _Linker(fetched=None, links={})
    for m in messages:
        _message(m, collector)
    keys = list(collector.wanted)
    fetched = dict(
        zip(
            keys,
            await _gather([store.get(uri, MediaContext(media_type=media_type)) for uri, media_type in keys]),
            strict=True,
        )
    )
    link_keys = list(collector.linked)
    links = dict(zip(link_keys, await _gather([link_for(*key) for key in link_keys]), strict=True))
    linker = _Linker(fetched=fetched, links=links)
    return [_message(m, linker) for m in messages]


# -- payload rules ------------------------------------------------------------------------------


class _Payloads:
    """What happens to one text or binary payload; the walk below decides where payloads are."""

    def text(self, value: str) -> str:
        raise NotImplementedError

    def binary(self, content: BinaryContent) -> BinaryContent:
        raise NotImplementedError

    def content_binary(self, content: BinaryContent) -> BinaryContent | FileUrl:
        """A binary item of a user prompt or tool return, where a URL part may stand instead."""
        return self.binary(content)


class _Externalizer(_Payloads):
    def __init__(self, threshold_bytes: int) -> None:
        self.threshold = threshold_bytes
        self.uploads: dict[_Key, bytes] = {}

    def _reference(self, data: bytes, media_type: str) -> str:
        uri = media_uri_for(data)
        self.uploads.setdefault((uri, media_type), data)
        return REFERENCE_PREFIX + uri

    def text(self, value: str) -> str:
        if len(value) * 4 >= self.threshold:  # below that no encoding can reach the threshold
            data = value.encode('utf-8', _UTF8_ERRORS)
            if len(data) >= self.threshold:
                return self._reference(data, TEXT_MEDIA_TYPE)
        return REFERENCE_PREFIX + value if value.startswith(REFERENCE_PREFIX) else value

    def binary(self, content: BinaryContent) -> BinaryContent:
        data = content.data
        if len(data) >= self.threshold:
            lean = self._reference(data, content.media_type).encode()
        elif data.startswith(_PREFIX_BYTES):
            lean = _PREFIX_BYTES + data
        else:
            return content
        # The identifier defaults to a hash of `data`: pin the original's, or the reference's
        # bytes would give the lean content (and, after JSON, the restored one) another identifier.
        return _replace(content, data=lean, identifier=content.identifier)


class _Restorer(_Payloads):
    """Puts the fetched payloads back, or with `fetched=None` only unescapes and collects references."""

    def __init__(self, fetched: dict[_Key, bytes] | None) -> None:
        self.fetched = fetched
        self.wanted: dict[_Key, None] = {}

    def _payload(self, uri: str, media_type: str) -> bytes | None:
        if self.fetched is None:
            self.wanted[uri, media_type] = None
            return None
        return self.fetched[uri, media_type]

    def text(self, value: str) -> str:
        if not value.startswith(REFERENCE_PREFIX):
            return value
        rest = value[len(REFERENCE_PREFIX) :]
        if rest.startswith(REFERENCE_PREFIX):  # escaped
            return rest
        if not is_media_uri(rest):
            return value
        data = self._payload(rest, TEXT_MEDIA_TYPE)
        return value if data is None else data.decode('utf-8', _UTF8_ERRORS)

    def binary(self, content: BinaryContent) -> BinaryContent:
        data = content.data
        if not data.startswith(_PREFIX_BYTES):
            return content
        rest = data[len(_PREFIX_BYTES) :]
        if rest.startswith(_PREFIX_BYTES):  # escaped
            original: bytes | None = rest
        else:
            uri = rest.decode('ascii', 'replace')
            original = self._payload(uri, content.media_type) if is_media_uri(uri) else None
        if original is None:
            return content
        # Leave the identifier implicit when the original's was (it is then the default one).
        identifier = content.identifier
        restored = _replace(content, data=original, identifier=None)
        return restored if restored.identifier == identifier else _replace(restored, identifier=identifier)


class _Linker(_Restorer):
    """Restores text and part-level binaries; turns content binaries into URL parts.

    With `fetched=None` it only collects what the second pass needs: payloads to fetch
    (`wanted`) and references to link (`linked`).
    """

    def __init__(self, fetched: dict[_Key, bytes] | None, links: dict[_Key, str]) -> None:
        super().__init__(fetched)
        self.links = links
        self.linked: dict[_Key, None] = {}

    def content_binary(self, content: BinaryContent) -> BinaryContent | FileUrl:
        data = content.data
        uri = data[len(_PREFIX_BYTES) :].decode('ascii', 'replace') if data.startswith(_PREFIX_BYTES) else ''
        if not is_media_uri(uri):
            return self.binary(content)  # inline, or an escaped value: unescape it
        key = (uri, content.media_type)
        if self.fetched is None:
            self.linked[key] = None
            return content
        url_part: type[FileUrl] = (
            ImageUrl
            if content.is_image
            else AudioUrl
            if content.is_audio
            else VideoUrl
            if content.is_video
            else DocumentUrl
        )
        return url_part(url=self.links[key], media_type=content.media_type, identifier=content.identifier)


# -- where payloads are -------------------------------------------------------------------------


def _message(message: ModelMessage, payloads: _Payloads) -> ModelMessage:
    parts = [_part(part, payloads) for part in message.parts]
    if all(new is old for new, old in zip(parts, message.parts, strict=True)):
        return message
    return _replace(message, parts=parts)


def _part(part: Any, payloads: _Payloads) -> Any:
    if isinstance(part, TextPart | ThinkingPart):
        content: Any = payloads.text(part.content)
    elif isinstance(part, UserPromptPart | BaseToolReturnPart):
        content = _content(part.content, payloads)
    elif isinstance(part, FilePart):
        content = payloads.binary(part.content)
    elif isinstance(part, SpeechPart):
        if part.audio is None:
            return part
        audio = payloads.binary(part.audio)
        return part if audio is part.audio else _replace(part, audio=audio)
    else:
        return part
    return part if content is part.content else _replace(part, content=content)


def _content(content: Any, payloads: _Payloads) -> Any:
    """A user prompt's or tool return's content: a payload itself, or a list or tuple of items."""
    if isinstance(content, list | tuple):
        items = [_item(item, payloads) for item in content]
        if all(new is old for new, old in zip(items, content, strict=True)):
            return content
        return type(content)(items)
    return _item(content, payloads)


def _item(item: Any, payloads: _Payloads) -> Any:
    if isinstance(item, str):
        return payloads.text(item)
    if isinstance(item, BinaryContent):
        return payloads.content_binary(item)
    if type(item) is TextContent:  # not StructuredContent, whose text is rendered from its value
        text = payloads.text(item.content)
        return item if text is item.content else _replace(item, content=text)
    if type(item) is dict and item.get('kind') == 'text-content' and isinstance(item.get('content'), str):
        # A `TextContent` in a tool return comes back from JSON as this dict: the same payload.
        text = payloads.text(item['content'])
        return item if text is item['content'] else {**item, 'content': text}
    return item


def _replace(obj: _T, **changes: Any) -> _T:
    # `identifier` is the init alias of BinaryContent's `_identifier` field: passed by that name
    # or the pydantic dataclass ignores it. Typed as Any because it is not a declared field name.
    replace: Any = dataclasses.replace
    result: _T = replace(obj, **changes)
    return result


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
