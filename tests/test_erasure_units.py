"""Erasure by crypto-shredding without a broker: the sealed formats, the key ring's rules, the
sealing writer and the sealed media store on a disk store (the end-to-end proof is test_erasure)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic_ai import RunContext
from pydantic_ai.messages import (
    BinaryContent,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    UserPromptPart,
)
from pydantic_ai.models.test import TestModel
from pydantic_ai.usage import RunUsage

from stepstream import Settings
from stepstream.erasure import (
    ContentErased,
    ConversationKey,
    ErasureError,
    KeyRing,
    is_sealed_text,
    new_kek,
    open_snapshot,
    parse_kek,
    sealed_media_key_id,
)
from stepstream.errors import StepStreamError
from stepstream.media import DiskMediaStore, externalize_media, restore_media
from stepstream.media._sealed import SealedMediaStore
from stepstream.producer import StepPersistence
from stepstream.producer._memory import InMemoryLog
from stepstream.producer._sealing import Sealer
from stepstream.producer._snapshots import SnapshotWriter
from stepstream.settings import SECRET_FIELDS

pytestmark = pytest.mark.fast

SECRET = 'the patient has condition X'


def test_sealed_text_opens_only_with_its_key_and_its_place() -> None:
    key = ConversationKey.new('conv-1')
    sealed = key.seal_text(SECRET, 'run-a', '0', 'messages')
    assert is_sealed_text(sealed) and SECRET not in sealed
    assert key.open_text(sealed, 'run-a', '0', 'messages') == SECRET
    with pytest.raises(ErasureError, match='altered or moved'):
        key.open_text(sealed, 'run-b', '0', 'messages')  # moved to another run
    with pytest.raises(ErasureError, match='altered or moved'):
        key.open_text(sealed, 'run-a', '1', 'messages')  # or to another snapshot
    other = ConversationKey('conv-2', key.key_id, key.material)
    with pytest.raises(ErasureError, match='altered or moved'):
        other.open_text(sealed, 'run-a', '0', 'messages')  # or to another conversation
    with pytest.raises(ErasureError, match='not'):
        ConversationKey.new('conv-1').open_text(sealed, 'run-a', '0', 'messages')
    assert not is_sealed_text('[{"parts": []}]') and not is_sealed_text(None)


def test_the_key_encryption_key_setting_is_a_secret_checked_at_once() -> None:
    kek = new_kek()
    assert len(parse_kek(kek)) == 32
    settings = Settings.from_env({'STEPSTREAM_ERASURE_KEY': kek})
    assert (
        settings.security.erasure_key is not None and settings.security.erasure_key.get_secret_value() == kek
    )
    assert kek not in repr(settings) and 'erasure_key' in SECRET_FIELDS  # never a flag, never shown
    with pytest.raises(ValueError, match='base64 of 32 random bytes'):
        Settings(erasure_key='too short')  # type: ignore[arg-type]
    assert Settings().security.erasure_key is None  # off by default


def test_a_key_record_opens_only_with_the_kek_that_wrapped_it() -> None:
    kek, other = parse_kek(new_kek()), parse_kek(new_kek())
    key = ConversationKey.new('conv-ü/1')
    value = key.wrap(kek)
    assert key.material not in value
    assert ConversationKey.unwrap(key.record_key(), value, kek) == key
    with pytest.raises(ErasureError, match='another STEPSTREAM_ERASURE_KEY'):
        ConversationKey.unwrap(key.record_key(), value, other)
    with pytest.raises(ErasureError, match='not a conversation key record'):
        ConversationKey.unwrap(ConversationKey.new('conv-2').record_key(), value, kek)  # a moved record
    with pytest.raises(ErasureError, match='not a conversation key record'):
        ConversationKey.unwrap(key.record_key(), b'garbage', kek)


def ring(kek: str) -> KeyRing:
    """A key ring fed by hand: `_apply` is what it does with each record of the key topic."""
    return KeyRing(Settings(erasure_key=kek))  # type: ignore[arg-type]


async def test_a_tombstone_erases_and_a_foreign_kek_is_an_error_not_an_erasure(tmp_path: Path) -> None:
    kek = new_kek()
    key = ConversationKey.new('conv-1')
    writer = SnapshotWriter(DiskMediaStore(tmp_path), 1 << 20)
    sealer = Sealer(kek, send_key=lambda k, v: _noop())
    sealer._keys['conv-1'] = key  # as if acknowledged on the key topic
    messages = [ModelRequest(parts=[UserPromptPart(SECRET)]), ModelResponse(parts=[TextPart('noted')])]
    delta = await sealer.delta(writer, writer.plan(messages), 0, conversation_id='conv-1', run_id='run-a')
    assert SECRET not in delta.messages

    keys = ring(kek)
    keys._apply(key.record_key(), key.wrap(parse_kek(kek)))
    opened = open_snapshot(delta, run_id='run-a', keys=keys)
    assert opened is not None
    assert ModelMessagesTypeAdapter.validate_json(opened[0]) == messages
    keys._apply(key.record_key(), None)  # the tombstone `forget` appends
    assert keys.get(key.key_id) is None and key.key_id in keys.erased
    assert open_snapshot(delta, run_id='run-a', keys=keys) is None  # erased: no error

    foreign = ring(new_kek())
    foreign._apply(key.record_key(), key.wrap(parse_kek(kek)))
    with pytest.raises(ErasureError, match='another STEPSTREAM_ERASURE_KEY'):
        open_snapshot(delta, run_id='run-a', keys=foreign)
    with pytest.raises(ErasureError, match='read it with STEPSTREAM_ERASURE_KEY set'):
        open_snapshot(delta, run_id='run-a', keys=None)


async def _noop() -> None:
    return None


async def test_one_key_per_conversation_and_writer_acknowledged_before_use() -> None:
    sent: list[tuple[bytes, bytes]] = []

    async def send(key: bytes, value: bytes) -> None:
        sent.append((key, value))

    sealer = Sealer(new_kek(), send)
    first = await sealer.key_for('conv-1')
    assert await sealer.key_for('conv-1') is first
    second = await sealer.key_for('conv-2')
    assert second.key_id != first.key_id
    assert [k for k, _ in sent] == [first.record_key(), second.record_key()]


async def test_sealed_media_is_opaque_unshared_and_gone_with_its_key(tmp_path: Path) -> None:
    disk = DiskMediaStore(tmp_path / 'media')
    payload = (SECRET + '\n') * 1000
    messages = [ModelRequest(parts=[UserPromptPart(payload)])]
    one, two = ConversationKey.new('conv-1'), ConversationKey.new('conv-2')
    held = {one.key_id: one, two.key_id: two}
    store = SealedMediaStore(disk, lookup=held.get)
    lean_one = await externalize_media(messages, store, 1024, seal=one.seal_bytes)
    lean_two = await externalize_media(messages, store, 1024, seal=two.seal_bytes)
    files = sorted(p for p in (tmp_path / 'media').rglob('*') if p.is_file() and p.suffix == '.bin')
    assert len(files) == 2  # one payload, two conversations: two objects
    plain_hash = hashlib.sha256(payload.encode()).hexdigest()
    for path in files:
        data = path.read_bytes()
        assert SECRET.encode() not in data and sealed_media_key_id(data) is not None
        assert plain_hash not in path.name
    assert await restore_media(lean_one, store) == messages
    del held[one.key_id]  # conversation 1 forgotten
    with pytest.raises(ContentErased):
        await restore_media(lean_one, store)
    assert await restore_media(lean_two, store) == messages
    with pytest.raises(ValueError, match='sealed payloads only'):
        await store.put(payload.encode())


def test_a_key_never_seen_is_noted_so_that_a_reader_looks_again() -> None:
    keys = ring(new_kek())
    key = ConversationKey.new('conv-1')
    assert keys.get(key.key_id) is None and keys.missed == {key.key_id}
    keys.missed.clear()
    keys._apply(key.record_key(), None)  # a tombstone seen: erased, nothing to look for
    assert keys.get(key.key_id) is None and not keys.missed


async def test_erasure_under_a_durable_engine_is_refused_at_the_start_of_the_run(tmp_path: Path) -> None:
    class InWorkflow(RunContext[None]):
        @property
        def in_durable_context(self) -> bool:
            return True

    log = InMemoryLog()
    log.sealer = Sealer(new_kek(), lambda k, v: _noop())
    persistence = StepPersistence(log=log, agent_name='a', media_store=DiskMediaStore(tmp_path))
    ctx = InWorkflow(deps=None, model=TestModel(), usage=RunUsage(), run_id='run-1')
    with pytest.raises(StepStreamError, match='not supported under a durable-execution engine'):
        await persistence.for_run(ctx)


async def test_a_sealed_snapshot_names_its_sealed_media_for_the_retention_sweep(tmp_path: Path) -> None:
    """With erasure and retention both on, the sweep must still see which objects a kept run uses.

    The content is sealed, so the projection's media index (decisions 0032, 0041) reads what the
    record lists in clear: hashes of ciphertext, image included.
    """
    from stepstream.media import snapshot_media
    from stepstream.schemas import StepEvent, decode, encode

    kek = new_kek()
    key = ConversationKey.new('conv-1')
    disk = DiskMediaStore(tmp_path / 'media')
    writer = SnapshotWriter(disk, 1024)
    sealer = Sealer(kek, send_key=lambda k, v: _noop())
    sealer._keys['conv-1'] = key  # as if acknowledged on the key topic
    messages = [
        ModelRequest(
            parts=[
                UserPromptPart(
                    [(SECRET + '\n') * 200, BinaryContent(b'\x89PNG' * 600, media_type='image/png')]
                )
            ]
        ),
        ModelResponse(parts=[TextPart('ok')]),
    ]
    delta = await sealer.delta(writer, writer.plan(messages), 0, conversation_id='conv-1', run_id='run-a')
    stored = {p.stem for p in (tmp_path / 'media').rglob('*.bin')}
    assert len(stored) == 2 and SECRET not in delta.messages
    record = StepEvent(
        run_id='run-a',
        seq=3,
        writer_id='w',
        timestamp=datetime(2026, 12, 1, tzinfo=UTC),
        kind='snapshot_saved',
        conversation_id='conv-1',
        snapshot=delta,
    )
    read = decode(encode(record))
    assert isinstance(read, StepEvent) and read.snapshot is not None
    listed = snapshot_media(read.snapshot.messages, read.snapshot.media)
    assert {uri.removeprefix('media+sha256://') for uri in listed} == stored  # exactly what was stored
    assert SECRET not in ''.join(listed)
    # A reader before schema v4 finds the same list in clear beside the ciphertext.
    assert snapshot_media(read.snapshot.messages, None) == listed
