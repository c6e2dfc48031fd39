"""The Confluent wire format: byte 0, the writer schema's 4-byte registry id, the Avro body.

It carries the same Avro body as the single-object encoding (`_codec.py`); only the header
differs: a registry id instead of the CRC-64-AVRO fingerprint. So a record moves between the two
formats by swapping headers, without decoding it, once the id is matched with a committed schema
version (by the fingerprint of the schema the registry holds under that id). Readers turn
Confluent-framed records into their single-object form, which is what the projection stores, so a
projection does not depend on the format its records were written in.

Subjects follow the TopicNameStrategy (`<topic>-value`): each topic carries one record type.
"""

from __future__ import annotations

import json
from typing import Any

from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

from stepstream.schemas._codec import _BY_FINGERPRINT, _HEADER_LEN, MAGIC, SchemaVersion

CONFLUENT_MAGIC = 0
"""The first byte of a Confluent wire-format value."""
CONFLUENT_HEADER_LEN = 5
"""The magic byte and the big-endian 4-byte schema id."""


def subject_of(topic: str) -> str:
    """The registry subject of a topic's values (TopicNameStrategy): `<topic>-value`."""
    return f'{topic}-value'


def confluent_schema_id(value: bytes | None) -> int | None:
    """The schema id of a Confluent-framed value; None for anything else (single-object, garbage)."""
    if value is None or len(value) < CONFLUENT_HEADER_LEN or value[0] != CONFLUENT_MAGIC:
        return None
    return int.from_bytes(value[1:CONFLUENT_HEADER_LEN], 'big')


def to_confluent(single_object: bytes, schema_id: int) -> bytes:
    """A single-object encoded record (`encode`) reframed with its registry id."""
    return b'\x00' + schema_id.to_bytes(4, 'big') + single_object[_HEADER_LEN:]


def from_confluent(value: bytes, version: SchemaVersion) -> bytes:
    """A Confluent-framed record whose id names `version`, in single-object encoding."""
    return MAGIC + version.fingerprint + value[CONFLUENT_HEADER_LEN:]


def version_of_schema(schema: str) -> SchemaVersion | None:
    """The committed schema version a registry's schema text is (same canonical form), or None.

    None for anything else: another schema, a newer stepstream's version, or text that is not
    an Avro schema at all (a registry may hold anything under an id).
    """
    try:
        raw: Any = json.loads(schema)
        parse_schema(raw, named_schemas={})
        found = bytes.fromhex(fingerprint(to_parsing_canonical_form(raw), 'CRC-64-AVRO'))
    except Exception:  # fastavro raises several types for schemas it cannot parse
        return None
    return _BY_FINGERPRINT.get(found)
