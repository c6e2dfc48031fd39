"""The wire contract: round trips, outside consumers, evolution, and bytes that are not ours."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from fastavro import parse_schema, schemaless_reader
from fastavro.schema import fingerprint, to_parsing_canonical_form
from fastavro.write import schemaless_writer

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
    decode,
    encode,
    load_schema_versions,
)

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


def every_record() -> list[StepEvent | ToolEffectTransition]:
    records: list[StepEvent | ToolEffectTransition] = []
    for i, kind in enumerate(sorted(EVENT_KINDS)):
        snapshot = (
            SnapshotDelta(snapshot_seq=3, state='interrupted', prefix_len=7, messages='[{"kind":"request"}]')
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


@pytest.mark.parametrize('record', every_record(), ids=lambda r: getattr(r, 'kind', None) or r.status)
def test_every_kind_round_trips(record: StepEvent | ToolEffectTransition) -> None:
    data = encode(record)
    assert data[:2] == b'\xc3\x01'
    assert decode(data) == record


@pytest.mark.parametrize(
    'data',
    [b'', b'{"json": true}', b'\xc3\x01\x00\x00\x00\x00\x00\x00\x00\x00body', b'\xc3'],
    ids=['empty', 'json', 'unknown-fingerprint', 'truncated-header'],
)
def test_bytes_that_are_not_ours_raise_schema_error(data: bytes) -> None:
    with pytest.raises(SchemaError):
        decode(data)


def test_corrupt_body_raises_schema_error() -> None:
    data = encode(every_record()[0])
    with pytest.raises(SchemaError, match='corrupt'):
        decode(data[:12])


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
    assert decoded.snapshot.patch is None and decoded == replace(snapshot, trace_id=None, span_id=None)
    assert decode(
        encode(StepEvent(**{**value, 'snapshot': SnapshotDelta(**patched['snapshot'])}))
    )  # v2 round trip


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
        settings.step_events_topic,
        settings.tool_effects_topic,
        bootstrap_servers=settings.bootstrap_servers,
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
                    headers = dict(message.headers)
                    assert headers['stepstream-schema'] == message.value[2:10].hex().encode()
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
    }
    assert all(v['timestamp'] == NOW for v in decoded)
