"""Avro single-object encoding of the log records.

Each value is `C3 01` + the 8-byte CRC-64-AVRO fingerprint of the writer schema's canonical
form + the Avro body, so any consumer decodes it with nothing but the `.avsc` files in
`schemas/avro/` (no registry). Every committed version of a schema is loaded, so records written
with an older version decode into the current record types.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint, to_parsing_canonical_form

from stepstream.errors import SchemaError
from stepstream.schemas._types import LogRecord, ModelUsage, SnapshotDelta, StepEvent, ToolEffectTransition
from stepstream.schemas._writer import compile_writer

SCHEMA_DIR = Path(__file__).parent / 'avro'
"""The committed `.avsc` files, named `<record>.v<N>.avsc`."""

MAGIC = b'\xc3\x01'
"""The two bytes that open every Avro single-object encoded record."""
_HEADER_LEN = len(MAGIC) + 8
_FILE_NAME = re.compile(r'^(?P<name>[a-z_]+)\.v(?P<version>\d+)\.avsc$')


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    """One committed `.avsc` file, parsed."""

    name: str
    version: int
    path: Path
    parsed: Any
    fingerprint: bytes

    @property
    def fingerprint_hex(self) -> str:
        """The fingerprint as it appears in the `stepstream-schema` header."""
        return self.fingerprint.hex()


def load_schema_versions(directory: Path = SCHEMA_DIR) -> dict[str, list[SchemaVersion]]:
    """Every committed schema version, by record file name, oldest first."""
    found: dict[str, list[SchemaVersion]] = {}
    for path in sorted(directory.glob('*.avsc')):
        match = _FILE_NAME.match(path.name)
        if match is None:
            raise SchemaError(f'{path}: schema files must be named <record>.v<N>.avsc')
        raw = json.loads(path.read_text())
        # Each version gets its own name registry: two versions define the same named types.
        parsed = parse_schema(raw, named_schemas={})
        canonical = to_parsing_canonical_form(raw)
        found.setdefault(match['name'], []).append(
            SchemaVersion(
                name=match['name'],
                version=int(match['version']),
                path=path,
                parsed=parsed,
                fingerprint=bytes.fromhex(fingerprint(canonical, 'CRC-64-AVRO')),
            )
        )
    for versions in found.values():
        versions.sort(key=lambda v: v.version)
    return found


_VERSIONS = load_schema_versions()
STEP_EVENT_SCHEMA = _VERSIONS['step_event'][-1]
TOOL_EFFECT_SCHEMA = _VERSIONS['tool_effect_transition'][-1]
_USAGE_TYPE = 'io.stepstream.ModelUsage'
_BY_FINGERPRINT: dict[bytes, SchemaVersion] = {v.fingerprint: v for vs in _VERSIONS.values() for v in vs}
_STEP_EVENT_WRITER = compile_writer(STEP_EVENT_SCHEMA.parsed)
_TOOL_EFFECT_WRITER = compile_writer(TOOL_EFFECT_SCHEMA.parsed)
_STEP_EVENT_HEADER = MAGIC + STEP_EVENT_SCHEMA.fingerprint
_TOOL_EFFECT_HEADER = MAGIC + TOOL_EFFECT_SCHEMA.fingerprint


def encode(record: LogRecord) -> bytes:
    """The record in Avro single-object encoding, written with the newest schema version.

    Written by a writer compiled from the schema (`schemas/_writer.py`), which produces
    fastavro's bytes at a fraction of its cost; `encode_with_fastavro` is the same encoding
    through fastavro, for a schema the compiler does not support and as the tests' oracle.
    """
    if isinstance(record, StepEvent):
        header, writer = _STEP_EVENT_HEADER, _STEP_EVENT_WRITER
    else:
        header, writer = _TOOL_EFFECT_HEADER, _TOOL_EFFECT_WRITER
    if writer is None:
        return encode_with_fastavro(record)
    out = bytearray(header)
    writer(out, record)
    return bytes(out)


def encode_with_fastavro(record: LogRecord) -> bytes:
    """What `encode` returns, written by `fastavro.schemaless_writer`."""
    schema = schema_of(record)
    out = io.BytesIO()
    out.write(MAGIC)
    out.write(schema.fingerprint)
    schemaless_writer(out, schema.parsed, _to_avro(record))
    return out.getvalue()


def record_body(value: bytes) -> bytes:
    """A record's Avro body: its value without the single-object or Confluent header.

    What a run's hash chain hashes (`chain_hash`), so a record hashes alike in either wire format.
    """
    if value[:2] == MAGIC:
        return value[_HEADER_LEN:]
    if value[:1] == b'\x00':  # Confluent: magic byte 0, a 4-byte schema id
        return value[5:]
    raise SchemaError(f'not a record of ours: it starts with {value[:2].hex()}')


_LINKED = frozenset(
    v.fingerprint
    for vs in _VERSIONS.values()
    for v in vs
    if any(f['name'] == 'prev_hash' for f in v.parsed['fields'])
)
"""The fingerprints of the versions that carry a link (`prev_hash`): step_event v5, tool_effect v3 on."""


def is_linked(value: bytes) -> bool:
    """Whether a single-object record was written by a writer that links its records (a chained run's)."""
    return value[2:_HEADER_LEN] in _LINKED


def chain_hash(value: bytes) -> str:
    """The link a run's next record carries (`prev_hash`): SHA-256 (hex) of this record's Avro body.

    Sealed content is hashed as its ciphertext, so erasing a conversation never breaks a chain
    (docs/decisions/0048-hash-chained-runs.md).
    """
    return hashlib.sha256(record_body(value)).hexdigest()


def schema_of(record: LogRecord) -> SchemaVersion:
    """The schema version `encode` writes this record with."""
    return STEP_EVENT_SCHEMA if isinstance(record, StepEvent) else TOOL_EFFECT_SCHEMA


def decode(data: bytes) -> LogRecord:
    """A record from its single-object encoding; `SchemaError` for anything that is not ours."""
    if len(data) < _HEADER_LEN or data[:2] != MAGIC:
        raise SchemaError(
            f'not an Avro single-object record (expected marker C3 01, got {data[:2].hex() or "nothing"}); '
            'was it written by stepstream?',
            reason='not_a_record',
        )
    writer = _BY_FINGERPRINT.get(data[2:_HEADER_LEN])
    if writer is None:
        raise SchemaError(
            f'unknown schema fingerprint {data[2:_HEADER_LEN].hex()}: the record was written with a '
            'schema this version of stepstream does not have; upgrade stepstream',
            reason='unknown_version',
        )
    reader = _VERSIONS[writer.name][-1]
    # Schema resolution only when the writer used an older version; the common case skips it.
    reader_schema = None if reader is writer else reader.parsed
    try:
        value = schemaless_reader(io.BytesIO(data[_HEADER_LEN:]), writer.parsed, reader_schema)
    except Exception as exc:  # fastavro raises several types for truncated or garbled bodies
        raise SchemaError(f'corrupt {writer.name} v{writer.version} record: {exc!r}') from exc
    if not isinstance(value, dict):
        raise SchemaError(f'corrupt {writer.name} record: decoded to {type(value).__name__}')
    return _from_avro(writer.name, value)


def _to_avro(record: LogRecord) -> dict[str, Any]:
    value = {name: getattr(record, name) for name in record.__slots__}
    snapshot = value.get('snapshot')
    if snapshot is not None:
        value['snapshot'] = {name: getattr(snapshot, name) for name in SnapshotDelta.__slots__}
    usage = value.get('usage')
    if usage is not None:
        # Named, so that fastavro takes the union's record branch without validating the value against it.
        value['usage'] = (_USAGE_TYPE, {name: getattr(usage, name) for name in ModelUsage.__slots__})
    return value


def _from_avro(name: str, value: dict[str, Any]) -> LogRecord:
    try:
        if name == 'step_event':
            snapshot = value.pop('snapshot', None)
            usage = value.pop('usage', None)
            return StepEvent(
                **value,
                snapshot=SnapshotDelta(**snapshot) if snapshot is not None else None,
                usage=ModelUsage(**usage) if usage is not None else None,
            )
        return ToolEffectTransition(**value)
    except TypeError as exc:
        raise SchemaError(f'{name} record does not match the record type: {exc}') from exc
