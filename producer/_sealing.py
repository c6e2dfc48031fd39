"""The write half of erasure by crypto-shredding: seal a snapshot's content before it is appended.

Off by default: an `EventLog` has a `Sealer` only when `STEPSTREAM_ERASURE_KEY` is set, and the
capability's only cost without one is a `None` check per snapshot. With one, every snapshot's
message tail and patch are sealed with the data key of the run's conversation, and its offloaded
payloads are sealed before they reach the media store. See
docs/decisions/0033-erasure-by-crypto-shredding.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from pydantic_ai.messages import ModelMessage

from stepstream.erasure import ConversationKey, parse_kek
from stepstream.media import Offloaded, SealedMediaStore, offload_media
from stepstream.producer._snapshots import SnapshotPlan, SnapshotWriter
from stepstream.schemas import SnapshotDelta

SendKey = Callable[[bytes, bytes], Awaitable[None]]
"""`(record key, value)`: append a key record to the key topic and wait for the broker's ack."""

MAX_CACHED_KEYS = 4096
"""Conversations whose key a writer keeps in memory; an evicted one gets a new key when it next
writes (a conversation may have many keys: `forget` destroys them all)."""


class Sealer:
    """Makes one data key per conversation (per writer process) and seals snapshot deltas with it.

    A new key is appended to the key topic and acknowledged before anything sealed with it is
    appended, so a reader that sees a sealed record finds its key on the key topic (unless it was
    erased). Two writers of one conversation each make their own key; readers hold them all.
    """

    def __init__(self, erasure_key: str, send_key: SendKey) -> None:
        """Wrap data keys with `erasure_key` (the KEK setting) and append them with `send_key`."""
        self._kek = parse_kek(erasure_key)
        self._send_key = send_key
        self._keys: OrderedDict[str, ConversationKey] = OrderedDict()
        self._lock = asyncio.Lock()

    async def key_for(self, conversation_id: str) -> ConversationKey:
        """The key this writer seals `conversation_id` with, made and acknowledged on the key topic first."""
        key = self._keys.get(conversation_id)
        if key is None:
            async with self._lock:  # rare (once per conversation and process): one lock is enough
                key = self._keys.get(conversation_id)
                if key is None:
                    key = ConversationKey.new(conversation_id)
                    await self._send_key(key.record_key(), key.wrap(self._kek))
                    self._keys[conversation_id] = key
                    if len(self._keys) > MAX_CACHED_KEYS:
                        self._keys.popitem(last=False)
        self._keys.move_to_end(conversation_id)
        return key

    async def delta(
        self,
        writer: SnapshotWriter,
        plan: SnapshotPlan,
        snapshot_seq: int,
        *,
        conversation_id: str,
        run_id: str,
    ) -> SnapshotDelta:
        """`writer.delta(plan, snapshot_seq)` with its media and its content sealed for the conversation."""
        key = await self.key_for(conversation_id)
        assert writer.media_store is not None, 'sealing runs outside durable engines, with a store'
        store = SealedMediaStore(writer.media_store, lookup=lambda _: key)

        async def offload(tail: list[ModelMessage]) -> Offloaded:
            return await offload_media(tail, store, writer.threshold_bytes, seal=key.seal_bytes)

        delta = await writer.delta(plan, snapshot_seq, offload=offload)
        where = (run_id, str(snapshot_seq))
        return dataclasses.replace(
            delta,
            # The sealed payloads stay listed in clear (`delta.media`, the hashes of ciphertext, which
            # say nothing of the content); readers before schema v4 find them beside the ciphertext.
            messages=key.seal_text(delta.messages, *where, 'messages', refs=delta.media or ()),
            patch=None if delta.patch is None else key.seal_text(delta.patch, *where, 'patch'),
        )
