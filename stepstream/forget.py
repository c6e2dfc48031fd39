"""`stepstream forget`: erase a conversation's content by destroying its keys (crypto-shredding).

The log is not rewritten. Forgetting a conversation:

1. reads the key topic and the projection, and collects the media its sealed snapshots refer to
   (those payloads are sealed with the conversation's keys, so no other conversation uses them);
2. appends a tombstone for every key of the conversation (acknowledged by the broker), which every
   reader honours at its next read, and which compaction later turns into the key's absence;
3. deletes the collected media objects.

See docs/decisions/0033-erasure-by-crypto-shredding.md for what holds on which broker.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stepstream.erasure import KeyRing, is_sealed_text, key_topic, open_snapshot
from stepstream.errors import StepStreamError
from stepstream.media._types import media_uris_in

if TYPE_CHECKING:
    from stepstream.media import MediaStore
    from stepstream.projector import ProjectionReader
    from stepstream.settings import Settings


@dataclass(kw_only=True)
class ForgetReport:
    """What `forget_conversation` did."""

    conversation_id: str
    keys_destroyed: list[str] = field(default_factory=list)
    """The key ids tombstoned on the key topic."""
    runs: list[str] = field(default_factory=list)
    """The conversation's runs in the projection: their structure stays, their content is gone."""
    media_deleted: list[str] = field(default_factory=list)
    """The sealed payloads deleted from the media store."""


async def forget_conversation(
    settings: Settings, conversation_id: str, *, reader: ProjectionReader, media_store: MediaStore
) -> ForgetReport:
    """Destroy every key of `conversation_id` and delete its sealed media.

    `reader` is a projection of the log (its media references are read before the keys go);
    `media_store` the store the writers offloaded to.

    ```python
    report = await forget_conversation(settings, 'conv-1', reader=reader, media_store=store)
    ```
    """
    if settings.erasure_key is None:
        raise StepStreamError(
            'erasure is off (STEPSTREAM_ERASURE_KEY is unset): nothing of this log is sealed, so nothing '
            'can be forgotten without rewriting it'
        )
    report = ForgetReport(conversation_id=conversation_id)
    async with KeyRing(settings) as keys:
        await keys.refresh()
        owned = reader.keys
        reader.keys = keys  # the media references are read with the keys, before they go
        try:
            uris = await _sealed_media(reader, conversation_id, keys, report)
        finally:
            reader.keys = owned
        doomed = keys.of_conversation(conversation_id)
        await _tombstone(settings, [k.record_key() for k in doomed])
        report.keys_destroyed = sorted(k.key_id for k in doomed)
    for uri in sorted(uris):
        if await _delete(media_store, uri):
            report.media_deleted.append(uri)
    return report


async def _sealed_media(
    reader: ProjectionReader, conversation_id: str, keys: KeyRing, report: ForgetReport
) -> set[str]:
    """The media references in the conversation's sealed snapshots (only sealed ones: unshared)."""
    runs = await reader.list_runs(conversation_id=conversation_id)
    alone = await reader.get_run(conversation_id)  # a run with no conversation id is its own
    if alone is not None and alone.conversation_id is None:
        runs.append(alone)
    uris: set[str] = set()
    for run in runs:
        report.runs.append(run.run_id)
        for event in await reader.list_events(run.run_id):
            if event.snapshot is None:
                continue
            if not is_sealed_text(event.snapshot.messages):
                continue  # written before erasure was on: its media may be shared, it stays
            opened = open_snapshot(event.snapshot, run_id=run.run_id, keys=keys)
            if opened is None:
                continue  # erased already
            uris.update(media_uris_in(json.dumps(opened)))
    return uris


async def _tombstone(settings: Settings, record_keys: list[bytes]) -> None:
    """Append a tombstone for each key record and wait until the broker acknowledged them all."""
    if not record_keys:
        return
    from aiokafka import AIOKafkaProducer

    from stepstream.kafka_client import client_options

    producer = AIOKafkaProducer(**client_options(settings), acks='all', client_id='stepstream-forget')
    await asyncio.wait_for(producer.start(), settings.ack_timeout_s)
    try:
        topic = key_topic(settings)
        async with asyncio.timeout(settings.ack_timeout_s):
            sent = [await producer.send(topic, None, key=key) for key in record_keys]
            await asyncio.gather(*sent)
    finally:
        await producer.stop()


async def _delete(store: MediaStore, uri: str) -> bool:
    """Delete one payload from an S3 or disk store; False when it was not there."""
    from stepstream.media import DiskMediaStore, S3MediaStore

    if isinstance(store, S3MediaStore):
        if not await store.exists(uri):
            return False
        await store.delete(uri)
        return True
    if isinstance(store, DiskMediaStore):
        path = store.path_for(uri)
        existed = path.exists()
        path.unlink(missing_ok=True)
        return existed
    raise StepStreamError(
        f'cannot delete media from a {type(store).__name__}: forget supports S3 and disk stores'
    )
