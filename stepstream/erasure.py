"""Erasure by crypto-shredding: per-conversation data keys, sealed content, and the key topic.

With erasure on (`STEPSTREAM_ERASURE_KEY` set), a writer seals the content of a snapshot (its
message tail and patch) and every payload it offloads with AES-256-GCM under a data key of the
run's conversation; the structure of the trail (runs, seqs, kinds, tool names, statuses, times,
usage) stays plaintext. Data keys live only on the compacted topic `{prefix}.conversation-keys`,
each wrapped with the key-encryption key from settings, and in the memory of the processes that
read them (`KeyRing`): never in a projection shard, so never in a checkpoint. `stepstream forget`
appends a tombstone for each key of the conversation; from then on no reader finds the key and the
content reads as erased. See docs/decisions/0033-erasure-by-crypto-shredding.md for what holds on
which broker.

Formats (both versioned by their first element):

- a sealed text field (`SnapshotDelta.messages`, `.patch`, a `conversation_marked` title, a deferred
  call's `args` and `deferral_metadata`, a decision's `args`, `result` and `error`) is the JSON list
  `["stepstream-sealed/1", "<key id, 32 hex>", "<base64 of nonce ‖ ciphertext ‖ tag>", *refs]`, with
  the conversation, run, snapshot and field name as associated data, so that a sealed value cannot
  be moved to another record; `refs` are the media URIs the plaintext names, in clear: each is the
  hash of a sealed payload (it says nothing of the content), and the projection's media index
  (retention's sweep, decision 0032) reads them where it cannot read the content;
- a sealed media payload is `SEALED_MEDIA_MAGIC ‖ key id (16 bytes) ‖ nonce ‖ ciphertext ‖ tag`,
  with the conversation as associated data; its content address is the hash of those bytes.
- a key record has key `key id (32 hex) ‖ conversation id (UTF-8)` and a JSON value
  `{"v": 1, "conversation_id", "key_id", "wrapped": base64(nonce ‖ AES-GCM(KEK, data key))}`; a
  tombstone (null value) destroys it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stepstream.errors import StepStreamError
from stepstream.kek import parse_kek

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

    from stepstream.schemas import SnapshotDelta
    from stepstream.settings import Settings, TopicSettings

KEY_BYTES = 32
"""AES-256: the size of a data key and of the key-encryption key."""
NONCE_BYTES = 12
SEALED_TEXT_MARK = 'stepstream-sealed/1'
_SEALED_TEXT_PREFIX = '["' + SEALED_TEXT_MARK + '"'
SEALED_MEDIA_MAGIC = b'\x00stepstream-sealed/1\x00'
SEALED_TITLE = 'title'
"""What a sealed conversation title (`conversation_marked`) is bound to, beside its conversation."""
SEALED_CALL_ARGS, SEALED_CALL_METADATA = 'call.args', 'call.metadata'
SEALED_DECISION_ARGS, SEALED_DECISION_RESULT, SEALED_DECISION_ERROR = (
    'decision.args',
    'decision.result',
    'decision.error',
)
"""What a deferred call's `args` and `deferral_metadata`, and a decision's `args`, `result` and message
(`error`) are bound to, after their run and tool call, beside their conversation."""
MAX_SEALED_TITLE_CHARS = 2048
"""The longest sealed title the projector takes: a title of `MAX_TITLE_CHARS` characters, sealed."""
KEY_TOPIC_CONFIGS = {
    'cleanup.policy': 'compact',
    'retention.ms': '-1',
    'min.compaction.lag.ms': '0',
    'delete.retention.ms': '60000',
    'segment.ms': '600000',
    'min.cleanable.dirty.ratio': '0.01',
}
"""The key topic keeps a key until it is tombstoned; compaction then drops the key record within
about `segment.ms` + `delete.retention.ms` on Apache Kafka (the active segment is never compacted)."""


class ErasureError(StepStreamError):
    """Sealed content that cannot be opened for another reason than an erased key."""


class ContentErased(StepStreamError):
    """The content asked for was erased (`stepstream forget`): its key no longer exists."""


def key_topic(topics: TopicSettings) -> str:
    """The compacted topic of the conversation keys: `{prefix}.conversation-keys`."""
    return f'{topics.topic_prefix}.conversation-keys'


def new_kek() -> str:
    """A fresh key-encryption key, as the `STEPSTREAM_ERASURE_KEY` setting takes it."""
    return base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).decode()


def _aesgcm(key: bytes) -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise StepStreamError(
            "erasure needs the 'cryptography' package: pip install 'stepstream[erasure]'"
        ) from exc
    return AESGCM(key)


@dataclass(frozen=True, slots=True)
class ConversationKey:
    """One data key of one conversation (a writer makes its own: see the decision)."""

    conversation_id: str
    key_id: str
    """32 hex digits, random: unique without coordination."""
    material: bytes = field(repr=False)
    _cipher: Any = field(init=False, repr=False, compare=False)
    """The AES-GCM of `material`, made once: it lives and goes with the key."""

    def __post_init__(self) -> None:
        object.__setattr__(self, '_cipher', _aesgcm(self.material))

    @classmethod
    def new(cls, conversation_id: str) -> ConversationKey:
        """A fresh random key for `conversation_id`."""
        return cls(conversation_id, os.urandom(16).hex(), os.urandom(KEY_BYTES))

    # -- key records ---------------------------------------------------------------------------

    def record_key(self) -> bytes:
        """The Kafka key of this key's record: key id first (fixed length), then the conversation."""
        return record_key(self.conversation_id, self.key_id)

    def wrap(self, kek: bytes) -> bytes:
        """The key record's value: the data key encrypted with the key-encryption key."""
        nonce = os.urandom(NONCE_BYTES)
        wrapped = nonce + _aesgcm(kek).encrypt(nonce, self.material, self.record_key())
        value = {
            'v': 1,
            'conversation_id': self.conversation_id,
            'key_id': self.key_id,
            'wrapped': base64.b64encode(wrapped).decode(),
        }
        return json.dumps(value, separators=(',', ':')).encode()

    @classmethod
    def unwrap(cls, key: bytes, value: bytes, kek: bytes) -> ConversationKey:
        """Read a key record (`ErasureError` if it is not one, or the KEK is not the one that wrapped it)."""
        from cryptography.exceptions import InvalidTag

        try:
            doc = json.loads(value)
            conversation_id, key_id = doc['conversation_id'], doc['key_id']
            if doc['v'] != 1 or record_key(conversation_id, key_id) != key:
                raise ValueError('the record key does not match its value')
            wrapped = base64.b64decode(doc['wrapped'], validate=True)
            material = _aesgcm(kek).decrypt(wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], key)
        except InvalidTag:
            raise ErasureError(
                f'the key record {key[:32].decode(errors="replace")} was wrapped with another '
                'STEPSTREAM_ERASURE_KEY: set the one its writers use'
            ) from None
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise ErasureError(f'not a conversation key record: {exc}') from None
        return cls(conversation_id, key_id, material)

    # -- sealing ---------------------------------------------------------------------------------

    def seal_text(self, text: str, *context: str, refs: Iterable[str] = ()) -> str:
        """`text` sealed as a JSON list a reader recognises (`is_sealed_text`); `context` binds it.

        `refs` (media URIs of sealed payloads that `text` names) follow the sealed body in clear.
        """
        nonce = os.urandom(NONCE_BYTES)
        body = nonce + self._cipher.encrypt(nonce, text.encode(), self._aad(context))
        # A JSON list; neither the hex key id, base64 nor a media URI needs escaping.
        clear = ''.join(f',"{ref}"' for ref in refs)
        return f'["{SEALED_TEXT_MARK}","{self.key_id}","{base64.b64encode(body).decode()}"{clear}]'

    def open_text(self, sealed: str, *context: str) -> str:
        """The plaintext of `seal_text(text, *context)`; `ErasureError` if it was not sealed so."""
        from cryptography.exceptions import InvalidTag

        key_id, body = split_sealed_text(sealed)
        if key_id != self.key_id:
            raise ErasureError(f'sealed with key {key_id}, not {self.key_id}')
        try:
            return str(
                self._cipher.decrypt(body[:NONCE_BYTES], body[NONCE_BYTES:], self._aad(context)).decode()
            )
        except InvalidTag:
            raise ErasureError('sealed content does not open with its key: it was altered or moved') from None

    def seal_bytes(self, data: bytes) -> bytes:
        """A media payload sealed for this conversation (a fresh nonce: equal payloads differ)."""
        nonce = os.urandom(NONCE_BYTES)
        ciphertext = self._cipher.encrypt(nonce, data, self._aad(()))
        return SEALED_MEDIA_MAGIC + bytes.fromhex(self.key_id) + nonce + ciphertext

    def open_bytes(self, sealed: bytes) -> bytes:
        """The payload `seal_bytes` sealed."""
        from cryptography.exceptions import InvalidTag

        key_id = sealed_media_key_id(sealed)
        if key_id != self.key_id:
            raise ErasureError(f'media sealed with key {key_id}, not {self.key_id}')
        start = len(SEALED_MEDIA_MAGIC) + 16
        try:
            return bytes(
                self._cipher.decrypt(
                    sealed[start : start + NONCE_BYTES], sealed[start + NONCE_BYTES :], self._aad(())
                )
            )
        except InvalidTag:
            raise ErasureError('a sealed media payload does not open with its key') from None

    def _aad(self, context: Iterable[str]) -> bytes:
        return '\x00'.join([SEALED_TEXT_MARK, self.conversation_id, *context]).encode()


def record_key(conversation_id: str, key_id: str) -> bytes:
    """The key topic's record key: the key id (32 hex digits), then the conversation id."""
    return key_id.encode() + conversation_id.encode()


def sealed_chars(plain_chars: int) -> int:
    """The longest sealed text (`seal_text`, no refs) of a plaintext of at most `plain_chars` characters."""
    body = NONCE_BYTES + 4 * plain_chars + 16  # UTF-8: at most 4 bytes a character; the GCM tag
    return len(f'["{SEALED_TEXT_MARK}","{"0" * 32}",""]') + 4 * -(-body // 3)


def is_sealed_text(value: str | None) -> bool:
    """Whether a text field holds sealed content (cheap: a prefix test)."""
    return value is not None and value.startswith(_SEALED_TEXT_PREFIX)


def split_sealed_text(sealed: str) -> tuple[str, bytes]:
    """The key id and the sealed body of a sealed text field."""
    try:
        mark, key_id, body, *refs = json.loads(sealed)
        if mark != SEALED_TEXT_MARK or len(key_id) != 32 or not all(isinstance(r, str) for r in refs):
            raise ValueError(mark)
        return str(key_id), base64.b64decode(body, validate=True)
    except (ValueError, TypeError, binascii.Error):
        raise ErasureError('a sealed field is malformed') from None


def open_snapshot(
    delta: SnapshotDelta, *, run_id: str, keys: KeyRing | None
) -> tuple[str, str | None] | None:
    """The plaintext `(messages, patch)` of a snapshot record, or None when its key was erased.

    A record written without erasure is returned as it is. Sealed content read without keys, or
    with a key-encryption key other than the one its key was wrapped with, is an `ErasureError`
    (a reader's configuration), never read as erased.
    """
    if not is_sealed_text(delta.messages):
        return delta.messages, delta.patch
    if keys is None:
        raise ErasureError(
            f'run {run_id!r}: snapshot {delta.snapshot_seq} is sealed (erasure is on for its writer): '
            'read it with STEPSTREAM_ERASURE_KEY set'
        )
    key = keys.opening(delta.messages)
    if key is None:
        return None
    where = (run_id, str(delta.snapshot_seq))
    messages = key.open_text(delta.messages, *where, 'messages')
    patch = None if delta.patch is None else key.open_text(delta.patch, *where, 'patch')
    return messages, patch


def sealed_media_key_id(data: bytes) -> str | None:
    """The key id of a sealed media payload, or None for a plain one."""
    if not data.startswith(SEALED_MEDIA_MAGIC) or len(data) < len(SEALED_MEDIA_MAGIC) + 16 + NONCE_BYTES:
        return None
    return data[len(SEALED_MEDIA_MAGIC) : len(SEALED_MEDIA_MAGIC) + 16].hex()


class KeyRing:
    """The conversation keys, read from the key topic into memory, and only there.

    Readers call `refresh()` before opening sealed content: it reads the key topic up to its end,
    so a key a writer made (acknowledged before any record sealed with it) is found, and a key
    tombstoned by `stepstream forget` is gone. Nothing is written to disk.

    ```python
    async with KeyRing(settings) as keys:
        await keys.refresh()
        key = keys.get(key_id)          # None: erased (or never made)
    ```
    """

    def __init__(self, settings: Settings) -> None:
        """Read `key_topic(settings.topics)` with the KEK `settings.security.erasure_key`."""
        if settings.security.erasure_key is None:
            raise ValueError('a KeyRing needs STEPSTREAM_ERASURE_KEY (erasure is off without it)')
        self.settings = settings
        self._kek = parse_kek(settings.security.erasure_key.get_secret_value())
        self._keys: dict[str, ConversationKey] = {}
        self.erased: set[str] = set()
        """Key ids this ring saw tombstoned (compaction later drops tombstones too)."""
        self.unreadable: dict[str, str] = {}
        self.missed: set[str] = set()
        """Key ids asked for and never seen, neither as a key nor as a tombstone: erased and then
        compacted away (Kafka), or past an end offset the broker under-reported (Tansu after a
        restart), which `refresh(thorough=True)` reads past."""
        """Key ids whose record this ring could not open, with why (another KEK, a malformed record)."""
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> KeyRing:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop reading, and forget every key held in memory."""
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        self._keys.clear()

    def get(self, key_id: str) -> ConversationKey | None:
        """The key with `key_id`, or None when it was erased or is unknown (noted in `missed`)."""
        key = self._keys.get(key_id)
        if key is None and key_id not in self.erased:
            self.missed.add(key_id)
        return key

    def opening(self, sealed: str) -> ConversationKey | None:
        """The key that opens the sealed text `sealed`, or None when it was erased (or is unknown).

        A key this reader holds but cannot unwrap (another key-encryption key, a damaged record) is
        an `ErasureError` saying why: a reader's configuration, never read as erased.
        """
        key_id, _ = split_sealed_text(sealed)
        key = self.get(key_id)
        if key is None and key_id in self.unreadable:
            raise ErasureError(self.unreadable[key_id])
        return key

    def of_conversation(self, conversation_id: str) -> list[ConversationKey]:
        """Every live key of `conversation_id`."""
        return [k for k in self._keys.values() if k.conversation_id == conversation_id]

    async def refresh(self, *, thorough: bool = False) -> None:
        """Read the key topic up to its current end (the first call reads it from the start).

        `thorough` also fetches until the fetch responses' high watermark is reached, for a broker
        whose ListOffsets may answer short (Tansu after a restart): one fetch wait more.
        """
        async with self._lock:
            consumer = self._consumer or await self._start()
            partitions = list(consumer.assignment())
            ends = await consumer.end_offsets(partitions)
            if thorough:
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    for record in records:
                        self._apply(record.key, record.value)
                ends = {tp: max(end, consumer.highwater(tp) or 0) for tp, end in ends.items()}
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.settings.kafka.ack_timeout_s
            while [tp for tp in partitions if await consumer.position(tp) < ends[tp]]:
                if loop.time() > deadline:
                    raise StepStreamError(
                        f'the key topic {key_topic(self.settings.topics)} did not deliver up to its end '
                        f'within {self.settings.kafka.ack_timeout_s:g}s'
                    )
                batches = await consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    for record in records:
                        self._apply(record.key, record.value)

    def _apply(self, key: bytes | None, value: bytes | None) -> None:
        if key is None or len(key) < 32:
            return  # not a key record: nothing to learn from it
        key_id = key[:32].decode(errors='replace')
        if value is None:
            self._keys.pop(key_id, None)
            self.unreadable.pop(key_id, None)
            self.erased.add(key_id)
            return
        try:
            self._keys[key_id] = ConversationKey.unwrap(key, value, self._kek)
        except ErasureError as exc:
            self.unreadable[key_id] = str(exc)  # reads of its content fail with why, never as erased

    async def _start(self) -> AIOKafkaConsumer:
        from aiokafka import AIOKafkaConsumer
        from aiokafka.structs import TopicPartition

        from stepstream.kafka_client import client_options
        from stepstream.topics import partition_counts

        topic = key_topic(self.settings.topics)
        await ensure_key_topic(self.settings)
        consumer = AIOKafkaConsumer(
            **client_options(self.settings.kafka),
            enable_auto_commit=False,
            auto_offset_reset='earliest',
            fetch_max_wait_ms=50,
            request_timeout_ms=max(1000, int(self.settings.kafka.ack_timeout_s * 1000)),
        )
        await asyncio.wait_for(consumer.start(), self.settings.kafka.ack_timeout_s)
        try:
            counts = await partition_counts(self.settings.kafka, [topic])
            if not counts.get(topic):
                raise StepStreamError(f'the key topic {topic} has no partitions this client can see')
            partitions = range(counts[topic])
            assigned = [TopicPartition(topic, p) for p in sorted(partitions)]
            consumer.assign(assigned)
            await consumer.seek_to_beginning(*assigned)
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer
        return consumer


async def ensure_key_topic(settings: Settings) -> None:
    """Create the compacted key topic if it is missing (idempotent)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    from stepstream.kafka_client import client_options
    from stepstream.topics import topic_errors

    topic = key_topic(settings.topics)
    admin = AIOKafkaAdminClient(
        **client_options(settings.kafka), request_timeout_ms=int(settings.kafka.ack_timeout_s * 1000)
    )
    await asyncio.wait_for(admin.start(), settings.kafka.ack_timeout_s)
    try:
        if topic in set(await admin.list_topics()):
            return
        new = NewTopic(
            name=topic,
            num_partitions=1,
            replication_factor=settings.topics.replication_factor,
            topic_configs=dict(KEY_TOPIC_CONFIGS),
        )
        try:
            response = await admin.create_topics([new])
        except TopicAlreadyExistsError:
            return
        for name, code, message in topic_errors(response):
            if code in (29, 31):  # TOPIC_/CLUSTER_AUTHORIZATION_FAILED
                raise StepStreamError(
                    f'the key topic {name} is missing and this principal may not create it: run '
                    '`stepstream topics ensure` with STEPSTREAM_ERASURE_KEY set, as an admin principal'
                )
            if code not in (0, 36):  # 36: another process made it first
                raise StepStreamError(f'could not create the key topic {name}: error {code} {message or ""}')
        for _ in range(max(1, int(settings.kafka.ack_timeout_s / 0.05))):
            if topic in set(await admin.list_topics()):
                break
            await asyncio.sleep(0.05)  # Apache Kafka creates topics asynchronously
    finally:
        await admin.close()
