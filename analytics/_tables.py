"""The analytics tables: each a view of a read-side record, its columns derived from the record's declaration.

A table's columns are its record's fields (`record_columns`), in their order, unless the table
says how it shows one otherwise (renamed, computed, flattened, or not at all; each with why), so a
field added to `RunRecord` or `ToolEffectRecord` is a column of `runs` or `tool_effects` with
nothing else to write. `arrow_schema` turns each column's type into the Parquet column's (`str` →
string, `int` → int64, `datetime` → UTC microseconds, `Decimal` → decimal, `dict[str, str]` → map,
`list[str]` → list); each table's row model is the Pydantic model its rows validate against.
"""

from __future__ import annotations

import dataclasses
import operator
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, create_model

from stepstream.schemas import EffectResolution, ModelUsage, RunRecord, StepEvent, ToolEffectRecord
from stepstream.shapes import is_internal, plain_type

if TYPE_CHECKING:
    import pyarrow as pa

COST_SCALE = 18
"""Decimal places of the `cost_usd` columns (`decimal(38, 18)`): costs are rounded half-even to them."""

_QUANTUM = Decimal(1).scaleb(-COST_SCALE)


def day(ts: datetime | None) -> str:
    """The `date` partition of a row: the UTC day of `ts` (1970-01-01 for none)."""
    return (ts or datetime(1970, 1, 1, tzinfo=UTC)).astimezone(UTC).strftime('%Y-%m-%d')


def cost(text: str | None) -> Decimal | None:
    """A `cost_usd` column's value from the records' exact decimal text."""
    return None if text is None else Decimal(text).quantize(_QUANTUM, rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a table: its name, its type (a Python annotation) and its value in a row's source."""

    name: str
    type: Any
    get: Callable[[Any], Any]


Shown = str | Sequence[Column] | None
"""How a table shows a record's field: under another name, as these columns, or (None) not at all."""


def _attribute(name: str, within: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    if within is None:
        return operator.attrgetter(name)

    def get(source: Any) -> Any:
        part = within(source)
        return None if part is None else getattr(part, name)

    return get


def record_columns(
    record: type,
    *,
    shown_as: Mapping[str, Shown] = MappingProxyType({}),
    flattened: Mapping[str, Mapping[str, Shown]] = MappingProxyType({}),
    within: Callable[[Any], Any] | None = None,
    nullable: bool = False,
) -> list[Column]:
    """A table's columns for the dataclass `record`: one per field it shows, in its order.

    A field is a column of its name and type unless the table says otherwise in `shown_as` (another
    name, columns computed from the row's source, or None: not shown) or `flattened` (a nested
    record's fields in its place, each shown as the mapping says; nullable when the nested record
    may be None). `within` reaches the record from the row's source; `nullable`: it may find None,
    and every column is then nullable. A field the record declares
    `internal` is a column only where the table computes one from it.
    """
    hints = get_type_hints(record)
    columns: list[Column] = []
    for f in dataclasses.fields(record):
        shown = shown_as.get(f.name, f.name)
        if is_internal(f) and isinstance(shown, str):
            continue
        get = _attribute(f.name, within)
        if f.name in flattened:
            hint = hints[f.name]
            optional = get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)
            nested = next(a for a in get_args(hint) if a is not type(None)) if optional else hint
            columns += record_columns(
                nested, shown_as=flattened[f.name], within=get, nullable=nullable or optional
            )
        elif isinstance(shown, str):
            kind = plain_type(hints[f.name])
            columns.append(Column(shown, kind | None if nullable else kind, get))
        elif shown is not None:
            columns += shown
    return columns


@dataclass(frozen=True)
class Table:
    """An analytics table: its columns, and the Pydantic model of its rows (its Parquet schema's source)."""

    name: str
    doc: str
    columns: Sequence[Column]
    dated: Callable[[Any], datetime | None]
    """The time whose UTC day is a row's `date` partition."""
    state: bool = False
    """A state table's rows of a run are replaced as a whole (the newest `export_seq` wins), so its
    rows carry `export_seq`; the other tables only grow."""
    row: type[BaseModel] = field(init=False)

    def __post_init__(self) -> None:
        tail: dict[str, Any] = {'export_seq': (int, ...)} if self.state else {}
        fields = {c.name: (c.type, ...) for c in self.columns} | tail | {'date': (str, ...)}
        name = ''.join(part.capitalize() for part in self.name.split('_')) + 'Row'
        object.__setattr__(self, 'row', create_model(name, __doc__=self.doc, **fields))

    def make(self, source: Any) -> dict[str, Any]:
        """The row of `source` (without `export_seq`, which the export stamps)."""
        row = {c.name: c.get(source) for c in self.columns}
        row['date'] = day(self.dated(source))
        return row


def _cost_column(within: Callable[[Any], Any]) -> list[Column]:
    return [
        Column('cost_usd', Decimal | None, lambda source: cost(getattr(within(source), 'cost_usd', None)))
    ]


_REQUEST_EVENT_COLUMNS: tuple[tuple[str, Any], ...] = (
    ('run_id', str),
    ('seq', int),
    ('timestamp', datetime),
    ('agent_name', str | None),
    ('conversation_id', str | None),
    ('step_index', int),
)
_REQUEST_TIMES = ('duration_us', 'trace_id', 'span_id')


_usage = operator.attrgetter('usage')
RUNS = Table(
    'runs',
    '`runs`: one row per run, with its lineage, status and usage sums (`RunRecord`, flattened).',
    record_columns(
        RunRecord,
        shown_as={
            'gaps': [Column('missing_seqs', int, lambda run: sum(high - low + 1 for low, high in run.gaps))],
            'conflicting_writers': None,  # a run with conflicts is in `stepstream conflicts`, not analytics
            'rejected': None,  # dead letters are counted by the projection's status, not per run here
        },
        flattened={'usage': {'cost_usd': _cost_column(_usage)}},
    ),
    dated=operator.attrgetter('started_at'),
    state=True,
)

EVENTS = Table(
    'events',
    '`events`: one row per step event, without snapshot payloads.',
    record_columns(
        StepEvent,
        shown_as={
            'metadata': None,  # the run's metadata is a column of `runs`
            'snapshot': [
                Column('snapshot_seq', int | None, lambda e: e.snapshot.snapshot_seq if e.snapshot else None)
            ],
            'usage': None,  # a model request's usage is in `model_requests`
        },
    ),
    dated=operator.attrgetter('timestamp'),
)


def _event_column(name: str, kind: Any) -> Column:
    return Column(name, kind, operator.attrgetter(name))


MODEL_REQUESTS = Table(
    'model_requests',
    '`model_requests`: one row per model request that ended, with its model, tokens, cost and time.',
    [
        # A view of the request's end event: these of its fields, then its usage (a `ModelUsage`).
        *(_event_column(name, kind) for name, kind in _REQUEST_EVENT_COLUMNS),
        Column('failed', bool, lambda e: e.kind == 'model_request_failed'),
        _event_column('error', str | None),
        *record_columns(
            ModelUsage, shown_as={'cost_usd': _cost_column(_usage)}, within=_usage, nullable=True
        ),
        *(
            _event_column(name, int | None if name == 'duration_us' else str | None)
            for name in _REQUEST_TIMES
        ),
    ],
    dated=operator.attrgetter('timestamp'),
)

TOOL_EFFECTS = Table(
    'tool_effects',
    "`tool_effects`: one row per tool call, its merged effect state and its run's status.",
    record_columns(
        ToolEffectRecord,
        within=operator.itemgetter(0),
        shown_as={
            'run_id': [
                Column('run_id', str, lambda pair: pair[0].run_id),
                Column('agent_name', str | None, lambda pair: pair[1].agent_name),
            ],
            'in_flight': [
                Column('unknown_after_crash', bool, lambda pair: pair[0].unknown_after_crash),
                Column('run_status', str, lambda pair: pair[1].status),
            ],
            # The resolution that decides the status is flattened; every one is a `resolutions` row.
            'resolutions': None,
        },
        flattened={
            'resolution': {
                'writer_id': None,
                'note': 'resolution_note',
                'resolves_seq': None,
                'args': 'decision_args',
                'result': 'decision_result',
                'error': 'decision_error',
                'applied': None,  # the flattened one is always the applied one
            }
        },
    ),
    dated=lambda pair: pair[0].started_at or pair[1].started_at,
    state=True,
)
"""Its rows' source is a pair: the effect, and its run."""

RESOLUTIONS = Table(
    'resolutions',
    '`resolutions`: one row per resolution of a call in doubt or decision on a deferred call, every '
    "one written (the call's ledger), with whether it decides the call (`applied`).",
    [
        Column('run_id', str, lambda entry: entry[0].run_id),
        Column('agent_name', str | None, lambda entry: entry[2].agent_name),
        Column('tool_call_id', str, lambda entry: entry[0].tool_call_id),
        Column('tool_name', str, lambda entry: entry[0].tool_name),
        *record_columns(EffectResolution, within=operator.itemgetter(1)),
    ],
    dated=lambda entry: entry[1].resolved_at,
    state=True,  # `applied` changes: a later transition of the call, or a rebuild, decides again
)
"""Its rows' source is a triple: the effect, one entry of its ledger (`resolutions`), and its run."""


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


TABLES: tuple[Table, ...] = (RUNS, EVENTS, MODEL_REQUESTS, TOOL_EFFECTS, RESOLUTIONS)
"""The tables whose rows are a record's (the `messages` table's are a snapshot's messages)."""

ROWS: dict[str, type[BaseModel]] = {table.name: table.row for table in TABLES} | {'messages': MessageRow}
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
