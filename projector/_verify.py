"""Comparing two projections by their logical content (`stepstream verify`).

The projection is a pure function of the log, so an incrementally built projection that
survived any number of crashes must equal a clean rebuild, key for key. Only bookkeeping that
depends on the consuming process is left out: the stored offsets (`o`) and progress figures.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rocksdict import Rdict

from stepstream.projector._store import SEP, open_db
from stepstream.schemas import decode

_PROCESS_LOCAL = (b'o' + SEP, b'm' + SEP + b'progress')
_AVRO_PREFIXES = (b'e' + SEP, b'q' + SEP, b'w' + SEP)


@dataclass(frozen=True, slots=True)
class Difference:
    """The first key where two projections disagree."""

    key: str
    left: str | None
    right: str | None

    def __str__(self) -> str:
        return f'first difference at {self.key}:\n  left:  {self.left}\n  right: {self.right}'


def logical_items(db: Rdict) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) that belongs to the logical content, in key order."""
    for k, v in db.items():
        assert isinstance(k, bytes) and isinstance(v, bytes)
        if not k.startswith(_PROCESS_LOCAL):
            yield k, v


def render_key(k: bytes) -> str:
    """A key as readable text: its parts joined by '/'."""
    return '/'.join(part.decode(errors='replace') for part in k.split(SEP))


def render_value(k: bytes, v: bytes) -> str:
    """A value as readable text: decoded records, JSON as JSON."""
    if k.startswith(_AVRO_PREFIXES):
        return repr(decode(v))
    try:
        return json.dumps(json.loads(v), sort_keys=True)
    except ValueError:
        return v.decode(errors='replace') or '(empty)'


def compare(left: Rdict, right: Rdict) -> tuple[int, Difference | None]:
    """Walk both projections in key order; the number of equal items and the first difference."""
    a, b = logical_items(left), logical_items(right)
    item_a, item_b = next(a, None), next(b, None)
    equal = 0
    while item_a is not None or item_b is not None:
        if item_a is not None and (item_b is None or item_a[0] < item_b[0]):
            return equal, Difference(render_key(item_a[0]), render_value(*item_a), None)
        if item_b is not None and (item_a is None or item_b[0] < item_a[0]):
            return equal, Difference(render_key(item_b[0]), None, render_value(*item_b))
        assert item_a is not None and item_b is not None
        if item_a[1] != item_b[1]:
            return equal, Difference(render_key(item_a[0]), render_value(*item_a), render_value(*item_b))
        equal += 1
        item_a, item_b = next(a, None), next(b, None)
    return equal, None


def verify_paths(left: str | Path, right: str | Path) -> tuple[int, Difference | None]:
    """Compare two projection directories (opened read-only as secondary instances)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp_a, tempfile.TemporaryDirectory() as tmp_b:
        db_a, db_b = open_db(left, secondary=tmp_a), open_db(right, secondary=tmp_b)
        try:
            db_a.try_catch_up_with_primary()
            db_b.try_catch_up_with_primary()
            return compare(db_a, db_b)
        finally:
            db_a.close()
            db_b.close()
