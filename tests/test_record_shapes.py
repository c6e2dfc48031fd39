"""One declaration per record shape: the API's models read the read-side records by field name.

Adding a field to a record is one change (the record) plus the API field that shows it, or its
name in `INTERNAL` here: a field neither shows nor lists fails below, as does an API field that
reads an attribute the record does not have.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest
from pydantic import BaseModel

from stepstream.schemas import (
    EffectResolution,
    ModelUsage,
    RunRecord,
    RunUsage,
    SnapshotDelta,
    StepEvent,
    ToolEffectRecord,
)
from stepstream.serve._models import Event, ModelRequestUsage, Resolution, Run, ToolEffect, Usage

pytestmark = pytest.mark.fast

INTERNAL: dict[type, set[str]] = {
    RunRecord: {'last_record_at'},  # `status` is judged by it; the API shows the status
    ToolEffectRecord: {'status_seq'},  # what a resolution answers; `resolution.resolves_seq` shows it
    StepEvent: {'snapshot'},  # the event names its snapshot (snapshot_seq, snapshot_state), not its delta
}
"""Record fields the API leaves out on purpose, each with why."""

DERIVED: dict[type[BaseModel], set[str]] = {
    Event: {'snapshot_seq', 'snapshot_state'},  # read through `snapshot`
    ToolEffect: {'unknown_after_crash'},  # a property of the record
}
"""API fields that are not a record field of the same name."""

PAIRS = [
    (RunRecord, Run),
    (RunUsage, Usage),
    (StepEvent, Event),
    (ModelUsage, ModelRequestUsage),
    (ToolEffectRecord, ToolEffect),
    (EffectResolution, Resolution),
]


@pytest.mark.parametrize(('record', 'shape'), PAIRS, ids=[shape.__name__ for _, shape in PAIRS])
def test_every_record_field_is_shown_or_named_internal(record: type, shape: type[BaseModel]) -> None:
    fields = {f.name for f in dataclasses.fields(record)}
    shown = set(shape.model_fields) - DERIVED.get(shape, set())
    assert fields - INTERNAL.get(record, set()) == shown


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


EXPORTED_AS: dict[type, dict[str, str | None]] = {
    RunRecord: {
        'gaps': 'missing_seqs',
        'usage': None,  # flattened: one column per usage field
        'last_record_at': None,  # internal, as in the API
        'conflicting_writers': None,  # a run with conflicts is in `stepstream conflicts`, not analytics
        'rejected': None,  # dead letters are counted by the projection's status, not per run here
    },
}
"""Record fields the `runs` table shows under another name, or (None) does not show, each with why."""


def test_every_run_field_is_a_runs_column_or_named() -> None:
    from stepstream.analytics._tables import RunRow

    columns = set(RunRow.model_fields)
    for name in (f.name for f in dataclasses.fields(RunRecord)):
        shown = EXPORTED_AS[RunRecord].get(name, name)
        assert shown is None or shown in columns, name
    assert {f.name for f in dataclasses.fields(RunUsage)} <= columns


def test_each_row_builder_fills_exactly_its_tables_columns() -> None:
    pytest.importorskip('pyarrow')
    from pydantic_ai.messages import ModelRequest, UserPromptPart

    from stepstream.analytics import _export
    from stepstream.analytics._tables import ROWS, arrow_schema

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
    messages = [ModelRequest(parts=[UserPromptPart('hi')])]
    rows = {
        'runs': _export._run_row(run),
        'events': _export._event_row(event),
        'model_requests': _export._request_row(event),
        'tool_effects': _export._effect_row(effect, run),
        'messages': _export._message_rows(run, messages, 0, 'complete')[0],
    }
    for table, row in rows.items():
        if table in _export.STATE_TABLES:
            row['export_seq'] = 1  # the export stamps it on every state row it writes
        assert set(row) == set(ROWS[table].model_fields), table
        ROWS[table].model_validate(row)  # each value has its column's type
        assert arrow_schema(ROWS[table]).names == list(ROWS[table].model_fields)
