"""Avro binary writers compiled from a parsed schema: fastavro's bytes, without its per-value dispatch.

`encode` runs for every record an agent appends, and fastavro's generic writer (which looks up
each field's type and picks each union branch by checking the value against every candidate)
was most of its cost. `compile_writer` turns a schema into nested closures once, so that writing
a record is a straight walk over its fields. It reads fields from record objects directly (no
intermediate dict) and from dicts alike.

The output is byte for byte what `fastavro.schemaless_writer` writes for the same schema and value
(tests/test_schemas.py compares them on every record shape and on generated values); fastavro
stays the reader, and the oracle. A schema with a construct not listed in `compile_writer` gets
None, and `encode` uses fastavro for it.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from fastavro.logical_writers import LOGICAL_WRITERS

from stepstream.timestamps import micros

__all__ = ['Writer', 'compile_writer']

Writer = Callable[[bytearray, Any], None]
"""`(buffer, value) -> None`: appends the Avro binary encoding of `value` to `buffer`."""

_FASTAVRO_MICROS = LOGICAL_WRITERS['long-timestamp-micros']
_DOUBLE = struct.Struct('<d').pack
_FLOAT = struct.Struct('<f').pack


class _Unsupported(Exception):
    """The schema uses something `compile_writer` does not compile."""


def compile_writer(schema: Any) -> Writer | None:
    """A writer for a schema parsed by `fastavro.parse_schema`, or None when it is not supported.

    Supported: null, boolean, int, long, float, double, string, bytes, enums, records, maps,
    arrays, `timestamp-micros`, and unions of `null` with one other type. Anything else (named
    type references, other unions, other logical types) gives None.
    """
    try:
        return _compile(schema)
    except _Unsupported:
        return None


def _compile(schema: Any) -> Writer:
    if isinstance(schema, list):
        return _union(schema)
    if isinstance(schema, str):
        return _primitive(schema)
    if not isinstance(schema, dict):
        raise _Unsupported(repr(schema))
    kind = schema.get('type')
    logical = schema.get('logicalType')
    if logical is not None:
        if logical == 'timestamp-micros' and kind == 'long':
            return _write_timestamp_micros
        raise _Unsupported(logical)
    if kind == 'record':
        return _record(schema)
    if kind == 'map':
        return _map(_compile(schema['values']))
    if kind == 'array':
        return _array(_compile(schema['items']))
    if kind == 'enum':
        return _enum(schema['symbols'])
    if isinstance(kind, str):
        return _primitive(kind)
    raise _Unsupported(repr(kind))


def _primitive(name: str) -> Writer:
    writers: dict[str, Writer] = {
        'null': _write_null,
        'boolean': _write_boolean,
        'int': _write_long,
        'long': _write_long,
        'float': _write_float,
        'double': _write_double,
        'string': _write_string,
        'bytes': _write_bytes,
    }
    if name not in writers:
        raise _Unsupported(name)  # a named type referenced by name
    return writers[name]


def _write_null(buf: bytearray, value: Any) -> None:
    if value is not None:
        raise TypeError(f'expected None for an Avro null, got {value!r}')


def _write_boolean(buf: bytearray, value: Any) -> None:
    buf.append(1 if value else 0)


def _write_long(buf: bytearray, value: int) -> None:
    if 0 <= value < 64:  # one byte: most seqs, steps and lengths
        buf.append(value << 1)
        return
    if 0x8000000 <= value < 0x4000000000000000:
        # A timestamp in microseconds: Python's arithmetic on such ints costs hundreds of
        # instructions an operation, so only two operations touch it. The zig-zag of a positive
        # value is `value << 1`; its low 28 bits are written as four groups of small ints, the
        # rest (the same for minutes of timestamps) comes from a cache.
        low = (value & 0x7FFFFFF) << 1
        high = value >> 27
        buf += bytes((low & 0x7F | 0x80, low >> 7 & 0x7F | 0x80, low >> 14 & 0x7F | 0x80, low >> 21 | 0x80))
        tail = _HIGH_GROUPS.get(high)
        if tail is None:
            tail = _varint(high)
            if len(_HIGH_GROUPS) >= 1024:
                _HIGH_GROUPS.clear()
            _HIGH_GROUPS[high] = tail
        buf += tail
        return
    n = (value << 1) ^ (value >> 63)  # zig-zag
    while n & ~0x7F:
        buf.append((n & 0x7F) | 0x80)
        n >>= 7
    buf.append(n)


def _varint(n: int) -> bytes:
    """The base-128 varint of `n` >= 0 (no zig-zag)."""
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_HIGH_GROUPS: dict[int, bytes] = {}
"""`_varint` of the bits above a long's low 28 (zig-zagged), by value: a few per process at a time."""


def _write_float(buf: bytearray, value: float) -> None:
    buf += _FLOAT(value)


def _write_double(buf: bytearray, value: float) -> None:
    buf += _DOUBLE(value)


def _write_string(buf: bytearray, value: str) -> None:
    data = value.encode()
    if len(data) < 64:
        buf.append(len(data) << 1)
    else:
        _write_long(buf, len(data))
    buf += data


def _write_bytes(buf: bytearray, value: bytes) -> None:
    _write_long(buf, len(value))
    buf += value


def _write_timestamp_micros(buf: bytearray, value: Any) -> None:
    if isinstance(value, datetime):
        # fastavro's own conversion for naive datetimes (local time), ours (one definition) otherwise.
        value = micros(value) if value.tzinfo is not None else _FASTAVRO_MICROS(value, {})
    _write_long(buf, value)


def _enum(symbols: list[str]) -> Writer:
    index = {symbol: i for i, symbol in enumerate(symbols)}

    def write(buf: bytearray, value: str) -> None:
        _write_long(buf, index[value])

    return write


def _union(branches: list[Any]) -> Writer:
    if len(branches) != 2 or 'null' not in branches:
        raise _Unsupported(repr(branches))
    null_index = branches.index('null')
    other = _compile(branches[1 - null_index])
    none_tag, value_tag = null_index * 2, (1 - null_index) * 2  # zig-zag of 0 and 1

    if other is _write_string:  # most optional fields: one call, not two

        def write_string(buf: bytearray, value: Any) -> None:
            if value is None:
                buf.append(none_tag)
            else:
                buf.append(value_tag)
                data = value.encode()
                if len(data) < 64:  # the length's zig-zag varint is one byte
                    buf.append(len(data) << 1)
                else:
                    _write_long(buf, len(data))
                buf += data

        return write_string

    def write(buf: bytearray, value: Any) -> None:
        if value is None:
            buf.append(none_tag)
        else:
            buf.append(value_tag)
            other(buf, value)

    return write


def _map(values: Writer) -> Writer:
    def write(buf: bytearray, value: Mapping[str, Any]) -> None:
        if value:
            _write_long(buf, len(value))
            for key, item in value.items():
                _write_string(buf, key)
                values(buf, item)
        buf.append(0)

    return write


def _array(items: Writer) -> Writer:
    def write(buf: bytearray, value: list[Any]) -> None:
        if value:
            _write_long(buf, len(value))
            for item in value:
                items(buf, item)
        buf.append(0)

    return write


_MISSING = object()


def _record(schema: dict[str, Any]) -> Writer:
    fields = [(f['name'], _compile(f['type']), f.get('default', _MISSING)) for f in schema['fields']]
    name = schema.get('name')

    def write_fields(buf: bytearray, value: Any) -> None:
        """A dict, or an object without some field: each field looked up, its default if absent."""
        is_dict = isinstance(value, dict)
        for field_name, writer, default in fields:
            item = value.get(field_name, _MISSING) if is_dict else getattr(value, field_name, _MISSING)
            if item is _MISSING:
                if default is _MISSING:
                    raise ValueError(f'{name} field {field_name!r} is missing and has no default')
                item = default
            writer(buf, item)

    if len(fields) < 2:  # attrgetter of one name gives the value, not a tuple
        return write_fields
    return _generated_record([(f['name'], f['type']) for f in schema['fields']], write_fields)


def _generated_record(fields: list[tuple[str, Any]], write_fields: Writer) -> Writer:
    """The writer of a record object as one generated function, without a call per primitive field.

    Its fields are read in one call, and the primitive ones (strings, longs, timestamps, optional
    ones) written inline. Each inline write is the code of the writer above that it replaces
    (`_write_string`, the union's `write_string`, ...), so the bytes and the errors are the same;
    a dict goes to `write_fields`.
    """
    names = [field_name for field_name, _type in fields]
    env: dict[str, Any] = {
        'values_of': operator.attrgetter(*names),
        'write_fields': write_fields,
        'datetime': datetime,
        'micros': micros,
        '_FASTAVRO_MICROS': _FASTAVRO_MICROS,
        '_write_long': _write_long,
    }
    lines = [
        'def write(buf, value):',
        '    if isinstance(value, dict):',
        '        write_fields(buf, value)',
        '        return',
        '    try:',
        f'        ({", ".join(f"v{i}" for i in range(len(fields)))},) = values_of(value)',
        '    except AttributeError:',
        '        write_fields(buf, value)',
        '        return',
    ]
    for i, (_name, field_type) in enumerate(fields):
        lines += _inline(field_type, f'v{i}', env, '    ')
    exec('\n'.join(lines), env)  # our own code, made from the schema's field types
    writer: Writer = env['write']
    return writer


def _inline(schema: Any, var: str, env: dict[str, Any], indent: str) -> list[str]:
    """Lines that append `var`'s encoding to `buf`: inline for primitives, else a call of its writer."""
    if schema in ('int', 'long'):
        return [
            f'{indent}if 0 <= {var} < 64:',
            f'{indent}    buf.append({var} << 1)',
            f'{indent}else:',
            f'{indent}    _write_long(buf, {var})',
        ]
    if schema == 'string':
        return [
            f'{indent}{var} = {var}.encode()',
            f'{indent}if len({var}) < 64:',
            f'{indent}    buf.append(len({var}) << 1)',
            f'{indent}else:',
            f'{indent}    _write_long(buf, len({var}))',
            f'{indent}buf += {var}',
        ]
    if (
        isinstance(schema, dict)
        and schema.get('logicalType') == 'timestamp-micros'
        and schema.get('type') == 'long'
    ):
        return [
            f'{indent}if isinstance({var}, datetime):',
            f'{indent}    aware = {var}.tzinfo is not None',
            f'{indent}    {var} = micros({var}) if aware else _FASTAVRO_MICROS({var}, {{}})',
            f'{indent}_write_long(buf, {var})',
        ]
    if isinstance(schema, list) and len(schema) == 2 and 'null' in schema:
        null_index = schema.index('null')
        other = schema[1 - null_index]
        if other in ('int', 'long', 'string'):
            none_tag, value_tag = null_index * 2, (1 - null_index) * 2
            return [
                f'{indent}if {var} is None:',
                f'{indent}    buf.append({none_tag})',
                f'{indent}else:',
                f'{indent}    buf.append({value_tag})',
                *_inline(other, var, env, indent + '    '),
            ]
    writer = f'w_{var}'
    env[writer] = _compile(schema)
    return [f'{indent}{writer}(buf, {var})']
