"""The analytics tables, each row declared once as a Pydantic model; the Parquet schemas derive from them.

A column is one field here: `arrow_schema` turns the field's type into the Parquet column's
(`str` → string, `int` → int64, `datetime` → UTC microseconds, `Cost` → decimal, `dict[str, str]` → map,
`list[str]` → list), and tests/test_record_shapes.py holds each row builder of `_export.py` to its
model and each read-side record's fields to the columns that show them.
"""

from __future__ import annotations

import types
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin

from pydantic import BaseModel

if TYPE_CHECKING:
    import pyarrow as pa

COST_SCALE = 18
"""Decimal places of the `cost_usd` columns (`decimal(38, 18)`): costs are rounded half-even to them."""


class RunRow(BaseModel):
    """`runs`: one row per run, with its lineage, status and usage sums (`RunRecord`, flattened)."""

    run_id: str
    agent_name: str | None
    conversation_id: str | None
    parent_run_id: str | None
    parent_expired: bool
    status: str
    started_at: datetime | None
    ended_at: datetime | None
    error: str | None
    metadata: dict[str, str]
    registration_id: str | None
    event_count: int
    last_seq: int
    missing_seqs: int
    model_requests: int
    requests: int
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    cost_usd: Decimal | None
    unpriced_requests: int
    model_request_us: int
    tool_calls: int
    tool_call_failures: int
    tool_call_us: int
    export_seq: int
    date: str


class EventRow(BaseModel):
    """`events`: one row per step event, without snapshot payloads."""

    run_id: str
    seq: int
    writer_id: str
    timestamp: datetime
    kind: str
    step_index: int
    agent_name: str | None
    conversation_id: str | None
    parent_run_id: str | None
    tool_call_id: str | None
    tool_name: str | None
    error: str | None
    idempotency_key: str | None
    snapshot_seq: int | None
    duration_us: int | None
    trace_id: str | None
    span_id: str | None
    date: str


class ModelRequestRow(BaseModel):
    """`model_requests`: one row per model request that ended, with its model, tokens, cost and time."""

    run_id: str
    seq: int
    timestamp: datetime
    agent_name: str | None
    conversation_id: str | None
    step_index: int
    failed: bool
    error: str | None
    model_name: str | None
    provider: str | None
    input_tokens: int | None
    output_tokens: int | None
    cache_read_tokens: int | None
    cache_write_tokens: int | None
    requests: int | None
    finish_reason: str | None
    cost_usd: Decimal | None
    duration_us: int | None
    trace_id: str | None
    span_id: str | None
    date: str


class ToolEffectRow(BaseModel):
    """`tool_effects`: one row per tool call, its merged effect state and its run's status."""

    run_id: str
    agent_name: str | None
    tool_call_id: str
    tool_name: str
    status: str
    unknown_after_crash: bool
    run_status: str
    started_at: datetime | None
    ended_at: datetime | None
    idempotency_key: str | None
    effect_summary: str | None
    error: str | None
    last_seq: int
    resolution: str | None
    resolved_by: str | None
    resolved_at: datetime | None
    resolution_note: str | None
    export_seq: int
    date: str


class MessageRow(BaseModel):
    """`messages`: the run's newest snapshot replayed, one row per message, as Pydantic AI's JSON."""

    run_id: str
    agent_name: str | None
    snapshot_seq: int
    snapshot_state: str
    message_index: int
    kind: str
    timestamp: datetime | None
    model_name: str | None
    part_kinds: list[str]
    message_json: str
    export_seq: int
    date: str


ROWS: dict[str, type[BaseModel]] = {
    'runs': RunRow,
    'events': EventRow,
    'model_requests': ModelRequestRow,
    'tool_effects': ToolEffectRow,
    'messages': MessageRow,
}
"""Every table and the model of its rows, in the order an export writes them."""


def arrow_type(annotation: Any) -> pa.DataType:
    """The Parquet (Arrow) type of a row field's type; `T | None` is a nullable `T`."""
    import pyarrow as pa

    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return arrow_type(inner)
    if origin is dict:
        return pa.map_(arrow_type(args[0]), arrow_type(args[1]))
    if origin is list:
        return pa.list_(arrow_type(args[0]))
    simple: dict[Any, pa.DataType] = {
        str: pa.string(),
        int: pa.int64(),
        bool: pa.bool_(),
        datetime: pa.timestamp('us', tz='UTC'),
        Decimal: pa.decimal128(38, COST_SCALE),
    }
    if annotation not in simple:
        raise TypeError(f'no Parquet column type for {annotation!r}: add it to arrow_type')
    return simple[annotation]


def arrow_schema(row: type[BaseModel]) -> pa.Schema:
    """The Parquet schema of a table whose rows are `row`: one column per field, in declaration order."""
    import pyarrow as pa

    return pa.schema([(name, arrow_type(f.annotation)) for name, f in row.model_fields.items()])
