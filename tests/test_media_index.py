"""The media index holds exactly what the writer stored, for every shape a payload can take (fast tier).

Issue 33: the index was found by scanning each record's bytes for URIs, and an offloaded binary's
reference is base64 in Pydantic AI's JSON, so every image, audio clip and document was missing
and the retention sweep would have deleted them. Now a snapshot record lists what its offload
stored (`SnapshotDelta.media`, decision 0041). For generated histories holding payloads in every
position a message has (user prompts, tool returns alone, in lists, nested in dicts and as JSON
payloads with references inside, multimodal returns, tool-call arguments, instructions, file
parts, large text), through the real snapshot writer, with erasure off and on:

- the projection's media index (the applier's, on RocksDB and in memory) names exactly the
  objects in the bucket;
- a reader of the projection reads exactly those objects back (`ProjectionReader.media_read`, the
  sweep's last check), and the latest snapshot restores to the history written;
- a record of an earlier writer (no list) is read from its content and never names more.

test_media_e2e.py proves the same through both brokers and S3, live, rebuilt and restored from
a checkpoint.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_ai.messages import (
    BinaryContent,
    FilePart,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from stepstream.erasure import ConversationKey, KeyRing, new_kek, parse_kek
from stepstream.media import REFERENCE_PREFIX, DiskMediaStore, legacy_media, media_uri_for, snapshot_media
from stepstream.producer._sealing import Sealer
from stepstream.producer._snapshots import SnapshotWriter
from stepstream.projector._apply import EVENTS, Applier, SourceRecord
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import SnapshotDelta, StepEvent, decode, encode
from stepstream.settings import Settings
from stepstream.storage import MemoryShard, Shard
from stepstream.storage._keys import MEDIA, RUN_MEDIA

pytestmark = pytest.mark.fast

THRESHOLD = 160
"""Small, so that generated payloads are small and still offloaded."""
TOPICS = ('idx.step-events', 'idx.tool-effects')
T0 = datetime(2026, 12, 2, tzinfo=UTC)
RUN = 'run-media'
CONVERSATION = 'conv-media'
MEDIA_TYPES = [
    'image/png',
    'image/jpeg',
    'audio/wav',
    'audio/mpeg',
    'video/mp4',
    'application/pdf',
    'text/csv',
]


def _payloads() -> st.SearchStrategy[bytes]:
    """Payload bytes from a small pool (so positions share payloads) or fresh, above the threshold."""
    pool = [bytes([i]) * (THRESHOLD + 40 * i) for i in range(4)]
    return st.one_of(st.sampled_from(pool), st.binary(min_size=THRESHOLD, max_size=3 * THRESHOLD))


def _texts() -> st.SearchStrategy[str]:
    """Text at or above the threshold (some of it non-ASCII), or a small one that stays inline."""
    big = st.builds(
        lambda c, n: c * n, st.sampled_from(['a', 'ü', '語', '\x00']), st.integers(THRESHOLD, 2 * THRESHOLD)
    )
    return st.one_of(big, big, st.text(max_size=20))


@st.composite
def binaries(draw: st.DrawFn) -> BinaryContent:
    return BinaryContent(draw(_payloads()), media_type=draw(st.sampled_from(MEDIA_TYPES)))


@st.composite
def parts_of_a_request(draw: st.DrawFn) -> list[Any]:
    """One request's parts: a payload in each position a request has, some of them drawn."""
    position = draw(
        st.lists(
            st.sampled_from(
                [
                    'prompt_text',
                    'prompt_media',
                    'return_binary',
                    'return_list',
                    'return_nested',
                    'return_json',
                    'multimodal_return',
                    'escaped',
                ]
            ),
            min_size=1,
            max_size=4,
        )
    )
    parts: list[Any] = []
    for i, where in enumerate(position):
        call = f'call-{i}'
        if where == 'prompt_text':
            parts.append(UserPromptPart(draw(_texts())))
        elif where == 'prompt_media':
            parts.append(UserPromptPart(['look at this', draw(binaries()), draw(binaries())]))
        elif where == 'return_binary':
            parts.append(ToolReturnPart('fetch', draw(binaries()), tool_call_id=call))
        elif where == 'return_list':
            parts.append(
                ToolReturnPart('fetch', [draw(binaries()), 'caption', draw(_texts())], tool_call_id=call)
            )
        elif where == 'return_nested':
            content = {'report': {'pages': [draw(binaries()), draw(_texts())], 'n': 3}, 'ok': True}
            parts.append(ToolReturnPart('report', content, tool_call_id=call))
        elif where == 'return_json':  # big even lean: one JSON payload, with references inside
            docs = draw(st.lists(_texts(), min_size=3, max_size=6))
            parts.append(
                ToolReturnPart('search', {'docs': docs, 'more': [d[:5] for d in docs]}, tool_call_id=call)
            )
        elif where == 'multimodal_return':  # a `ToolReturn` with content: the return, then its files
            parts.append(ToolReturnPart('camera', 'see the attached photo', tool_call_id=call))
            parts.append(UserPromptPart(['This is file 1:', draw(binaries())]))
        else:  # a value that only looks like a reference, beside a payload: escaped, never counted
            forged = REFERENCE_PREFIX + media_uri_for(b'somebody else')
            parts.append(UserPromptPart([forged, draw(binaries())]))
    return parts


@st.composite
def parts_of_a_response(draw: st.DrawFn) -> list[Any]:
    position = draw(st.lists(st.sampled_from(['text', 'file', 'args', 'args_json']), min_size=1, max_size=3))
    parts: list[Any] = []
    for i, where in enumerate(position):
        if where == 'text':
            parts.append(TextPart(draw(_texts())))
        elif where == 'file':
            parts.append(FilePart(draw(binaries())))
        elif where == 'args':
            parts.append(
                ToolCallPart('send', {'body': draw(_texts()), 'to': ['a@b.c']}, tool_call_id=f'out-{i}')
            )
        else:
            docs = draw(st.lists(_texts(), min_size=3, max_size=5))
            parts.append(ToolCallPart('index', {'documents': docs}, tool_call_id=f'out-{i}'))
    return parts


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[ModelMessage], list[int]]:
    """A history of 2-6 messages with payloads, and where its 1-3 snapshots end."""
    messages: list[ModelMessage] = []
    for turn in range(draw(st.integers(1, 3))):
        instructions = draw(st.one_of(st.none(), _texts()))
        messages.append(ModelRequest(parts=draw(parts_of_a_request()), instructions=instructions))
        messages.append(ModelResponse(parts=draw(parts_of_a_response()), model_name=f'm{turn}'))
    cuts = sorted(set(draw(st.lists(st.integers(1, len(messages)), min_size=1, max_size=3))))
    if cuts[-1] != len(messages):
        cuts.append(len(messages))
    return messages, cuts


def _record(seq: int, kind: str, snapshot: SnapshotDelta | None = None) -> SourceRecord:
    event = StepEvent(
        run_id=RUN,
        seq=seq,
        writer_id='writer',
        timestamp=T0 + timedelta(seconds=seq),
        kind=kind,  # type: ignore[arg-type]
        conversation_id=CONVERSATION,
        snapshot=snapshot,
    )
    return SourceRecord(EVENTS, 0, seq, RUN.encode(), encode(event))


async def _write(
    messages: list[ModelMessage], cuts: list[int], store: DiskMediaStore, key: ConversationKey | None
) -> list[SourceRecord]:
    """The run's records as the capability writes them: registration, then one snapshot per cut."""
    writer = SnapshotWriter(store, THRESHOLD)
    sealer = None
    if key is not None:
        sealer = Sealer(new_kek(), send_key=_never)
        sealer._keys[CONVERSATION] = key  # as if acknowledged on the key topic
    records = [_record(0, 'run_started')]
    for snapshot_seq, cut in enumerate(cuts):
        plan = writer.plan(messages[:cut])
        if sealer is not None:
            delta = await sealer.delta(writer, plan, snapshot_seq, conversation_id=CONVERSATION, run_id=RUN)
        else:
            delta = await writer.delta(plan, snapshot_seq)
        writer.commit(plan)
        records.append(_record(len(records), 'snapshot_saved', delta))
    return records


class HandFedKeys(KeyRing):
    """A key ring fed by hand (`_apply` is what it does with each key record): no key topic to read."""

    async def refresh(self, *, thorough: bool = False) -> None:
        return None


async def _never(key: bytes, value: bytes) -> None:
    raise AssertionError('the key is in the sealer already')


def _stored(directory: Path) -> set[str]:
    return {p.stem for p in directory.rglob('*.bin')}


def _indexed(shard: MemoryShard | Shard) -> set[str]:
    digests = {str(MEDIA.parse(k)[0]) for k, _ in shard.scan(MEDIA.tag)}
    assert {str(RUN_MEDIA.parse(k)[1]) for k, _ in shard.scan(RUN_MEDIA.tag)} == digests
    return digests


@pytest.mark.parametrize('erasure', [False, True], ids=['plain', 'sealed'])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories(), rocksdb=st.booleans())
def test_the_index_names_exactly_what_the_writer_stored(
    history: tuple[list[ModelMessage], list[int]], rocksdb: bool, erasure: bool
) -> None:
    messages, cuts = history
    asyncio.run(_check_index(messages, cuts, rocksdb=rocksdb, erasure=erasure))


async def _check_index(
    messages: list[ModelMessage], cuts: list[int], *, rocksdb: bool, erasure: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = DiskMediaStore(root / 'media')
        kek = new_kek()
        key = ConversationKey.new(CONVERSATION) if erasure else None
        records = await _write(messages, cuts, store, key)
        stored = _stored(root / 'media')

        shard: MemoryShard | Shard = Shard.open(root / 'shard', create=True) if rocksdb else MemoryShard()
        try:
            applier = Applier(TOPICS, partitions=1, retain_ended_us=10**12)
            txn, outcome = applier.stage(shard, records)
            txn.commit()
            assert outcome.dead == []
            assert _indexed(shard) == stored

            keys = None
            if key is not None:
                keys = HandFedKeys(Settings(erasure_key=kek))  # type: ignore[arg-type]
                keys._apply(key.record_key(), key.wrap(parse_kek(kek)))
            reader = ProjectionReader(shard, media_store=store, keys=keys)
            read = await reader.media_read()
            assert {uri.removeprefix('media+sha256://') for uri in read} == stored
            latest = await reader.latest_snapshot(RUN, include_interrupted=True)
            assert latest is not None
            roundtrip = ModelMessagesTypeAdapter.validate_json(ModelMessagesTypeAdapter.dump_json(messages))
            assert latest.messages == roundtrip
        finally:
            shard.close()

        # An earlier writer's record (no list) is read from its content: never more than stored.
        for source in records[1:]:
            event = decode(source.value or b'')
            assert isinstance(event, StepEvent) and event.snapshot is not None
            listed = snapshot_media(event.snapshot.messages, event.snapshot.media)
            assert listed == set(event.snapshot.media or ())
            assert legacy_media(event.snapshot.messages) <= listed


def test_a_legacy_plain_record_is_read_from_its_content_binaries_included(tmp_path: Path) -> None:
    """Before schema v4 a record listed nothing: its binaries' references are base64 in its JSON,
    and they are found there; what a JSON payload holds inside is not visible (the sweep's last
    check reads it instead, decision 0041)."""
    image = BinaryContent(b'\x89PNG' * 100, media_type='image/png')
    docs = [c * THRESHOLD for c in 'xyz']
    messages: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart(['what is this?', image])]),
        ModelResponse(parts=[ToolCallPart('index', {'documents': docs}, tool_call_id='c')]),
    ]
    store = DiskMediaStore(tmp_path)
    records = asyncio.run(_write(messages, [2], store, None))
    event = decode(records[1].value or b'')
    assert isinstance(event, StepEvent) and event.snapshot is not None
    declared = set(event.snapshot.media or ())
    assert len(declared) == 5  # the image, three documents, the JSON payload that holds them
    legacy = legacy_media(event.snapshot.messages)
    assert media_uri_for(image.data) in legacy
    assert legacy == {uri for uri in declared if all(uri != media_uri_for(d.encode()) for d in docs)}
    as_legacy = replace(event.snapshot, media=None)
    assert snapshot_media(as_legacy.messages, as_legacy.media) == legacy


def test_a_record_listing_something_that_is_not_a_media_uri_is_dead_lettered() -> None:
    records = [
        _record(0, 'run_started'),
        _record(
            1,
            'snapshot_saved',
            SnapshotDelta(
                snapshot_seq=0, state='complete', prefix_len=0, messages='[]', media=['../../etc/passwd']
            ),
        ),
    ]
    shard = MemoryShard()
    txn, outcome = Applier(TOPICS, partitions=1, retain_ended_us=10**12).stage(shard, records)
    txn.commit()
    assert [d.reason for d in outcome.dead] == ['invalid']
    assert 'not a media+sha256:// URI' in outcome.dead[0].detail
    assert _indexed(shard) == set()


def test_what_a_reader_reads_includes_the_references_inside_json_payloads(tmp_path: Path) -> None:
    """`media_read` opens JSON payloads to see the references inside; one missing from the store
    is still read itself, with nothing seen inside it (the sweep's check must not fail on it)."""
    from stepstream.media import media_read, offload_media

    docs = [c * THRESHOLD for c in 'pqrs']
    messages: list[ModelMessage] = [
        ModelResponse(parts=[ToolCallPart('index', {'documents': docs}, tool_call_id='c')])
    ]
    store = DiskMediaStore(tmp_path)

    async def scenario() -> None:
        offloaded = await offload_media(messages, store, THRESHOLD)
        assert len(offloaded.media) == 5
        lean = ModelMessagesTypeAdapter.validate_json(ModelMessagesTypeAdapter.dump_json(offloaded.messages))
        assert await media_read(lean, store) == set(offloaded.media)
        (json_uri,) = set(offloaded.media) - {media_uri_for(d.encode()) for d in docs}
        store.path_for(json_uri).unlink()
        assert await media_read(lean, store) == {json_uri}

    asyncio.run(scenario())
