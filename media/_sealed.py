"""A media store that seals payloads with a conversation key (erasure by crypto-shredding).

The sealed bytes are what the inner store holds and addresses, so a sealed payload's URI is the
hash of its ciphertext: it says nothing about the plaintext, two conversations never share an
object (a fresh nonce each time), and deleting one conversation's media cannot touch another's.
See docs/decisions/0033-erasure-by-crypto-shredding.md.
"""

from __future__ import annotations

from collections.abc import Callable

from stepstream.erasure import ContentErased, ConversationKey, sealed_media_key_id
from stepstream.media._types import NO_CONTEXT, MediaContext, MediaStore

SEALED_CONTEXT = MediaContext(media_type='application/octet-stream')
"""Every sealed payload is stored as opaque bytes: its media type and name stay in the sealed message."""

KeyLookup = Callable[[str], ConversationKey | None]
"""`key_id -> key`, or None when the key was erased."""


class SealedMediaStore:
    """Stores sealed payloads as opaque bytes; opens what it gets with the key its bytes name.

    ```python
    lean = await externalize_media(tail, SealedMediaStore(store, lookup=keys.get), seal=key.seal_bytes)
    back = await restore_media(lean, SealedMediaStore(store, lookup=keys.get))
    ```

    The walker seals (`seal=`), so that a reference names the sealed bytes; `put` refuses a
    payload that is not sealed, so plaintext never reaches the bucket through it. A plain payload
    is returned by `get` as it is, so a reader reads media written before erasure was turned on.
    A payload whose key is gone raises `ContentErased`.
    """

    def __init__(self, inner: MediaStore, *, lookup: KeyLookup) -> None:
        """Wrap `inner`; `lookup` finds the key of a sealed payload."""
        self.inner = inner
        self.lookup = lookup

    async def put(self, data: bytes, ctx: MediaContext = NO_CONTEXT) -> str:
        """Store sealed bytes (opaque: no media type, no name); their URI is returned."""
        if sealed_media_key_id(data) is None:
            raise ValueError('a SealedMediaStore stores sealed payloads only (externalize_media(seal=...))')
        return await self.inner.put(data, SEALED_CONTEXT)

    async def get(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bytes:
        """The plaintext of `uri` (`ContentErased` when its key was destroyed)."""
        data = await self.inner.get(uri, SEALED_CONTEXT)
        key_id = sealed_media_key_id(data)
        if key_id is None:
            return data
        key = self.lookup(key_id)
        if key is None:
            raise ContentErased(f'the media payload {uri} was erased (its conversation key is gone)')
        return key.open_bytes(data)

    async def exists(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bool:
        """Whether the sealed payload is stored."""
        return await self.inner.exists(uri, SEALED_CONTEXT)

    async def public_url(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> str | None:
        """None: a URL would hand out ciphertext, so sealed media is only read through a reader."""
        return None

    async def get_metadata(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> MediaContext:
        """The opaque context every sealed payload is stored with."""
        return await self.inner.get_metadata(uri, SEALED_CONTEXT)
