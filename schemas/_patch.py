"""Snapshot patches (schema v2): the fields Pydantic AI stamps on a message after it was saved.

The graph saves a folded tool-return request in one snapshot and only then, when it sends the
request, stamps it (`timestamp`, `run_id`, `conversation_id`, `instructions`). Without a patch
the next snapshot would re-send the whole message for those few fields. Both sides of the log
use this module: the writer computes a patch, the reader applies it
(docs/decisions/0019-snapshot-patches.md).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import MutableSequence
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage

__all__ = ['apply_patch', 'patch_json', 'stamp_changes']

_MESSAGE: TypeAdapter[ModelMessage] = TypeAdapter(ModelMessage)


def stamp_changes(old_json: bytes, new_json: bytes) -> dict[str, Any] | None:
    """The top-level fields that differ between two JSONs of one message, if only those differ.

    None when the parts differ, the kind differs, or a field appeared or went away: then the
    message is sent again whole. Field values are Pydantic AI's JSON values.
    """
    old, new = json.loads(old_json), json.loads(new_json)
    if not isinstance(old, dict) or not isinstance(new, dict) or old.keys() != new.keys():
        return None
    if old.get('kind') != new.get('kind') or old.get('parts') != new.get('parts'):
        return None
    changed = {key: value for key, value in new.items() if old[key] != value}
    return changed or None


def apply_patch(history: MutableSequence[ModelMessage], patch: str) -> None:
    """Set the stamped fields a snapshot's `patch` names on messages of the previous history.

    Each changed message is replaced (never modified in place: earlier snapshots of one read
    share message objects). Raises `ValueError` for a patch that does not fit the history.
    """
    entries = json.loads(patch)
    if not isinstance(entries, list):
        raise ValueError('a snapshot patch is a JSON list')
    for entry in entries:
        at, changes = entry.get('at'), entry.get('set')
        if not isinstance(at, int) or not 0 <= at < len(history) or not isinstance(changes, dict):
            raise ValueError(f'snapshot patch entry {entry!r} does not fit a history of {len(history)}')
        message = history[at]
        # Validate just the changed fields, on an empty message of the same kind.
        stamped = _MESSAGE.validate_python({**changes, 'kind': message.kind, 'parts': []})
        history[at] = dataclasses.replace(message, **{key: getattr(stamped, key) for key in changes})


def patch_json(entries: list[tuple[int, dict[str, Any]]]) -> str | None:
    """The wire form of a patch: `[{"at": index, "set": {...}}, ...]`, or None for none."""
    if not entries:
        return None
    return json.dumps([{'at': at, 'set': changes} for at, changes in entries], separators=(',', ':'))
