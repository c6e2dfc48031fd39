"""`stepstream forget`: erase a conversation's content by destroying its keys (crypto-shredding).

The log is not rewritten. Forgetting a conversation:

1. reads the key topic and the projection, and collects the media the conversation's snapshot
   records need (`snapshot_media`: what each record lists, never found by reading its content);
2. appends a tombstone for every key of the conversation (acknowledged by the broker), which every
   reader honours at its next read, and which compaction later turns into the key's absence;
3. deletes each collected object that is sealed with one of those keys: no other conversation can
   read it. An object that is not (plain, written before erasure was on, so maybe shared by
   content addressing; or sealed for another conversation, named by a record that had no business
   naming it) stays, and the report says why, as it says each object it deleted.

See docs/decisions/0033-erasure-by-crypto-shredding.md for what holds on which broker.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stepstream.erasure import KeyRing, key_topic, sealed_media_key_id
from stepstream.errors import StepStreamError
from stepstream.media import NO_CONTEXT, MediaNotFound, snapshot_media

if TYPE_CHECKING:
    from stepstream.media import MediaStore
    from stepstream.readmodel import ProjectionReader
    from stepstream.settings import KafkaSettings, Settings


@dataclass(kw_only=True)
class ForgetReport:
    """What `forget_conversation` did."""

    conversation_id: str
    keys_destroyed: list[str] = field(default_factory=list)
    """The key ids tombstoned on the key topic."""
    runs: list[str] = field(default_factory=list)
    """The conversation's runs in the projection: their structure stays, their content is gone."""
    media_deleted: list[str] = field(default_factory=list)
    """The payloads deleted from the media store (each sealed with one of the destroyed keys)."""
    media_kept: dict[str, str] = field(default_factory=dict)
    """The conversation's payloads not deleted, each with the reason (not sealed, sealed with
    another conversation's key, already gone, or the store's error)."""

    @property
    def failed(self) -> bool:
        """Whether deleting a payload that should go failed (the store's error is in `media_kept`)."""
        return any(reason.startswith(DELETE_FAILED) for reason in self.media_kept.values())


DELETE_FAILED = 'could not be deleted'
NOT_SEALED = 'not sealed (written before erasure was on; other conversations may share it)'
OTHER_KEY = "sealed with a key that is not this conversation's"
GONE = 'not in the media store (deleted already)'


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
    if settings.security.erasure_key is None:
        raise StepStreamError(
            'erasure is off (STEPSTREAM_ERASURE_KEY is unset): nothing of this log is sealed, so nothing '
            'can be forgotten without rewriting it'
        )
    report = ForgetReport(conversation_id=conversation_id)
    uris = await _conversation_media(reader, conversation_id, report)
    async with KeyRing(settings) as keys:
        await keys.refresh(thorough=True)  # every key of the conversation, or one would survive
        doomed = keys.of_conversation(conversation_id)
        await _tombstone(settings.kafka, key_topic(settings.topics), [k.record_key() for k in doomed])
        report.keys_destroyed = sorted(k.key_id for k in doomed)
    destroyed = set(report.keys_destroyed)
    for uri in sorted(uris):
        reason = await _delete_sealed(media_store, uri, destroyed)
        if reason is None:
            report.media_deleted.append(uri)
        else:
            report.media_kept[uri] = reason
    return report


async def _conversation_media(
    reader: ProjectionReader, conversation_id: str, report: ForgetReport
) -> set[str]:
    """Every payload the conversation's snapshot records list (`snapshot_media`), erased or not."""
    runs = await reader.list_runs(conversation_id=conversation_id)
    alone = await reader.get_run(conversation_id)  # a run with no conversation id is its own
    if alone is not None and alone.conversation_id is None:
        runs.append(alone)
    uris: set[str] = set()
    for run in runs:
        report.runs.append(run.run_id)
        for event in await reader.list_events(run.run_id):
            if event.snapshot is not None:
                uris |= snapshot_media(event.snapshot.messages, event.snapshot.media)
    return uris


async def _delete_sealed(store: MediaStore, uri: str, key_ids: set[str]) -> str | None:
    """Delete `uri` if it is sealed with one of `key_ids`; else why it stays."""
    try:
        data = await store.get(uri, NO_CONTEXT)
    except MediaNotFound:
        return GONE
    except Exception as exc:  # the store's own error, reported with the payload it concerns
        return f'{DELETE_FAILED}: {exc}'
    key_id = sealed_media_key_id(data)
    if key_id is None:
        return NOT_SEALED
    if key_id not in key_ids:
        return OTHER_KEY
    try:
        await _delete(store, uri)
    except StepStreamError:
        raise  # a store forget cannot delete from: the caller's configuration
    except Exception as exc:
        return f'{DELETE_FAILED}: {exc}'
    return None


async def _tombstone(kafka: KafkaSettings, topic: str, record_keys: list[bytes]) -> None:
    """Append a tombstone for each key record and wait until the broker acknowledged them all."""
    if not record_keys:
        return
    from aiokafka import AIOKafkaProducer

    from stepstream.kafka_client import client_options

    producer = AIOKafkaProducer(**client_options(kafka), acks='all', client_id='stepstream-forget')
    await asyncio.wait_for(producer.start(), kafka.ack_timeout_s)
    try:
        async with asyncio.timeout(kafka.ack_timeout_s):
            sent = [await producer.send(topic, None, key=key) for key in record_keys]
            await asyncio.gather(*sent)
    finally:
        await producer.stop()


async def _delete(store: MediaStore, uri: str) -> None:
    """Delete one payload from an S3 or disk store."""
    from stepstream.media import DiskMediaStore, S3MediaStore

    if isinstance(store, S3MediaStore):
        await store.delete(uri)
        return
    if isinstance(store, DiskMediaStore):
        store.path_for(uri).unlink(missing_ok=True)
        return
    raise StepStreamError(
        f'cannot delete media from a {type(store).__name__}: forget supports S3 and disk stores'
    )
