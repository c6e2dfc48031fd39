"""The way back of the walkers in `_walker.py`: references to payloads, or to links.

`_Restorer` puts fetched payloads back where `_walker._Externalizer` left references (and
unescapes values that only looked like one); `_Linker` instead turns an offloaded binary of a user
prompt or tool return into a URL part. Neither fetches: each records the references it has no
payload (or link) for yet, and `restore_media`, `media_read` and `link_media` fetch those and walk
again. The representation they read, and share with the way out, is defined here too.
"""

# No `from __future__ import annotations`, like `_walker.py` (whose `Offloaded` needs it so).

import dataclasses
import json
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic_ai.messages import (
    AudioUrl,
    BinaryContent,
    DocumentUrl,
    FilePart,
    FileUrl,
    ImageUrl,
    ModelMessage,
    SpeechPart,
    VideoUrl,
)

from stepstream.media._types import JSON_REFERENCE, REFERENCE_PREFIX, is_media_uri

TEXT_MEDIA_TYPE = 'text/plain; charset=utf-8'
"""The media type text payloads (and bytes that are not `BinaryContent`) are stored with."""

JSON_MEDIA_TYPE = 'application/json'
"""The media type of a list or dict moved as one payload."""

_PREFIX_BYTES = REFERENCE_PREFIX.encode()
# Lone surrogates (text decoded with `surrogateescape`) must survive the trip too.
_UTF8_ERRORS = 'surrogatepass'

_T = TypeVar('_T')
_Key = tuple[str, str]
"""(uri, media type) of one store call: a custom key strategy may place a payload by media type."""


# -- in: references to payloads -----------------------------------------------------------------


class _Restorer:
    """Puts fetched payloads back and unescapes; records in `wanted` the references not fetched yet."""

    def __init__(self, fetched: dict[_Key, bytes]) -> None:
        self.fetched = fetched
        self.wanted: dict[_Key, None] = {}

    def messages(self, messages: Sequence[ModelMessage]) -> list[ModelMessage]:
        return [self.value(m) for m in messages]

    def _payload(self, uri: str, media_type: str) -> bytes | None:
        data = self.fetched.get((uri, media_type))
        if data is None:
            self.wanted[uri, media_type] = None
        return data

    def text(self, value: str) -> Any:
        if not value.startswith(REFERENCE_PREFIX):
            return value
        rest = value[len(REFERENCE_PREFIX) :]
        if rest.startswith(REFERENCE_PREFIX):  # escaped
            return rest
        if rest.startswith(JSON_REFERENCE) and is_media_uri(rest[len(JSON_REFERENCE) :]):
            data = self._payload(rest[len(JSON_REFERENCE) :], JSON_MEDIA_TYPE)
            return value if data is None else self.value(json.loads(data.decode('utf-8', _UTF8_ERRORS)))
        if not is_media_uri(rest):
            return value
        data = self._payload(rest, TEXT_MEDIA_TYPE)
        return value if data is None else data.decode('utf-8', _UTF8_ERRORS)

    def value(self, value: Any, *, linkable: bool = True) -> Any:
        """`linkable`: a binary here may become a URL part (not a file or speech part's own field)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, BinaryContent):
            return self.content_binary(value) if linkable else self.binary(value)
        if type(value) is dict:
            items = {k: self.value(v) for k, v in value.items()}
            return value if all(items[k] is v for k, v in value.items()) else items
        if type(value) is list or type(value) is tuple:
            entries = [self.value(v) for v in value]
            return value if all(a is b for a, b in zip(entries, value, strict=True)) else type(value)(entries)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {}
            linkable = not isinstance(value, FilePart | SpeechPart)
            for f in dataclasses.fields(value):
                if f.init:
                    old = getattr(value, f.name)
                    new = self.value(old, linkable=linkable)
                    if new is not old:
                        changes[f.name] = new
            return _replace(value, **changes) if changes else value
        return value

    def content_binary(self, content: BinaryContent) -> BinaryContent | FileUrl:
        """A binary item of a user prompt or tool return, where a URL part may stand instead."""
        return self.binary(content)

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

    References it has no link for yet are collected in `linked`, as missing payloads are in `wanted`.
    """

    def __init__(self, fetched: dict[_Key, bytes], links: dict[_Key, str]) -> None:
        super().__init__(fetched)
        self.links = links
        self.linked: dict[_Key, None] = {}

    def content_binary(self, content: BinaryContent) -> BinaryContent | FileUrl:
        data = content.data
        uri = data[len(_PREFIX_BYTES) :].decode('ascii', 'replace') if data.startswith(_PREFIX_BYTES) else ''
        if not is_media_uri(uri):
            return self.binary(content)  # inline, or an escaped value: unescape it
        key = (uri, content.media_type)
        link = self.links.get(key)
        if link is None:
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
        return url_part(url=link, media_type=content.media_type, identifier=content.identifier)


def _replace(obj: _T, **changes: Any) -> _T:
    # `identifier` is the init alias of BinaryContent's `_identifier` field: passed by that name
    # or the pydantic dataclass ignores it. Typed as Any because it is not a declared field name.
    replace: Any = dataclasses.replace
    result: _T = replace(obj, **changes)
    return result
