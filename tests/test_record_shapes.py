"""One declaration per record shape: the API's models and the export's tables derive from the records.

A field added to a record shows in the API (with its docstring as the description) and as a column
of its table, unless the record declares it `internal` or the table says how it shows it: these
tests hold the derivation to that, the derived shapes to the values they read, and the committed
`.avsc` files to the wire records' declarations.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from stepstream.analytics._tables import record_columns
from stepstream.schemas import (
    EffectResolution,
    ModelUsage,
    RunRecord,
    RunUsage,
    SnapshotDelta,
    StepEvent,
    ToolEffectRecord,
    ToolEffectTransition,
    load_schema_versions,
)
from stepstream.serve._models import (
    Event,
    FromRecord,
    ModelRequestUsage,
    Resolution,
    Run,
    ToolEffect,
    Usage,
    shows,
)
from stepstream.shapes import field_docs, internal, is_internal

pytestmark = pytest.mark.fast

PAIRS = [
    (RunRecord, Run),
    (RunUsage, Usage),
    (StepEvent, Event),
    (ModelUsage, ModelRequestUsage),
    (ToolEffectRecord, ToolEffect),
    (EffectResolution, Resolution),
]

DERIVED: dict[type[BaseModel], set[str]] = {
    Event: {'snapshot_seq', 'snapshot_state'},  # read through `snapshot`
    ToolEffect: {'unknown_after_crash'},  # a property of the record
}
"""API fields that are not a record field of the same name."""


@pytest.mark.parametrize(('record', 'shape'), PAIRS, ids=[shape.__name__ for _, shape in PAIRS])
def test_a_shape_shows_every_field_but_the_internal_ones(record: type, shape: type[BaseModel]) -> None:
    shown = [f.name for f in dataclasses.fields(record) if not is_internal(f)]
    assert list(shape.model_fields) == shown + sorted(
        DERIVED.get(shape, set()), key=list(shape.model_fields).index
    )
    docs = field_docs(record)
    for name in shown:
        assert shape.model_fields[name].description == docs.get(name)


@dataclasses.dataclass(kw_only=True, slots=True)
class Widget:
    """A record as a newcomer would add one."""

    widget_id: str
    kind: Literal['a', 'b']
    """What it is."""
    size: int = 0
    part: EffectResolution | None = None
    secret_seq: int = dataclasses.field(default=-1, metadata=internal('bookkeeping'))


def test_a_new_record_and_a_new_field_show_everywhere_with_nothing_else_written() -> None:
    @shows(Widget)
    class WidgetShape(FromRecord):
        """A widget."""

    assert list(WidgetShape.model_fields) == ['widget_id', 'kind', 'size', 'part']
    assert WidgetShape.model_fields['kind'].description == 'What it is.'
    assert WidgetShape.model_fields['kind'].annotation is str  # a Literal is shown as str
    shown = WidgetShape.of(Widget(widget_id='w', kind='a', part=None))
    assert shown.model_dump() == {'widget_id': 'w', 'kind': 'a', 'size': 0, 'part': None}
    columns = record_columns(Widget, flattened={'part': {'note': 'part_note', 'applied': None}})
    assert [c.name for c in columns] == [
        'widget_id',
        'kind',
        'size',
        'resolution',
        'resolved_by',
        'writer_id',
        'resolved_at',
        'part_note',
        'resolves_seq',
        'args',
        'result',
        'error',
    ]
    assert {c.name: c.type for c in columns}['size'] is int
    assert {c.name: c.type for c in columns}['resolves_seq'] == int | None  # a nested record that may be None
    with pytest.raises(TypeError, match='declare it there'):

        @shows(Widget)
        class Twice(FromRecord):
            size: int


@pytest.mark.parametrize('record', [StepEvent, ToolEffectTransition, SnapshotDelta, ModelUsage])
def test_the_newest_avsc_declares_exactly_the_wire_records_fields(record: type) -> None:
    newest = {
        name: json.loads(versions[-1].path.read_text()) for name, versions in load_schema_versions().items()
    }

    def avro_fields(schema: dict[str, Any], name: str) -> dict[str, Any] | None:
        if schema.get('name') == name:
            return {f['name']: f for f in schema['fields']}
        for f in schema.get('fields', []):
            for branch in f['type'] if isinstance(f['type'], list) else [f['type']]:
                if isinstance(branch, dict) and branch.get('type') == 'record':
                    found = avro_fields(branch, name)
                    if found is not None:
                        return found
        return None

    avro_name = {
        StepEvent: 'StepEvent',
        ToolEffectTransition: 'ToolEffectTransition',
        SnapshotDelta: 'SnapshotDelta',
        ModelUsage: 'ModelUsage',
    }[record]
    found = [f for s in newest.values() if (f := avro_fields(s, avro_name)) is not None]
    assert found, avro_name
    declared = {f.name: f for f in dataclasses.fields(record)}
    assert set(found[0]) == set(declared)
    for name, avro in found[0].items():
        nullable = isinstance(avro['type'], list) and 'null' in avro['type']
        assert nullable == (declared[name].default is None), name


def test_the_shapes_read_a_record_whole_with_nested_parts() -> None:
    at = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    resolution = EffectResolution(
        resolution='happened',
        resolved_by='ops',
        writer_id='w',
        resolved_at=at,
        note='n',
        resolves_seq=3,
        applied=True,
    )
    effect = ToolEffectRecord(
        tool_call_id='c',
        tool_name='t',
        run_id='r',
        status='resolved',
        last_seq=4,
        status_seq=3,
        resolution=resolution,
        resolutions=[resolution],
    )
    shown = ToolEffect.of(effect)
    assert shown.resolution == Resolution.of(resolution) and shown.resolutions == [shown.resolution]
    assert shown.unknown_after_crash is False and shown.in_flight is False

    run = RunRecord(run_id='r', status='failed', usage=RunUsage(requests=2, cost_usd='0.5'), gaps=[(1, 2)])
    assert Run.of(run).usage.requests == 2 and Run.of(run).gaps == [(1, 2)]

    delta = SnapshotDelta(snapshot_seq=7, state='interrupted', prefix_len=0, messages='[]')
    saved = StepEvent(run_id='r', seq=5, writer_id='w', timestamp=at, kind='snapshot_saved', snapshot=delta)
    event = Event.of(saved)
    assert (event.snapshot_seq, event.snapshot_state) == (7, 'interrupted')
    plain = Event.of(dataclasses.replace(saved, kind='run_started', snapshot=None))
    assert (plain.snapshot_seq, plain.snapshot_state, plain.usage) == (None, None, None)


def test_each_row_builder_fills_exactly_its_tables_columns() -> None:
    pytest.importorskip('pyarrow')
    from pydantic_ai.messages import ModelRequest, UserPromptPart

    from stepstream.analytics import _export
    from stepstream.analytics._tables import (
        EVENTS,
        MODEL_REQUESTS,
        RESOLUTIONS,
        ROWS,
        RUNS,
        TOOL_EFFECTS,
        arrow_schema,
    )

    at = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    run = RunRecord(run_id='r', started_at=at, usage=RunUsage(cost_usd='0.25'))
    event = StepEvent(
        run_id='r',
        seq=1,
        writer_id='w',
        timestamp=at,
        kind='model_request_completed',
        usage=ModelUsage(model_name='m', provider='p', cost_usd='0.25'),
    )
    effect = ToolEffectRecord(tool_call_id='c', tool_name='t', run_id='r', status='started')
    decision = EffectResolution(
        resolution='approved',
        resolved_by='alice',
        writer_id='w',
        resolved_at=at,
        note='',
        resolves_seq=3,
        args='{"amount": 1}',
        applied=True,
    )
    messages = [ModelRequest(parts=[UserPromptPart('hi')])]
    rows = {
        'runs': RUNS.make(run),
        'events': EVENTS.make(event),
        'model_requests': MODEL_REQUESTS.make(event),
        'tool_effects': TOOL_EFFECTS.make((effect, run)),
        'resolutions': RESOLUTIONS.make((effect, decision, run)),
        'messages': _export._message_rows(run, messages, 0, 'complete')[0],
    }
    assert set(rows) == set(ROWS)  # every table the export writes has its row built here
    for table, row in rows.items():
        if table in _export.STATE_TABLES:
            row['export_seq'] = 1  # the export stamps it on every state row it writes
        assert set(row) == set(ROWS[table].model_fields), table
        ROWS[table].model_validate(row)  # each value has its column's type
        assert arrow_schema(ROWS[table]).names == list(ROWS[table].model_fields)
