"""Comparing two projections by their logical content (`stepstream verify`).

The projection is a pure function of the log, so an incrementally built projection that
survived any number of crashes must equal a clean rebuild, key for key. Only bookkeeping that
depends on the consuming process is left out: the stored offsets, progress figures and the
identity record (whose options are compared first, on their own).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from stepstream.schemas import decode
from stepstream.storage import (
    APART,
    EVENT,
    PARKED,
    TRANSITION,
    Shard,
    ShardReads,
    check_projection,
    render_key,
    shard_paths,
    unpack_transition,
)


@dataclass(frozen=True, slots=True)
class Difference:
    """The first key where two projections disagree."""

    key: str
    left: str | None
    right: str | None

    def __str__(self) -> str:
        return f'first difference at {self.key}:\n  left:  {self.left}\n  right: {self.right}'


def render_value(k: bytes, v: bytes) -> str:
    """A value as readable text: decoded records, JSON as JSON."""
    try:
        if k.startswith((EVENT.tag, PARKED.tag, APART.tag)):
            return repr(decode(v))
        if k.startswith(TRANSITION.tag):
            return repr(decode(unpack_transition(v)[1]))
        return json.dumps(json.loads(v), sort_keys=True)
    except ValueError:
        return v.decode(errors='replace') or '(empty)'


def compare(left: ShardReads, right: ShardReads) -> tuple[int, Difference | None]:
    """Walk both projections in key order; the number of equal items and the first difference.

    The options the projections were built with are compared first: projections of one log
    built with different options differ for that reason alone, and the difference says so.
    """
    id_left, id_right = left.identity(), right.identity()
    for side, identity in (('left', id_left), ('right', id_right)):
        if identity is not None and identity.state == 'rebuilding':
            return 0, Difference(
                'identity.state', f'the {side} projection is an unfinished rebuild', 'resume it first'
            )
    options_left = id_left.options() if id_left is not None else None
    options_right = id_right.options() if id_right is not None else None
    if options_left != options_right:
        return 0, Difference(
            'options (the projections were built differently)', str(options_left), str(options_right)
        )
    a, b = left.logical_items(), right.logical_items()
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
    """Compare two projection directories shard by shard (each opened read-only as a secondary).

    The options are compared first (all shards of a projection share them); then each partition's
    shards, in partition order, key by key. A shard on one side only is the first difference.
    """
    roots = check_projection(left, create=False), check_projection(right, create=False)
    shards = shard_paths(roots[0]), shard_paths(roots[1])
    equal = 0
    with tempfile.TemporaryDirectory() as scratch:
        for partition in sorted(shards[0].keys() | shards[1].keys()):
            left_path, right_path = shards[0].get(partition), shards[1].get(partition)
            if left_path is None or right_path is None:
                return equal, Difference(
                    f'shard {partition}',
                    'present' if left_path else 'missing',
                    'present' if right_path else 'missing',
                )
            paths = left_path, right_path
            opened: list[Shard] = []
            try:
                for side, path in (('a', paths[0]), ('b', paths[1])):
                    opened.append(Shard.open_read_only(path, Path(scratch) / f'{side}{partition}'))
                count, difference = compare(opened[0], opened[1])
            finally:
                for shard in opened:
                    shard.close()
            equal += count
            if difference is not None:
                if not difference.key.startswith(('options', 'identity')):
                    difference = Difference(
                        f'shard {partition}: {difference.key}', difference.left, difference.right
                    )
                return equal, difference
    return equal, None
