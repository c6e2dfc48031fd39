"""Records read into plain values: the fast read of the apply path, beside `decode`.

`read_plain` reads a current-version record's Avro body straight into a dict (timestamps as the
micros they are on the wire), without building the record types; anything else (an older
version, or bytes `decode` refuses) is left to `decode`, whose fields `plain_fields` gives in the
same form. `read_record` is the one call the projector makes.
"""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from typing import Any

from fastavro import parse_schema, schemaless_reader

from stepstream.schemas._codec import MAGIC, STEP_EVENT_SCHEMA, TOOL_EFFECT_SCHEMA, SchemaVersion, decode
from stepstream.schemas._types import LogRecord, StepEvent
from stepstream.timestamps import micros

STEP_EVENTS, TOOL_EFFECTS = 0, 1
"""Topic indexes: step events, tool effects (`Fields` readers give the topic of a record by them)."""

Fields = dict[str, Any]
"""A log record's fields as plain values: what the Avro body holds, `timestamp` in micros."""

RECORD_TYPES = ('StepEvent', 'ToolEffectTransition')
"""The record type of each topic index, as `wrong_topic` names it."""

_MIN_TIMESTAMP = micros(datetime.min.replace(tzinfo=UTC))
_MAX_TIMESTAMP = micros(datetime.max.replace(tzinfo=UTC))
"""The timestamps `decode` can turn into a `datetime`; it calls a record outside them corrupt."""


def _without_timestamp_type(node: Any) -> Any:
    if isinstance(node, list):
        return [_without_timestamp_type(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get('logicalType') not in (None, 'timestamp-micros'):
        raise ValueError(f'the plain reader knows no logical type {node["logicalType"]!r}')
    return {k: _without_timestamp_type(v) for k, v in node.items() if k != 'logicalType'}


def _plain_schema(version: SchemaVersion) -> Any:
    """The version's writer schema with `timestamp-micros` read as the long it is on the wire."""
    return parse_schema(_without_timestamp_type(json.loads(version.path.read_text())), named_schemas={})


_PLAIN_READERS = {
    MAGIC + STEP_EVENT_SCHEMA.fingerprint: (STEP_EVENTS, _plain_schema(STEP_EVENT_SCHEMA)),
    MAGIC + TOOL_EFFECT_SCHEMA.fingerprint: (TOOL_EFFECTS, _plain_schema(TOOL_EFFECT_SCHEMA)),
}
"""Single-object header -> (topic index, plain schema), for the current schema versions."""
_HEADER = len(MAGIC) + len(STEP_EVENT_SCHEMA.fingerprint)


def read_plain(value: bytes) -> tuple[int, Fields] | None:
    """The topic index and plain fields of a current-version record; None for anything else.

    It accepts exactly what `decode` accepts of the current versions (the same bodies, and the
    timestamps a `datetime` can hold), without building the record types and the timestamp's
    `datetime`. None leaves the record to `decode`: an older version, or one it refuses.
    """
    reader = _PLAIN_READERS.get(value[:_HEADER])
    if reader is None:
        return None
    topic, schema = reader
    try:
        fields = schemaless_reader(io.BytesIO(value[_HEADER:]), schema, None)
    except Exception:  # fastavro raises several types for garbled bodies; `decode` names it
        return None
    if type(fields) is not dict or not _MIN_TIMESTAMP <= fields['timestamp'] <= _MAX_TIMESTAMP:
        return None
    return topic, fields


def plain_fields(record: LogRecord) -> tuple[int, Fields]:
    """A decoded record as `read_plain` gives it: its topic index and its plain fields."""
    fields = {name: getattr(record, name) for name in record.__slots__}
    fields['timestamp'] = micros(record.timestamp)
    if not isinstance(record, StepEvent):
        return TOOL_EFFECTS, fields
    if record.snapshot is not None:
        fields['snapshot'] = {name: getattr(record.snapshot, name) for name in record.snapshot.__slots__}
    if record.usage is not None:
        fields['usage'] = {name: getattr(record.usage, name) for name in record.usage.__slots__}
    return STEP_EVENTS, fields


def read_record(value: bytes) -> tuple[int, Fields]:
    """A record's topic index and plain fields, whatever its version; `SchemaError` if it is not one.

    The one place the apply path reads bytes: the current versions by `read_plain`, anything else
    (older versions, and every record `decode` refuses, with its reason) by `decode`.
    """
    read = read_plain(value)
    return read if read is not None else plain_fields(decode(value))
