"""`MediaExternalizer`: large media goes to the model as a URL, not as bytes in every request.

A model request carries the whole history, so an image a user sent at the first step crosses the
wire again at every later step, base64-encoded. With this capability, each `BinaryContent` of at
least `threshold_bytes` in a request is uploaded once to a `MediaStore` and sent as the URL the
store's `public_url` resolver gives (`ImageUrl`, `AudioUrl`, `VideoUrl` or `DocumentUrl` by media
type); the provider fetches it from there.

Only the request changes, never the run's history: `result.all_messages()`, and what
`StepPersistence` records, still hold the `BinaryContent`, so a continued run is given the same
history the first one had. With the same store for both, the bytes are stored once: the store is
content-addressed, and the snapshot's offload finds the object already there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import (
    AudioUrl,
    BinaryContent,
    DocumentUrl,
    FileUrl,
    ImageUrl,
    ModelMessage,
    ModelRequest,
    ModelRequestPart,
    ToolReturnPart,
    UserPromptPart,
    VideoUrl,
)
from pydantic_ai.models import ModelRequestContext
from pydantic_ai.tools import AgentDepsT, RunContext

from stepstream.errors import MediaUnavailable
from stepstream.media._types import MediaContext, MediaStore, media_uri_off_loop
from stepstream.media._walker import DEFAULT_THRESHOLD_BYTES
from stepstream.settings import MediaSettings

__all__ = ['MediaExternalizer']

logger = logging.getLogger('stepstream.media')


@dataclass
class MediaExternalizer(AbstractCapability[AgentDepsT]):
    """Send large `BinaryContent` to the model as a public URL of the media store (off by default).

    ```python
    store = S3MediaStore.from_settings(settings.media, public_url=make_static_public_url('https://cdn.example.com'))
    agent = Agent(model, capabilities=[StepPersistence(log=log, media_store=store), MediaExternalizer(store)])
    await agent.run(['what is in this picture?', BinaryContent(png, media_type='image/png')])
    # the model receives ImageUrl('https://cdn.example.com/<sha256>.bin', media_type='image/png')
    ```

    The URL must be one the model provider can fetch: a public bucket or CDN
    (`make_static_public_url`), or presigned URLs from a resolver of your own. Images, audio, video
    and documents are swapped; other media types (JSON, plain text, unknown types) stay inline,
    because a provider takes them as text, not as a file URL. Some providers do not take URLs of
    some kinds (Pydantic AI then downloads the URL and sends the bytes itself; see its input docs).

    When the store has no URL for a payload (no `public_url=` resolver, or it returned None) or is
    unreachable (`MediaUnavailable`), the payload stays inline and a warning says why: the request
    is heavier, but the run goes on as it would without this capability.
    """

    store: MediaStore
    """Where payloads are uploaded; its `public_url` gives the URL the model receives."""

    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES
    """`BinaryContent` of at least this many bytes is sent as a URL; smaller stays inline."""

    # Per-run state, fresh in every `for_run` copy.
    _parts: dict[int, tuple[BinaryContent, FileUrl | None]] = field(
        default_factory=dict, init=False, repr=False
    )
    """`id(content)` -> (the content, its URL part, or None to stay inline): each content object is
    hashed once per run, however many requests carry it. The content is held so that its id
    cannot be reused by another object while the run lasts."""
    _urls: dict[tuple[str, str], str | None] = field(default_factory=dict, init=False, repr=False)
    """(uri, media type) -> the store's URL: the same bytes in another object are not uploaded again."""
    _warned: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        MediaSettings.check_threshold(self.threshold_bytes, 'threshold_bytes')
        if not isinstance(self.store, MediaStore):
            raise TypeError(
                f'MediaExternalizer(store=...) needs a MediaStore, got {type(self.store).__name__}'
            )

    async def for_run(self, ctx: RunContext[AgentDepsT]) -> AbstractCapability[AgentDepsT]:
        """A copy for this run, with its own record of what it uploaded."""
        return replace(self)

    async def before_model_request(
        self, ctx: RunContext[AgentDepsT], request_context: ModelRequestContext
    ) -> ModelRequestContext:
        """Swap each large `BinaryContent` of the request for its URL part; the history keeps the bytes.

        Messages and parts that change are copied (the request's list is its own, but its
        messages are the history's objects); everything else is passed as it is.
        """
        large = [
            c for m in request_context.messages for c in _binaries(m) if len(c.data) >= self.threshold_bytes
        ]
        if not large:
            return request_context
        new = {id(c): c for c in large if self._parts.get(id(c), (None,))[0] is not c}
        if new:
            await self._resolve(list(new.values()))
        messages = [_swapped(m, self._parts) for m in request_context.messages]
        return replace(request_context, messages=messages)

    async def _resolve(self, contents: list[BinaryContent]) -> None:
        """Upload the payloads of `contents` not uploaded yet (concurrently) and record their URL parts."""
        urlable = [c for c in contents if _url_type(c) is not None]
        uris = await asyncio.gather(*(media_uri_off_loop(c.data) for c in urlable))
        keys = [(uri, c.media_type) for uri, c in zip(uris, urlable, strict=True)]
        missing = {
            key: data
            for key, data in zip(keys, (c.data for c in urlable), strict=True)
            if key not in self._urls
        }
        found = await asyncio.gather(*(self._upload(data, *key) for key, data in missing.items()))
        self._urls.update(zip(missing, found, strict=True))
        for content in contents:
            self._parts[id(content)] = (content, None)
        for content, key in zip(urlable, keys, strict=True):
            url, url_type = self._urls[key], _url_type(content)
            if url is not None and url_type is not None:
                part = url_type(
                    url,
                    media_type=content.media_type,
                    identifier=content.identifier,
                    vendor_metadata=content.vendor_metadata,
                )
                self._parts[id(content)] = (content, part)

    async def _upload(self, data: bytes, uri: str, media_type: str) -> str | None:
        """Put `data` in the store and return its public URL; None (stay inline) when there is none."""
        ctx = MediaContext(media_type=media_type)
        try:
            stored = await self.store.put(data, ctx)
            url = await self.store.public_url(stored, ctx)
        except MediaUnavailable as exc:
            self._warn(f'could not upload it ({exc})')
            return None
        if url is None:
            self._warn(f'{self.store!r} has no public URL for it; give the store a public_url= resolver')
        return url

    def _warn(self, why: str) -> None:
        if not self._warned:  # once per run: the same cause holds for every payload
            self._warned = True
            logger.warning('stepstream MediaExternalizer: media sent inline to the model: %s', why)


def _url_type(content: BinaryContent) -> type[FileUrl] | None:
    """The URL part for this media type, or None for media a provider takes as text."""
    if content.is_image:
        return ImageUrl
    if content.is_audio:
        return AudioUrl
    if content.is_video:
        return VideoUrl
    if content.is_document:
        return DocumentUrl
    return None


def _binaries(message: ModelMessage) -> list[BinaryContent]:
    """Every `BinaryContent` a model can receive in `message`: user prompts and tool returns."""
    if not isinstance(message, ModelRequest):
        return []  # a response's files are the model's own output, sent back as they came
    found: list[BinaryContent] = []
    for part in message.parts:
        if isinstance(part, UserPromptPart | ToolReturnPart):
            _collect(part.content, found)
    return found


def _collect(value: Any, found: list[BinaryContent]) -> None:
    if isinstance(value, BinaryContent):
        found.append(value)
    elif isinstance(value, list | tuple):
        for item in value:
            _collect(item, found)
    elif isinstance(value, Mapping):
        for item in value.values():
            _collect(item, found)


def _swapped(message: ModelMessage, urls: dict[int, tuple[BinaryContent, FileUrl | None]]) -> ModelMessage:
    if not isinstance(message, ModelRequest):
        return message
    parts: list[ModelRequestPart] = []
    for part in message.parts:
        if isinstance(part, UserPromptPart | ToolReturnPart):
            content = _swap(part.content, urls)
            if content is not part.content:
                part = replace(part, content=content)
        parts.append(part)
    if all(new is old for new, old in zip(parts, message.parts, strict=True)):
        return message
    return replace(message, parts=parts)


def _swap(value: Any, urls: dict[int, tuple[BinaryContent, FileUrl | None]]) -> Any:
    """`value` with known large contents replaced by their URL parts; the same object if none is."""
    if isinstance(value, BinaryContent):
        known = urls.get(id(value))
        return known[1] if known is not None and known[0] is value and known[1] is not None else value
    if isinstance(value, list | tuple):
        items = [_swap(item, urls) for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        entries = {key: _swap(item, urls) for key, item in value.items()}
        if all(entries[key] is item for key, item in value.items()):
            return value
        return entries
    return value
