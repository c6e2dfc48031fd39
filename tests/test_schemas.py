"""The wire contract: round trips, outside consumers, evolution, and bytes that are not ours."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import warnings
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from fastavro import parse_schema, schemaless_reader
from fastavro.schema import fingerprint, to_parsing_canonical_form
from fastavro.write import schemaless_writer
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from pydantic_ai.messages import (
    BinaryContent,
    FilePart,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    SystemPromptPart,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.usage import RequestUsage

from stepstream import SchemaError, Settings
from stepstream.producer import EventLog
from stepstream.schemas import (
    EVENT_KINDS,
    SCHEMA_DIR,
    TOOL_EFFECT_STATUSES,
    ModelUsage,
    SnapshotDelta,
    StepEvent,
    ToolEffectTransition,
    apply_patch,
    chain_hash,
    decode,
    encode,
    encode_with_fastavro,
    load_schema_versions,
    message_json,
    message_state,
    patch_json,
    record_maker,
    stamp_changes,
    stamps_since,
    to_confluent,
)
from stepstream.schemas._codec import _to_avro
from stepstream.schemas._patch import _BY_KIND, _MESSAGE
from stepstream.schemas._writer import compile_writer

MEDIA_URI = 'media+sha256://' + '5e' * 32
NOW = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)
USAGE = ModelUsage(
    model_name='gpt-4o',
    provider='openai',
    input_tokens=1000,
    output_tokens=200,
    cache_read_tokens=300,
    cache_write_tokens=0,
    finish_reason='stop',
    cost_usd='0.004125',
)


def envelope(seq: int = 0) -> dict[str, object]:
    return {
        'run_id': 'run-1',
        'seq': seq,
        'writer_id': 'w1',
        'timestamp': NOW,
        'agent_name': 'librarian',
        'conversation_id': 'conv-1',
        'parent_run_id': 'parent-1',
    }


DEFINITIONS = '{"output":{"mode":"text"},"settings":{},"tools":[{"name":"search"}]}'
DEFINITIONS_HASH = hashlib.sha256(DEFINITIONS.encode()).hexdigest()


def every_record() -> list[StepEvent | ToolEffectTransition]:
    records: list[StepEvent | ToolEffectTransition] = []
    for i, kind in enumerate(sorted(EVENT_KINDS)):
        snapshot = (
            SnapshotDelta(
                snapshot_seq=3,
                state='interrupted',
                prefix_len=7,
                messages='[{"kind":"request"}]',
                media=[MEDIA_URI],
            )
            if kind == 'snapshot_saved'
            else None
        )
        records.append(
            StepEvent(
                **envelope(i),  # type: ignore[arg-type]
                kind=kind,  # type: ignore[arg-type]
                step_index=i,
                tool_call_id='call-1' if kind.startswith('tool') else None,
                tool_name='search' if kind.startswith('tool') else None,
                error='ValueError()' if kind.endswith('failed') else None,
                metadata={'team': 'docs'},
                idempotency_key=f'{i}:{kind}',
                snapshot=snapshot,
                usage=USAGE if kind == 'model_request_completed' else None,
                duration_us=1500 + i
                if kind.endswith(('_completed', '_failed')) and kind != 'run_failed'
                else None,
                trace_id='0af7651916cd43dd8448eb211c80319c',
                span_id='b7ad6b7169203331',
                request_fingerprint=DEFINITIONS_HASH if kind == 'model_request_started' else None,
                request_definitions=DEFINITIONS if kind == 'model_request_started' else None,
            )
        )
    for i, status in enumerate(sorted(TOOL_EFFECT_STATUSES)):
        records.append(
            ToolEffectTransition(
                **envelope(100 + i),  # type: ignore[arg-type]
                tool_call_id='call-1',
                tool_name='search',
                status=status,  # type: ignore[arg-type]
                idempotency_key='pr:42' if status == 'annotated' else None,
                effect_summary='opens a PR' if status == 'annotated' else None,
                error='boom' if status == 'failed' else None,
                resolution='did_not_happen' if status == 'resolved' else None,
                resolved_by='alice' if status == 'resolved' else None,
                note='no PR #42 on the repo' if status == 'resolved' else None,
            )
        )
    return records


@pytest.mark.fast
@pytest.mark.parametrize('record', every_record(), ids=lambda r: getattr(r, 'kind', None) or r.status)
def test_every_kind_round_trips(record: StepEvent | ToolEffectTransition) -> None:
    data = encode(record)
    assert data[:2] == b'\xc3\x01'
    assert decode(data) == record


@pytest.mark.fast
@pytest.mark.parametrize(
    'data',
    [b'', b'{"json": true}', b'\xc3\x01\x00\x00\x00\x00\x00\x00\x00\x00body', b'\xc3'],
    ids=['empty', 'json', 'unknown-fingerprint', 'truncated-header'],
)
def test_bytes_that_are_not_ours_raise_schema_error(data: bytes) -> None:
    with pytest.raises(SchemaError):
        decode(data)


@pytest.mark.fast
def test_corrupt_body_raises_schema_error() -> None:
    data = encode(every_record()[0])
    with pytest.raises(SchemaError, match='corrupt'):
        decode(data[:12])


@pytest.mark.fast
def test_every_committed_version_reads_every_other() -> None:
    """Evolution rule: schemas only grow by fields with defaults, so any version reads any other."""
    for name, versions in load_schema_versions().items():
        sample = next(r for r in every_record() if (name == 'step_event') == isinstance(r, StepEvent))
        value = avro_value(sample)
        if value.get('snapshot') is not None:
            value['snapshot'] = None
        for writer in versions:
            out = io.BytesIO()
            schemaless_writer(out, writer.parsed, value)
            for reader in versions:
                decoded = schemaless_reader(io.BytesIO(out.getvalue()), writer.parsed, reader.parsed)
                assert isinstance(decoded, dict) and decoded['run_id'] == 'run-1', (
                    name,
                    writer.version,
                    reader.version,
                )


def avro_value(record: StepEvent | ToolEffectTransition) -> dict[str, object]:
    """The record as the Avro writer takes it (nested records as dicts)."""
    value: dict[str, object] = {k: getattr(record, k) for k in record.__slots__}
    for name in ('snapshot', 'usage'):
        nested = value.get(name)
        if nested is not None:
            value[name] = {k: getattr(nested, k) for k in nested.__slots__}
    return value


@pytest.mark.fast
def test_usage_cross_versions() -> None:
    """A v3 event (usage, duration, trace) reads as v1 and v2 without them; theirs decode with none."""
    versions = load_schema_versions()['step_event']
    v3 = versions[2]
    assert v3.version == 3
    for record in every_record():
        if not isinstance(record, StepEvent):
            continue
        out = io.BytesIO()
        schemaless_writer(out, v3.parsed, avro_value(record))
        for older in versions[:2]:
            read = schemaless_reader(io.BytesIO(out.getvalue()), v3.parsed, older.parsed)
            assert isinstance(read, dict)
            assert {'usage', 'duration_us', 'trace_id', 'span_id'}.isdisjoint(read)
            assert read['kind'] == record.kind and read['seq'] == record.seq

            old = io.BytesIO()
            old.write(b'\xc3\x01' + older.fingerprint)
            schemaless_writer(old, older.parsed, read)
            decoded = decode(old.getvalue())
            assert isinstance(decoded, StepEvent)
            assert decoded.usage is None and decoded.duration_us is None and decoded.trace_id is None
            assert decoded.kind == record.kind and decoded.error == record.error
    completed = next(r for r in every_record() if getattr(r, 'kind', None) == 'model_request_completed')
    assert decode(encode(completed)) == completed and isinstance(completed, StepEvent)
    assert completed.usage == USAGE


@pytest.mark.fast
def test_snapshot_patches_cross_versions() -> None:
    """A v2 snapshot (with a patch) reads as v1 without it; a v1 snapshot decodes with no patch."""
    v1, v2 = load_schema_versions()['step_event'][:2]
    snapshot = next(r for r in every_record() if isinstance(r, StepEvent) and r.snapshot is not None)
    assert snapshot.snapshot is not None
    value = {k: getattr(snapshot, k) for k in snapshot.__slots__}
    delta = {k: getattr(snapshot.snapshot, k) for k in SnapshotDelta.__slots__}
    patched = {**value, 'snapshot': {**delta, 'patch': '[{"at":6,"set":{"run_id":"r"}}]'}}
    out = io.BytesIO()
    schemaless_writer(out, v2.parsed, patched)
    as_v1 = schemaless_reader(io.BytesIO(out.getvalue()), v2.parsed, v1.parsed)
    assert isinstance(as_v1, dict) and 'patch' not in as_v1['snapshot']

    old = io.BytesIO()
    old.write(b'\xc3\x01' + v1.fingerprint)
    schemaless_writer(old, v1.parsed, {**value, 'snapshot': {k: v for k, v in delta.items() if k != 'patch'}})
    decoded = decode(old.getvalue())
    assert isinstance(decoded, StepEvent) and decoded.snapshot is not None
    assert decoded.snapshot.patch is None
    assert decoded == replace(
        snapshot, trace_id=None, span_id=None, snapshot=replace(snapshot.snapshot, media=None)
    )
    assert decode(
        encode(StepEvent(**{**value, 'snapshot': SnapshotDelta(**patched['snapshot'])}))
    )  # v2 round trip


@pytest.mark.fast
def test_snapshot_media_lists_cross_versions() -> None:
    """A v4 snapshot's media list reads away as v3; a v3 snapshot decodes with none (None, not []),
    so a reader knows to read its references from the content (decision 0041)."""
    v3, v4 = load_schema_versions()['step_event'][2:4]
    snapshot = next(r for r in every_record() if isinstance(r, StepEvent) and r.snapshot is not None)
    assert snapshot.snapshot is not None and snapshot.snapshot.media == [MEDIA_URI]
    assert decode(encode(snapshot)) == snapshot
    value = {k: getattr(snapshot, k) for k in snapshot.__slots__}
    delta = {k: getattr(snapshot.snapshot, k) for k in SnapshotDelta.__slots__}
    out = io.BytesIO()
    schemaless_writer(out, v4.parsed, {**value, 'snapshot': delta})
    as_v3 = schemaless_reader(io.BytesIO(out.getvalue()), v4.parsed, v3.parsed)
    assert isinstance(as_v3, dict) and 'media' not in as_v3['snapshot']
    old = io.BytesIO()
    old.write(b'\xc3\x01' + v3.fingerprint)
    schemaless_writer(old, v3.parsed, as_v3)
    decoded = decode(old.getvalue())
    assert isinstance(decoded, StepEvent) and decoded.snapshot is not None
    assert decoded.snapshot.media is None
    assert decoded == replace(snapshot, snapshot=replace(snapshot.snapshot, media=None))


@pytest.mark.fast
def test_chain_links_cross_versions() -> None:
    """A v5 event's and a v3 transition's link read away as v4 and v2; their records decode unlinked
    (None: `unchained`, never broken), and a link hashes a record's body alike in either wire format."""
    for name, old_index, record in (
        ('step_event', 3, next(r for r in every_record() if isinstance(r, StepEvent))),
        ('tool_effect_transition', 1, next(r for r in every_record() if isinstance(r, ToolEffectTransition))),
    ):
        old, new = load_schema_versions()[name][old_index : old_index + 2]
        linked = replace(record, prev_hash=hashlib.sha256(b'previous').hexdigest())
        assert decode(encode(linked)) == linked
        out = io.BytesIO()
        schemaless_writer(out, new.parsed, _to_avro(linked))
        as_old = schemaless_reader(io.BytesIO(out.getvalue()), new.parsed, old.parsed)
        assert isinstance(as_old, dict) and 'prev_hash' not in as_old
        framed = io.BytesIO()
        framed.write(b'\xc3\x01' + old.fingerprint)
        schemaless_writer(framed, old.parsed, as_old)
        assert decode(framed.getvalue()) == record  # unlinked
        single = encode(linked)
        body = hashlib.sha256(single[10:]).hexdigest()  # the body: after magic and fingerprint
        assert chain_hash(single) == chain_hash(to_confluent(single, 7)) == body


@pytest.mark.fast
def test_request_definitions_cross_versions() -> None:
    """A v6 model request's fingerprint and definitions read away as v5; a v5 event decodes without
    them (replay then says the check was skipped)."""
    v5, v6 = load_schema_versions()['step_event'][4:6]
    started = next(
        r for r in every_record() if isinstance(r, StepEvent) and r.kind == 'model_request_started'
    )
    assert started.request_definitions is not None and decode(encode(started)) == started
    out = io.BytesIO()
    schemaless_writer(out, v6.parsed, _to_avro(started))
    as_v5 = schemaless_reader(io.BytesIO(out.getvalue()), v6.parsed, v5.parsed)
    assert (
        isinstance(as_v5, dict) and 'request_fingerprint' not in as_v5 and 'request_definitions' not in as_v5
    )
    framed = io.BytesIO()
    framed.write(b'\xc3\x01' + v5.fingerprint)
    schemaless_writer(framed, v5.parsed, as_v5)
    assert decode(framed.getvalue()) == replace(started, request_fingerprint=None, request_definitions=None)


@pytest.mark.fast
def test_resolutions_cross_versions() -> None:
    """A v2 resolution reads as v1 without its new fields (an older reader then refuses its status
    as `unknown_version`); a v1 transition decodes with none of them."""
    v1, v2 = load_schema_versions()['tool_effect_transition'][:2]
    resolved = next(
        r for r in every_record() if isinstance(r, ToolEffectTransition) and r.status == 'resolved'
    )
    value = {k: getattr(resolved, k) for k in resolved.__slots__}
    out = io.BytesIO()
    schemaless_writer(out, v2.parsed, value)
    as_v1 = schemaless_reader(io.BytesIO(out.getvalue()), v2.parsed, v1.parsed)
    assert isinstance(as_v1, dict) and as_v1['status'] == 'resolved'
    assert not {'resolution', 'resolved_by', 'note'} & set(as_v1)
    assert decode(encode(resolved)) == resolved  # v2 round trip

    started = next(r for r in every_record() if isinstance(r, ToolEffectTransition) and r.status == 'started')
    old = io.BytesIO()
    old.write(b'\xc3\x01' + v1.fingerprint)
    v1_fields = {f['name'] for f in json.loads(v1.path.read_text())['fields']}
    schemaless_writer(old, v1.parsed, {k: getattr(started, k) for k in started.__slots__ if k in v1_fields})
    decoded = decode(old.getvalue())
    assert decoded == started and isinstance(decoded, ToolEffectTransition) and decoded.resolution is None


@pytest.mark.broker
async def test_outside_consumer_decodes_with_only_the_avsc_files(
    settings: Settings, event_log: EventLog
) -> None:
    """An analytics team with nothing but aiokafka, fastavro and schemas/avro/*.avsc."""
    for record in every_record():
        await event_log.append(record)
    await event_log.flush()

    by_fingerprint = {}
    for path in Path(SCHEMA_DIR).glob('*.avsc'):
        raw = json.loads(path.read_text())
        fp = bytes.fromhex(fingerprint(to_parsing_canonical_form(raw), 'CRC-64-AVRO'))
        by_fingerprint[fp] = parse_schema(raw, named_schemas={})

    consumer = AIOKafkaConsumer(
        settings.topics.step_events_topic,
        settings.topics.tool_effects_topic,
        bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset='earliest',
        enable_auto_commit=False,
    )
    await consumer.start()
    decoded: list[dict[str, object]] = []
    try:
        while len(decoded) < len(every_record()):
            for records in (await consumer.getmany(timeout_ms=2000)).values():
                for message in records:
                    assert message.value is not None and message.value[:2] == b'\xc3\x01'
                    schema = by_fingerprint[message.value[2:10]]
                    value = schemaless_reader(io.BytesIO(message.value[10:]), schema, None)
                    assert isinstance(value, dict)
                    assert message.key == str(value['run_id']).encode()
                    # The kind and the schema are headers too, for routing without decoding (the
                    # contract's headers: the fingerprint in hex, as in the value's bytes 2 to 10).
                    headers = dict(message.headers)
                    assert headers == {
                        'stepstream-kind': str(value.get('kind') or value['status']).encode(),
                        'stepstream-schema': message.value[2:10].hex().encode(),
                    }
                    decoded.append(value)
    finally:
        await consumer.stop()
    kinds = {v.get('kind') or v.get('status') for v in decoded}
    assert kinds == EVENT_KINDS | TOOL_EFFECT_STATUSES
    snapshot = next(v for v in decoded if v.get('kind') == 'snapshot_saved')
    assert snapshot['snapshot'] == {
        'snapshot_seq': 3,
        'state': 'interrupted',
        'prefix_len': 7,
        'messages': '[{"kind":"request"}]',
        'patch': None,
        'media': [MEDIA_URI],
    }
    assert all(v['timestamp'] == NOW for v in decoded)


def lean_json_cases() -> list[ModelMessage]:
    """Messages with None in every place it can be: fields, tool arguments, returns, metadata."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # RetryPromptPart is deprecated, and still in old histories
        retry = RetryPromptPart('try again', tool_name=None)
    return [
        ModelRequest(
            parts=[UserPromptPart('hi'), SystemPromptPart('be brief')], run_id=None, instructions=None
        ),
        ModelRequest(
            parts=[
                ToolReturnPart('t', None, 'c1'),
                ToolReturnPart('t', {'a': None, 'b': [None, {'c': None}]}, 'c2', metadata={'m': None}),
                retry,
            ],
            run_id='r',
            conversation_id='conv',
        ),
        ModelResponse(
            parts=[
                TextPart('x'),
                ThinkingPart('hmm', signature=None),
                ToolCallPart('t', None, 'c3'),
                ToolCallPart('t', {'z': None}, 'c4', id='call-id'),
                ToolCallPart('t', '{"raw": null}', 'c5'),
                FilePart(BinaryContent(b'\x89PNG', media_type='image/png')),
            ],
            model_name=None,
            provider_details={'k': None},
        ),
        ModelResponse(
            parts=[TextPart('counted')],
            usage=RequestUsage(
                input_tokens=0, output_tokens=7, audio_seconds=0.0, details={'x': 0}, cost=None
            ),
        ),
        ModelResponse(parts=[], usage=RequestUsage(cache_read_tokens=3, cost=Decimal('0.25'))),
    ]


@pytest.mark.fast
@pytest.mark.parametrize('message', lean_json_cases())
def test_lean_message_json_reads_back_as_the_full_json_does(message: ModelMessage) -> None:
    full = ModelMessagesTypeAdapter.dump_json([message])
    lean = message_json(message)
    assert ModelMessagesTypeAdapter.validate_json(
        b'[' + lean + b']'
    ) == ModelMessagesTypeAdapter.validate_json(full)
    assert len(lean) < len(full) - 1


@pytest.mark.fast
@pytest.mark.parametrize('message', lean_json_cases())
def test_each_message_class_adapter_writes_the_unions_json(message: ModelMessage) -> None:
    assert _BY_KIND[type(message)].dump_json(message) == _MESSAGE.dump_json(message)


STAMPS: dict[str, st.SearchStrategy[object]] = {
    'run_id': st.none() | st.text(max_size=8),
    'conversation_id': st.none() | st.text(max_size=8),
    'timestamp': st.datetimes(timezones=st.just(UTC)),
    'metadata': st.none() | st.dictionaries(st.text(max_size=4), st.none() | st.integers(), max_size=2),
}
REQUEST_STAMPS = {**STAMPS, 'instructions': st.none() | st.text(max_size=8)}
RESPONSE_STAMPS = {
    **STAMPS,
    'model_name': st.none() | st.text(max_size=8),
    'finish_reason': st.none() | st.sampled_from(['stop', 'tool_call', 'length']),
    'usage': st.builds(
        RequestUsage,
        input_tokens=st.integers(0, 5),
        output_tokens=st.integers(0, 5),
        details=st.dictionaries(st.sampled_from(['x', 'y']), st.integers(0, 2), max_size=2),
    ),
}


@pytest.mark.fast
@hypothesis_settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stamps_since_a_state_are_the_stamp_changes_of_the_json(data: st.DataObject) -> None:
    """The cheap change test the snapshot writer uses gives the patch the JSON comparison defines."""
    message = data.draw(st.sampled_from(lean_json_cases()))
    message = dataclasses.replace(message, parts=list(message.parts))  # a live message of its own
    before_json, state = message_json(message), message_state(message)
    stamps = REQUEST_STAMPS if isinstance(message, ModelRequest) else RESPONSE_STAMPS
    for name in data.draw(st.lists(st.sampled_from(sorted(stamps)), unique=True, max_size=3)):
        setattr(message, name, data.draw(stamps[name], label=name))  # in place, as the graph stamps
    part_change = data.draw(st.sampled_from(['none', 'rewrite', 'append', 'replace']))
    if part_change == 'rewrite' and message.parts:
        part = message.parts[0]
        message.parts[0] = dataclasses.replace(part, part_kind=part.part_kind)  # an equal copy: no change
    elif part_change == 'append':
        message.parts.append(TextPart('new') if isinstance(message, ModelResponse) else UserPromptPart('new'))
    elif part_change == 'replace' and message.parts and hasattr(message.parts[0], 'content'):
        message.parts[0].content = 'changed in place'  # type: ignore[union-attr]
    after_json = message_json(message)
    found = stamps_since(state, message)
    if after_json == before_json:
        assert found == {}
    else:
        assert found == stamp_changes(before_json, after_json)
        if found is not None:  # the patch gives back the stamped message
            history = [read_lean(before_json)]
            apply_patch(history, patch_json([(0, found)]) or '')
            assert history == [read_lean(after_json)]


def read_lean(lean: bytes) -> ModelMessage:
    return ModelMessagesTypeAdapter.validate_json(b'[' + lean + b']')[0]


@pytest.mark.fast
def test_stamps_from_none_to_a_value_and_back_are_patches() -> None:
    sent = ModelRequest(parts=[ToolReturnPart('t', 'ok', 'c1')])
    stamped = dataclasses.replace(sent, run_id='r', conversation_id='conv')
    changes = stamp_changes(message_json(sent), message_json(stamped))
    assert changes == {'run_id': 'r', 'conversation_id': 'conv'}
    history: list[ModelMessage] = [sent]
    apply_patch(history, patch_json([(0, changes)]) or '')
    assert history == [stamped]
    back = stamp_changes(message_json(stamped), message_json(sent))
    assert back == {'run_id': None, 'conversation_id': None}
    apply_patch(history, patch_json([(0, back)]) or '')
    assert history == [sent]
    changed_part = dataclasses.replace(sent, parts=[ToolReturnPart('t', 'other', 'c1')])
    assert stamp_changes(message_json(sent), message_json(changed_part)) is None


@pytest.mark.fast
@pytest.mark.parametrize('record', every_record(), ids=lambda r: getattr(r, 'kind', None) or r.status)
def test_the_compiled_writer_writes_fastavros_bytes(record: StepEvent | ToolEffectTransition) -> None:
    assert encode(record) == encode_with_fastavro(record)


_text = st.text(max_size=40)
_optional_text = st.none() | _text
_envelope = {
    'run_id': _text,
    'seq': st.integers(min_value=-(2**63), max_value=2**63 - 1),
    'writer_id': _text,
    'timestamp': st.datetimes(timezones=st.just(UTC)),
    'agent_name': _optional_text,
    'conversation_id': _optional_text,
    'parent_run_id': _optional_text,
}
_snapshots = st.none() | st.builds(
    SnapshotDelta,
    snapshot_seq=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    state=st.sampled_from(['complete', 'interrupted']),
    prefix_len=st.integers(min_value=0, max_value=2**31 - 1),
    messages=st.text(max_size=200),
    patch=_optional_text,
)
_records = st.builds(
    StepEvent,
    **_envelope,
    kind=st.sampled_from(sorted(EVENT_KINDS)),
    step_index=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    tool_call_id=_optional_text,
    tool_name=_optional_text,
    error=_optional_text,
    metadata=st.dictionaries(_text, _text, max_size=4),
    idempotency_key=_optional_text,
    snapshot=_snapshots,
    prev_hash=st.none() | st.text('0123456789abcdef', min_size=64, max_size=64),
) | st.builds(
    ToolEffectTransition,
    **_envelope,
    tool_call_id=_text,
    tool_name=_text,
    status=st.sampled_from(sorted(TOOL_EFFECT_STATUSES)),
    idempotency_key=_optional_text,
    effect_summary=_optional_text,
    error=_optional_text,
    resolution=_optional_text,
    resolved_by=_optional_text,
    note=_optional_text,
    prev_hash=st.none() | st.text('0123456789abcdef', min_size=64, max_size=64),
)


@pytest.mark.fast
@given(_records)
@hypothesis_settings(max_examples=300, deadline=None)
def test_the_compiled_writer_writes_fastavros_bytes_for_any_record(
    record: StepEvent | ToolEffectTransition,
) -> None:
    data = encode(record)
    assert data == encode_with_fastavro(record)
    assert decode(data) == record


@pytest.mark.fast
@pytest.mark.parametrize('record', every_record(), ids=lambda r: getattr(r, 'kind', None) or r.status)
def test_record_maker_makes_what_the_class_makes(record: StepEvent | ToolEffectTransition) -> None:
    values = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    made = record_maker(type(record))(**values)
    assert type(made) is type(record)
    assert made == record
    assert repr(made) == repr(record)
    assert encode(made) == encode(record)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.seq = 7  # type: ignore[misc]


@pytest.mark.fast
def test_record_maker_takes_the_class_defaults_and_refuses_what_the_class_refuses() -> None:
    make = record_maker(StepEvent)
    made = make(run_id='r', seq=0, writer_id='w', timestamp=NOW, kind='run_started')
    assert made == StepEvent(run_id='r', seq=0, writer_id='w', timestamp=NOW, kind='run_started')
    assert made.metadata == {}
    assert (
        made.metadata
        is not make(run_id='r', seq=0, writer_id='w', timestamp=NOW, kind='run_started').metadata
    )
    with pytest.raises(TypeError, match='seq'):
        make(run_id='r', writer_id='w', timestamp=NOW, kind='run_started')
    with pytest.raises(TypeError, match='colour'):
        make(run_id='r', seq=0, writer_id='w', timestamp=NOW, kind='run_started', colour='red')

    @dataclasses.dataclass(frozen=True)
    class NotSlotted:
        a: int

    with pytest.raises(TypeError, match='slotted'):
        record_maker(NotSlotted)


@pytest.mark.fast
def test_a_schema_the_compiler_does_not_know_is_left_to_fastavro() -> None:
    assert compile_writer(['string', 'long']) is None
    assert compile_writer({'type': 'long', 'logicalType': 'timestamp-nanos'}) is None
    assert compile_writer({'type': 'map', 'values': ['null', 'double']}) is not None
