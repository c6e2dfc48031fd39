"""Media offload against the real SeaweedFS S3 of the embedded stack, and a disk store in tmp_path.

Every S3 test works under its own key prefix of the shared bucket, so tests never see each
other's objects; objects are inspected with obstore directly, never through a mock.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import os
import re
import threading
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import obstore
import pytest
from obstore.store import S3Store
from pydantic_ai import ModelMessagesTypeAdapter
from pydantic_ai.messages import (
    BinaryContent,
    BinaryImage,
    DocumentUrl,
    FilePart,
    ImageUrl,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextContent,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from stepstream import MediaUnavailable, Settings, StepStreamError
from stepstream.embedded import EmbeddedStack
from stepstream.media import (
    DEFAULT_THRESHOLD_BYTES,
    NO_CONTEXT,
    REFERENCE_PREFIX,
    DiskMediaStore,
    MediaContext,
    MediaIntegrityError,
    MediaNotFound,
    MediaStore,
    S3MediaStore,
    externalize_media,
    link_media,
    make_static_public_url,
    media_uri_for,
    parse_media_uri,
    restore_media,
)
from stepstream.media import _walker as media_walker

pytestmark = pytest.mark.once

KIB = 1024
IMAGE = os.urandom(5 * 1024 * 1024)  # a 5 MB "image": random, so no layer can compress it away
TOOL_OUTPUT = ''.join(f'line {i}: {"é" * 20}\n' for i in range(3900))  # 200 KB, not ASCII
assert 195_000 < len(TOOL_OUTPUT.encode()) < 210_000


def raw_store(settings: Settings, **overrides: Any) -> S3Store:
    """An obstore client on the stack's bucket, to look at and tamper with objects directly."""
    config: dict[str, Any] = {
        'endpoint': settings.media.s3_endpoint,
        'region': settings.media.s3_region,
        'access_key_id': settings.media.s3_access_key_id,
        'secret_access_key': settings.media.s3_secret_access_key.get_secret_value()
        if settings.media.s3_secret_access_key
        else None,
        **overrides,
    }
    return S3Store(
        config.pop('bucket', settings.media.s3_bucket),
        client_options={'allow_http': True},
        retry_config={'max_retries': 0, 'retry_timeout': timedelta(seconds=2)},
        **config,
    )


@pytest.fixture
def key_prefix() -> str:
    return f'test-media-{uuid.uuid4().hex[:12]}'


@pytest.fixture
def s3(stack: EmbeddedStack, key_prefix: str) -> S3MediaStore:
    return S3MediaStore.from_settings(stack.settings.media, key_prefix=key_prefix)


@pytest.fixture
def raw(stack: EmbeddedStack) -> S3Store:
    return raw_store(stack.settings)


def keys_under(store: S3Store, prefix: str) -> list[str]:
    return sorted(meta['path'] for batch in obstore.list(store, prefix=prefix) for meta in batch)


def content_of(message: ModelMessage, part: int) -> Any:
    """The `content` of one part, untyped: the tests know which part holds what."""
    return getattr(message.parts[part], 'content')  # noqa: B009


def json_round_trip(messages: Sequence[ModelMessage]) -> list[ModelMessage]:
    return ModelMessagesTypeAdapter.validate_json(ModelMessagesTypeAdapter.dump_json(list(messages)))


# -- URIs and context ---------------------------------------------------------------------------


@pytest.mark.fast
def test_media_uri_is_the_sha256_of_the_bytes() -> None:
    digest = hashlib.sha256(b'hello').hexdigest()
    assert media_uri_for(b'hello') == f'media+sha256://{digest}'
    assert parse_media_uri(media_uri_for(b'hello')) == digest


@pytest.mark.fast
@pytest.mark.parametrize(
    'uri',
    [
        'sha256://' + 'a' * 64,
        'media+sha256://' + 'A' * 64,
        'media+sha256://' + 'a' * 63,
        'media+sha256://' + 'a' * 65,
        'media+sha256://' + 'a' * 64 + '/x',
        ' media+sha256://' + 'a' * 64,
        'media+sha256://../../etc/passwd',
        '',
    ],
)
def test_parse_media_uri_rejects_anything_else_and_says_what_is_valid(uri: str) -> None:
    with pytest.raises(ValueError, match=r'not a media URI: expected media\+sha256:// followed by the 64'):
        parse_media_uri(uri)


@pytest.mark.fast
def test_media_context_is_frozen_keyword_only_and_read_only() -> None:
    source = {'run': 'r1'}
    ctx = MediaContext(media_type='image/png', metadata=source)
    source['run'] = 'changed'
    assert ctx.metadata == {'run': 'r1'}
    with pytest.raises(TypeError):
        ctx.metadata['run'] = 'x'  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.media_type = 'x'  # type: ignore[misc]
    with pytest.raises(TypeError):
        MediaContext('image/png')  # type: ignore[call-arg]
    with pytest.raises(TypeError, match='strings to strings'):
        MediaContext(metadata={'n': 1})  # type: ignore[dict-item]
    assert MediaContext() == MediaContext(metadata={})


@pytest.mark.broker
def test_both_stores_satisfy_the_protocol(s3: S3MediaStore, tmp_path: Path) -> None:
    assert isinstance(s3, MediaStore)
    assert isinstance(DiskMediaStore(tmp_path), MediaStore)


# -- S3 store -----------------------------------------------------------------------------------


@pytest.mark.broker
async def test_s3_round_trip_with_media_type_filename_and_metadata(
    s3: S3MediaStore, raw: S3Store, key_prefix: str
) -> None:
    ctx = MediaContext(
        media_type='image/png',
        filename='café menu.png',
        metadata={'run-id': 'r1', 'note': 'naïve ✓', 'looks-encoded': '=?utf-8?b?eA==?='},
    )
    uri = await s3.put(IMAGE, ctx)

    assert uri == media_uri_for(IMAGE)
    assert await s3.get(uri) == IMAGE
    assert await s3.exists(uri)
    assert await s3.get_metadata(uri) == ctx
    key = f'{key_prefix}/{parse_media_uri(uri)}.bin'
    assert keys_under(raw, key_prefix) == [key]
    result = await obstore.get_async(raw, key, options={'head': True})
    assert result.attributes['Content-Type'] == 'image/png'
    assert result.attributes['run-id'] == 'r1'


@pytest.mark.broker
async def test_s3_missing_object_is_not_found_naming_the_uri(s3: S3MediaStore) -> None:
    uri = media_uri_for(b'never stored')
    assert not await s3.exists(uri)
    with pytest.raises(MediaNotFound, match=re.escape(uri)) as caught:
        await s3.get(uri)
    assert isinstance(caught.value, LookupError) and isinstance(caught.value, StepStreamError)
    assert caught.value.uri == uri
    with pytest.raises(MediaNotFound):
        await s3.get_metadata(uri)


@pytest.mark.broker
async def test_s3_put_of_present_bytes_does_not_upload_again(
    s3: S3MediaStore, raw: S3Store, key_prefix: str
) -> None:
    uri = await s3.put(b'x' * 1000, MediaContext(metadata={'upload': 'first'}))
    key = s3.key_for(uri)
    # Rewrite the object behind the store's back with the same bytes and a marker: a second
    # upload would replace the marker.
    await obstore.put_async(raw, key, b'x' * 1000, attributes={'upload': 'by-hand'})

    assert await s3.put(b'x' * 1000, MediaContext(metadata={'upload': 'second'})) == uri
    assert (await s3.get_metadata(uri)).metadata == {'upload': 'by-hand'}
    assert keys_under(raw, key_prefix) == [key]


@pytest.mark.broker
async def test_s3_corrupted_object_is_detected_on_read(s3: S3MediaStore, raw: S3Store) -> None:
    data = b'the real payload ' * 100
    uri = await s3.put(data)
    await obstore.put_async(raw, s3.key_for(uri), data.replace(b'real', b'fake'))

    with pytest.raises(MediaIntegrityError, match=re.escape(uri)) as caught:
        await s3.get(uri)
    assert caught.value.actual_uri == media_uri_for(data.replace(b'real', b'fake'))


@pytest.mark.broker
async def test_s3_put_repairs_a_truncated_object(s3: S3MediaStore, raw: S3Store) -> None:
    data = b'0123456789' * 100
    uri = await s3.put(data)
    await obstore.put_async(raw, s3.key_for(uri), data[:10])
    with pytest.raises(MediaIntegrityError):
        await s3.get(uri)

    await s3.put(data)
    assert await s3.get(uri) == data


@pytest.mark.broker
async def test_s3_wrong_credentials_fail_naming_endpoint_and_bucket(stack: EmbeddedStack) -> None:
    settings = stack.settings.replace(s3_secret_access_key='not-the-secret')
    store = S3MediaStore.from_settings(settings.media)
    uri = media_uri_for(b'x')
    calls = (store.check(), store.put(b'x'), store.get(uri), store.exists(uri), store.get_metadata(uri))
    for call in calls:
        with pytest.raises(MediaUnavailable) as caught:
            await call
        message = str(caught.value)
        assert settings.media.s3_endpoint is not None and settings.media.s3_endpoint in message
        assert repr(settings.media.s3_bucket) in message
        assert 'access was denied' in message and 'STEPSTREAM_S3_SECRET_ACCESS_KEY' in message


@pytest.mark.broker
async def test_s3_missing_bucket_fails_naming_it(stack: EmbeddedStack) -> None:
    # The embedded SeaweedFS, like AWS and MinIO, does not create a bucket on a PUT.
    store = S3MediaStore.from_settings(
        stack.settings.replace(s3_bucket=f'missing-{uuid.uuid4().hex[:8]}').media
    )
    for call in (store.check(), store.get(media_uri_for(b'x')), store.put(b'x')):
        with pytest.raises(MediaUnavailable, match=r"bucket 'missing-.*does not exist.*STEPSTREAM_S3_BUCKET"):
            await call


@pytest.mark.broker
async def test_s3_stopped_fails_clearly_and_recovers(tmp_path: Path) -> None:
    async with EmbeddedStack(tmp_path / 's') as own:
        store = S3MediaStore.from_settings(own.settings.media)
        uri = await store.put(b'before the outage')
        own.stop_s3()
        history = [ModelRequest(parts=[UserPromptPart(['look', BinaryImage(IMAGE, media_type='image/png')])])]

        for call in (store.put(b'during'), store.get(uri), store.exists(uri)):
            with pytest.raises(MediaUnavailable) as caught:
                await call
            message = str(caught.value)
            assert own.settings.media.s3_endpoint is not None and own.settings.media.s3_endpoint in message
            assert repr(own.settings.media.s3_bucket) in message
            assert 'could not be reached' in message and 'STEPSTREAM_S3_ENDPOINT' in message
        with pytest.raises(MediaUnavailable):
            await externalize_media(history, store)

        own.start_s3()
        assert await store.get(uri) == b'before the outage'


@pytest.mark.broker
async def test_s3_key_strategy_and_public_urls(stack: EmbeddedStack, raw: S3Store, key_prefix: str) -> None:
    seen: list[tuple[str, MediaContext, str]] = []

    async def signed(uri: str, ctx: MediaContext, key: str) -> str:
        seen.append((uri, ctx, key))
        return f'https://signed.example/{key}?sig=1'

    def by_type(uri: str, ctx: MediaContext) -> str:
        return f'{(ctx.media_type or "unknown").replace("/", "-")}/{parse_media_uri(uri)}'

    ctx = MediaContext(media_type='image/png')
    store = S3MediaStore.from_settings(
        stack.settings.media, key_prefix=key_prefix + '/', key_strategy=by_type
    )
    uri = await store.put(b'png bytes', ctx)
    key = f'{key_prefix}/image-png/{parse_media_uri(uri)}'
    assert keys_under(raw, key_prefix) == [key]
    assert await store.get(uri, ctx) == b'png bytes'
    assert await store.public_url(uri, ctx) is None

    cdn = S3MediaStore.from_settings(
        stack.settings.media,
        key_prefix=key_prefix,
        public_url=make_static_public_url('https://cdn.example/m/'),
    )
    assert await cdn.public_url(uri) == f'https://cdn.example/m/{key_prefix}/{parse_media_uri(uri)}.bin'
    mounted = make_static_public_url('https://cdn.example', key_prefix='bucket')
    assert await mounted(uri, ctx, 'a b.bin') == 'https://cdn.example/bucket/a%20b.bin'

    presigned = S3MediaStore.from_settings(stack.settings.media, key_prefix=key_prefix, public_url=signed)
    assert await presigned.public_url(uri, ctx) == f'https://signed.example/{presigned.key_for(uri)}?sig=1'
    assert seen == [(uri, ctx, presigned.key_for(uri))]
    with pytest.raises(ValueError, match='not a media URI'):
        await presigned.public_url('https://elsewhere/x.png')


@pytest.mark.broker
async def test_s3_rejects_metadata_keys_s3_would_change(s3: S3MediaStore) -> None:
    for key in ('Run-Id', 'content-type', 'with space'):
        with pytest.raises(ValueError, match='cannot be S3 object metadata'):
            await s3.put(b'x', MediaContext(metadata={key: 'v'}))


# -- disk store ---------------------------------------------------------------------------------


@pytest.mark.fast
async def test_disk_round_trip_dedup_and_integrity(tmp_path: Path) -> None:
    store = DiskMediaStore(tmp_path / 'media')
    ctx = MediaContext(media_type='audio/wav', filename='clip.wav', metadata={'k': 'v ✓'})
    uri = await store.put(b'RIFF....', ctx)
    path = tmp_path / 'media' / f'{parse_media_uri(uri)}.bin'

    assert path.read_bytes() == b'RIFF....'
    assert await store.get(uri) == b'RIFF....'
    assert await store.exists(uri)
    assert await store.get_metadata(uri) == ctx
    assert await store.public_url(uri) is None

    stamp = path.stat().st_mtime_ns, path.stat().st_ino
    assert await store.put(b'RIFF....', MediaContext(media_type='other/type')) == uri
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == stamp
    assert (await store.get_metadata(uri)).media_type == 'audio/wav'
    assert sorted(p.name for p in path.parent.iterdir()) == [
        path.name,
        path.name + '.meta.json',
    ]  # no temp files

    path.write_bytes(b'RIFF!!!!')
    with pytest.raises(MediaIntegrityError, match=re.escape(uri)):
        await store.get(uri)
    missing = media_uri_for(b'missing')
    assert not await store.exists(missing)
    with pytest.raises(MediaNotFound, match=re.escape(missing)):
        await store.get(missing)
    with pytest.raises(MediaNotFound):
        await store.get_metadata(missing)


@pytest.mark.fast
@pytest.mark.parametrize(
    'key',
    ['/etc/stepstream.bin', '../outside.bin', 'a/../../outside.bin', 'a/..', '..\\x.bin', 'C:\\x.bin', ''],
)
async def test_disk_rejects_key_strategies_that_escape_the_directory(tmp_path: Path, key: str) -> None:
    store = DiskMediaStore(tmp_path / 'media', key_strategy=lambda uri, ctx: key)
    uri = media_uri_for(b'x')
    calls = (store.put(b'x'), store.get(uri), store.exists(uri), store.get_metadata(uri))
    for call in calls:
        with pytest.raises(ValueError, match='must be a relative path inside the directory'):
            await call
    assert list(tmp_path.iterdir()) == []


@pytest.mark.fast
async def test_disk_key_strategy_nests_and_rejects_foreign_uris(tmp_path: Path) -> None:
    store = DiskMediaStore(
        tmp_path, key_strategy=lambda uri, ctx: f'{parse_media_uri(uri)[:2]}/{uri[-8:]}.dat'
    )
    uri = await store.put(b'nested')
    assert (tmp_path / parse_media_uri(uri)[:2] / f'{uri[-8:]}.dat').read_bytes() == b'nested'
    with pytest.raises(ValueError, match='not a media URI'):
        await store.get('media+sha256://../../etc/passwd')


# -- walkers ------------------------------------------------------------------------------------


def big_history() -> list[ModelMessage]:
    image = BinaryImage(IMAGE, media_type='image/png', vendor_metadata={'detail': 'high'})
    return [
        ModelRequest(parts=[UserPromptPart(['What is in this image?', image])]),
        ModelResponse(
            parts=[
                ThinkingPart('hmm ' * 20_000, signature='sig'),
                TextPart('Let me look closer.'),
                ToolCallPart('inspect', {'zoom': 2}, tool_call_id='c1'),
            ]
        ),
        ModelRequest(parts=[ToolReturnPart('inspect', TOOL_OUTPUT, tool_call_id='c1')]),
        ModelResponse(
            parts=[
                TextPart('A cat. ' * 10_000),
                FilePart(BinaryImage(IMAGE[:100_000], media_type='image/jpeg')),
            ]
        ),
        ModelRequest(
            parts=[
                UserPromptPart(['short', 'é' * 40_000, TextContent('t' * 70_000, metadata={'m': 1})]),
                ToolReturnPart(
                    'files',
                    [
                        TOOL_OUTPUT,
                        BinaryContent(IMAGE, media_type='application/pdf', identifier='doc-1'),
                        'small',
                    ],
                    tool_call_id='c2',
                ),
            ]
        ),
    ]


@pytest.mark.broker
async def test_walkers_round_trip_big_payloads_through_json(
    s3: S3MediaStore, raw: S3Store, key_prefix: str
) -> None:
    original = big_history()
    untouched = copy.deepcopy(original)

    lean = await externalize_media(original, s3)
    record = ModelMessagesTypeAdapter.dump_json(lean)
    restored = await restore_media(ModelMessagesTypeAdapter.validate_json(record), s3)

    assert len(record) < DEFAULT_THRESHOLD_BYTES
    assert original == untouched  # the input was not modified
    assert restored == original
    assert restored == json_round_trip(original)
    assert await restore_media(lean, s3) == original
    # Identifiers: an explicit one is kept; a default one is the default of the restored bytes.
    assert content_of(restored[4], 1)[1].identifier == 'doc-1'
    assert content_of(restored[0], 0)[1].identifier == content_of(original[0], 0)[1].identifier
    # IMAGE twice (user prompt, tool return as a pdf) is one object; so is TOOL_OUTPUT twice.
    assert len(keys_under(raw, key_prefix)) == 7


@pytest.mark.broker
async def test_walkers_keep_the_reference_in_the_payload_field(s3: S3MediaStore) -> None:
    image = BinaryImage(IMAGE, media_type='image/png', vendor_metadata={'detail': 'low'})
    [lean] = await externalize_media([ModelRequest(parts=[UserPromptPart([image, TOOL_OUTPUT])])], s3)

    lean_image, lean_text = content_of(lean, 0)
    assert isinstance(lean_image, BinaryImage)
    assert lean_image.data == (REFERENCE_PREFIX + media_uri_for(IMAGE)).encode()
    assert (lean_image.media_type, lean_image.vendor_metadata) == ('image/png', {'detail': 'low'})
    assert lean_image.identifier == image.identifier
    assert lean_text == REFERENCE_PREFIX + media_uri_for(TOOL_OUTPUT.encode())

    [restored] = await restore_media([lean], s3)
    restored_image = content_of(restored, 0)[0]
    assert restored_image == image and restored_image._identifier is None  # default identifier stays implicit
    assert lean_image.data.startswith(REFERENCE_PREFIX.encode())  # restore did not touch its input


@pytest.mark.broker
async def test_same_image_in_ten_messages_is_one_object(
    s3: S3MediaStore, raw: S3Store, key_prefix: str
) -> None:
    turns: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart([f'turn {i}', BinaryImage(IMAGE, media_type='image/png')])])
        for i in range(10)
    ]
    first = await externalize_media(turns[:5], s3)
    second = await externalize_media(turns[5:], s3)  # a later snapshot, or another run

    assert keys_under(raw, key_prefix) == [f'{key_prefix}/{parse_media_uri(media_uri_for(IMAGE))}.bin']
    assert await restore_media(first + second, s3) == turns


@pytest.mark.fast
async def test_messages_below_threshold_are_the_same_objects(tmp_path: Path) -> None:
    store = DiskMediaStore(tmp_path / 'media')
    history = big_history()

    lean = await externalize_media(history, store, threshold_bytes=10 * 1024 * 1024)
    assert all(new is old for new, old in zip(lean, history, strict=True))
    assert not (tmp_path / 'media').exists()
    restored = await restore_media(history, store)
    assert all(new is old for new, old in zip(restored, history, strict=True))

    # Only what changes is copied: the tool-return message moves, the others stay the same objects.
    lean = await externalize_media(history, store, threshold_bytes=150 * KIB)
    assert [new is old for new, old in zip(lean, history, strict=True)] == [False, True, False, True, False]
    assert lean[4].parts[0] is history[4].parts[0]


@pytest.mark.fast
async def test_link_media_turns_offloaded_binaries_into_links_and_restores_text(tmp_path: Path) -> None:
    store = DiskMediaStore(tmp_path / 'media')
    history = big_history()
    lean = await externalize_media(history, store, threshold_bytes=64 * KIB)

    async def link_for(uri: str, media_type: str) -> str:
        return f'/media/{parse_media_uri(uri)}?type={media_type}'

    linked = await link_media(
        ModelMessagesTypeAdapter.validate_json(ModelMessagesTypeAdapter.dump_json(lean)), store, link_for
    )
    image, pdf = linked[0].parts[0].content[1], linked[4].parts[1].content[1]  # type: ignore[union-attr,index]
    assert image == ImageUrl(
        f'/media/{hashlib.sha256(IMAGE).hexdigest()}?type=image/png',
        media_type='image/png',
        identifier=image.identifier,
    )
    assert isinstance(pdf, DocumentUrl) and pdf.identifier == 'doc-1' and pdf.media_type == 'application/pdf'
    # Text and a model's file part (which admits no URL) are the originals again.
    restored = json_round_trip(history)
    assert linked[1] == restored[1] and linked[2] == restored[2] and linked[3] == restored[3]
    assert linked[4].parts[1].content[0] == TOOL_OUTPUT  # type: ignore[union-attr,index]
    # Still Pydantic AI's JSON, and small.
    dumped = ModelMessagesTypeAdapter.dump_json(linked)
    assert ModelMessagesTypeAdapter.validate_json(dumped) == linked
    assert len(dumped) < len(ModelMessagesTypeAdapter.dump_json(history)) - len(IMAGE)


@pytest.mark.fast
async def test_user_text_that_looks_like_a_reference_is_not_misread(tmp_path: Path) -> None:
    store = DiskMediaStore(tmp_path / 'media')
    uri = media_uri_for(b'some payload')
    lookalikes = [
        uri,
        REFERENCE_PREFIX + uri,
        REFERENCE_PREFIX + REFERENCE_PREFIX + uri,
        REFERENCE_PREFIX + 'not a uri',
        REFERENCE_PREFIX,
    ]
    prompts: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart(text)]) for text in lookalikes]
    history: list[ModelMessage] = [
        *prompts,
        ModelResponse(parts=[TextPart(lookalikes[1]), ThinkingPart(lookalikes[2])]),
        ModelRequest(
            parts=[
                ToolReturnPart('t', lookalikes[1], tool_call_id='a'),
                ToolReturnPart('t', [lookalikes[1], TextContent(lookalikes[2])], tool_call_id='b'),
                UserPromptPart(
                    [BinaryContent(lookalikes[1].encode(), media_type='application/octet-stream')]
                ),
            ]
        ),
    ]

    lean = await externalize_media(history, store)
    assert not (tmp_path / 'media').exists()  # nothing was big: the lookalikes were only escaped
    restored = await restore_media(
        ModelMessagesTypeAdapter.validate_json(ModelMessagesTypeAdapter.dump_json(lean)), store
    )
    assert restored == json_round_trip(history)
    assert await restore_media(lean, store) == history
    # A history that never went through externalize_media is left alone, URI-like text included.
    plain: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart(uri)]),
        ModelResponse(parts=[TextPart(f'see {uri}')]),
    ]
    assert await restore_media(plain, store) == plain


@pytest.mark.fast
async def test_walkers_keep_sequence_types_and_odd_text(tmp_path: Path) -> None:
    store = DiskMediaStore(tmp_path)
    odd = 'surrogate \udcff ' * 10_000  # text decoded with surrogateescape
    history: list[ModelMessage] = [
        ModelRequest(parts=[ToolReturnPart('t', (odd, 'small', {'kind': 'binary'}), tool_call_id='c')])
    ]
    lean = await externalize_media(history, store)
    assert isinstance(lean[0].parts[0].content, tuple)  # type: ignore[union-attr]
    assert await restore_media(lean, store) == history


@pytest.mark.fast
async def test_externalize_rejects_a_bad_threshold(tmp_path: Path) -> None:
    for threshold in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match='threshold_bytes must be a positive int'):
            await externalize_media([], DiskMediaStore(tmp_path), threshold)  # type: ignore[arg-type]


@pytest.mark.fast
async def test_restore_names_the_missing_object(tmp_path: Path) -> None:
    writer, reader = DiskMediaStore(tmp_path / 'a'), DiskMediaStore(tmp_path / 'b')
    lean = await externalize_media([ModelRequest(parts=[UserPromptPart(TOOL_OUTPUT)])], writer)
    with pytest.raises(MediaNotFound, match=re.escape(media_uri_for(TOOL_OUTPUT.encode()))):
        await restore_media(lean, reader)


@pytest.mark.fast
async def test_text_content_in_a_tool_return_survives_json(tmp_path: Path) -> None:
    # Pydantic AI's JSON turns a TextContent inside a tool return into a plain dict; the walkers
    # treat both forms as the same payload, so the reference never leaks to the reader.
    store = DiskMediaStore(tmp_path)
    history: list[ModelMessage] = [
        ModelRequest(parts=[ToolReturnPart('t', [TextContent(TOOL_OUTPUT), 'small'], tool_call_id='c')])
    ]
    lean = await externalize_media(history, store)
    record = ModelMessagesTypeAdapter.dump_json(lean)

    assert len(record) < 1024
    assert await restore_media(lean, store) == history
    assert await restore_media(ModelMessagesTypeAdapter.validate_json(record), store) == json_round_trip(
        history
    )


class ConcurrencyProbe:
    """A disk store whose puts wait until `expected` of them are in flight at once."""

    def __init__(self, inner: DiskMediaStore, expected: int) -> None:
        self.inner = inner
        self.expected = expected
        self.in_flight = 0
        self.all_in = asyncio.Event()

    async def put(self, data: bytes, ctx: MediaContext = NO_CONTEXT) -> str:
        self.in_flight += 1
        if self.in_flight == self.expected:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), timeout=10)
        return await self.inner.put(data, ctx)

    async def get(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bytes:
        return await self.inner.get(uri, ctx)

    async def exists(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bool:
        return await self.inner.exists(uri, ctx)

    async def public_url(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> str | None:
        return await self.inner.public_url(uri, ctx)

    async def get_metadata(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> MediaContext:
        return await self.inner.get_metadata(uri, ctx)


@pytest.mark.fast
async def test_uploads_of_one_call_run_concurrently(tmp_path: Path) -> None:
    probe = ConcurrencyProbe(DiskMediaStore(tmp_path), expected=3)
    history: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart([BinaryImage(IMAGE, media_type='image/png'), TOOL_OUTPUT])]),
        ModelResponse(parts=[TextPart('x' * 100_000)]),
    ]
    lean = await externalize_media(history, probe)  # sequential uploads would time out above
    assert await restore_media(lean, probe) == history


# -- everything large, anywhere in a message -----------------------------------------------------


def everywhere_history(big: str) -> list[ModelMessage]:
    """A large value in every place a message can hold one."""
    return [
        ModelRequest(
            parts=[SystemPromptPart(big + 'system'), UserPromptPart(big + 'user')],
            instructions=big + 'instructions',
        ),
        ModelResponse(
            parts=[
                ToolCallPart(
                    'search',
                    {'query': big + 'args', 'nested': {'deep': [big + 'deeper', 1]}},
                    tool_call_id='a',
                ),
                ToolCallPart('search', big + 'raw args', tool_call_id='b'),
            ]
        ),
        ModelRequest(
            parts=[
                ToolReturnPart('search', {'doc': {'blob': big + 'return', 'n': 1.5}}, tool_call_id='a'),
                ToolReturnPart(
                    'search',
                    [{'items': (big + 'tuple', None, True)}],
                    tool_call_id='b',
                ),
            ]
        ),
    ]


@pytest.mark.fast
async def test_large_values_anywhere_in_a_message_move_and_come_back(tmp_path: Path) -> None:
    store = DiskMediaStore(tmp_path)
    history = everywhere_history('x' * 2 * KIB)

    lean = await externalize_media(history, store, threshold_bytes=KIB)
    record = ModelMessagesTypeAdapter.dump_json(lean)

    assert b'xxxxxxxxxx' not in record  # not one large value stayed inline
    assert await restore_media(ModelMessagesTypeAdapter.validate_json(record), store) == json_round_trip(
        history
    )
    assert await restore_media(lean, store) == history


@pytest.mark.fast
async def test_many_values_below_the_threshold_move_as_one_payload(tmp_path: Path) -> None:
    """A tool returning 1,000 items each under the threshold: the list moves, not the items."""
    store = DiskMediaStore(tmp_path)
    items = [{'id': i, 'text': f'{i}:' + 'y' * 500} for i in range(1000)]
    history: list[ModelMessage] = [
        ModelRequest(parts=[ToolReturnPart('export', {'rows': items, 'count': 1000}, tool_call_id='c')])
    ]
    lean = await externalize_media(history, store, threshold_bytes=4 * KIB)
    record = ModelMessagesTypeAdapter.dump_json(lean)

    assert len(record) < 1024
    assert len(list(tmp_path.glob('*.bin'))) == 1
    assert await restore_media(ModelMessagesTypeAdapter.validate_json(record), store) == json_round_trip(
        history
    )


@pytest.mark.fast
async def test_a_json_payload_keeps_its_own_references_and_escapes(tmp_path: Path) -> None:
    store = DiskMediaStore(tmp_path)
    rows: list[Any] = [REFERENCE_PREFIX + 'not a reference', 'z' * 5 * KIB, *(['w' * 300] * 20)]
    history: list[ModelMessage] = [ModelRequest(parts=[ToolReturnPart('t', rows, tool_call_id='c')])]
    lean = await externalize_media(history, store, threshold_bytes=4 * KIB)
    assert len(list(tmp_path.glob('*.bin'))) == 2  # the big row, then the list that refers to it
    restored = await restore_media(json_round_trip(lean), store)
    assert restored == json_round_trip(history)


@pytest.mark.fast
async def test_externalize_hashes_off_the_event_loop(tmp_path: Path) -> None:
    """The walk (and its hashing) runs in a worker thread: the loop keeps serving other tasks."""
    store = DiskMediaStore(tmp_path)
    loop_thread = threading.get_ident()
    seen: list[int] = []
    original = media_walker.media_uri_for

    def spying(data: bytes) -> str:
        seen.append(threading.get_ident())
        return original(data)

    media_walker.media_uri_for = spying  # type: ignore[attr-defined]
    try:
        await externalize_media([ModelRequest(parts=[UserPromptPart('v' * 2 * KIB)])], store, KIB)
    finally:
        media_walker.media_uri_for = original  # type: ignore[attr-defined]
    assert seen and loop_thread not in seen


@pytest.mark.fast
@pytest.mark.parametrize('key', ['.', './.', './'])
async def test_disk_refuses_keys_that_name_the_directory_itself(tmp_path: Path, key: str) -> None:
    store = DiskMediaStore(tmp_path / 'media', key_strategy=lambda uri, ctx: key)
    with pytest.raises(ValueError, match='must be a relative path inside the directory'):
        await store.put(b'x')


@pytest.mark.fast
async def test_disk_refuses_a_symlink_that_leads_outside(tmp_path: Path) -> None:
    outside = tmp_path / 'outside'
    outside.mkdir()
    media = tmp_path / 'media'
    media.mkdir()
    (media / 'escape').symlink_to(outside)
    (media / 'real').mkdir()
    (media / 'inside').symlink_to(media / 'real')  # a link that stays inside is fine
    store = DiskMediaStore(media, key_strategy=lambda uri, ctx: f'escape/{parse_media_uri(uri)}.bin')
    with pytest.raises(ValueError, match='resolves to'):
        await store.put(b'x')
    with pytest.raises(ValueError, match='resolves to'):
        await store.get(media_uri_for(b'x'))
    assert list(outside.iterdir()) == []

    inside = DiskMediaStore(media, key_strategy=lambda uri, ctx: f'inside/{parse_media_uri(uri)}.bin')
    uri = await inside.put(b'y')
    assert await inside.get(uri) == b'y'
