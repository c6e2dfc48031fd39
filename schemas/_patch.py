"""How a snapshot carries messages: their lean JSON, and patches of the fields stamped later.

`message_json` is Pydantic AI's own JSON of a message without the `null` fields whose default is
`None`, which Pydantic AI's validation puts back as they were (docs/decisions/0024).

Patches (schema v2): the graph saves a folded tool-return request in one snapshot and only then,
when it sends the request, stamps it (`timestamp`, `run_id`, `conversation_id`, `instructions`).
Without a patch the next snapshot would re-send the whole message for those few fields. Both
sides of the log use this module: the writer computes a patch, the reader applies it
(docs/decisions/0019-snapshot-patches.md).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Callable, MutableSequence
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse
from pydantic_ai.usage import RequestUsage

__all__ = [
    'MessageState',
    'apply_patch',
    'message_json',
    'message_state',
    'patch_json',
    'stamp_changes',
    'stamps_since',
]

_MESSAGE: TypeAdapter[ModelMessage] = TypeAdapter(ModelMessage)
_BY_KIND: dict[type, TypeAdapter[Any]] = {
    ModelRequest: TypeAdapter(ModelRequest),
    ModelResponse: TypeAdapter(ModelResponse),
}
"""Each message class's own adapter: the same JSON as `_MESSAGE`'s, without choosing a union branch first."""


def _adapter(message: ModelMessage) -> TypeAdapter[Any]:
    return _BY_KIND.get(type(message)) or _MESSAGE


def message_json(message: ModelMessage) -> bytes:
    """One message as snapshots carry it: Pydantic AI's JSON, less the `null`s it restores itself.

    A field of the message or of one of its parts is left out when it is None and its default
    is None for every class that JSON could be read back as (the classes sharing its `kind` or
    `part_kind`), and so is a usage counter equal to its default (as Pydantic AI itself leaves
    out `unmeasured_requests`), so `ModelMessagesTypeAdapter.validate_json` gives back an equal
    message. Values inside a part (tool arguments, tool returns, metadata) are never touched.
    In the benchmark run this is 40 % of the snapshot JSON (docs/decisions/0024).
    """
    exclude: dict[str, Any] = {
        name: True for name in _nullable(type(message)) if getattr(message, name) is None
    }
    if isinstance(message, ModelResponse) and type(message.usage) is RequestUsage:
        usage = message.usage
        unset = {
            name: True for name, default in _USAGE_DEFAULTS if _is_default(getattr(usage, name), default)
        }
        if unset:
            exclude['usage'] = unset
    parts: dict[int, Any] = {}
    for index, part in enumerate(message.parts):
        names = _nullable(type(part))
        if names:
            dropped = {name: True for name in names if getattr(part, name) is None}
            if dropped:
                parts[index] = dropped
    if parts:
        exclude['parts'] = parts
    adapter = _adapter(message)
    return adapter.dump_json(message, exclude=exclude) if exclude else adapter.dump_json(message)


def _nullable(cls: type) -> tuple[str, ...]:
    """Fields of `cls` whose default is None in every class its JSON may be read back as."""
    names = _NULLABLE.get(cls)
    if names is None:
        tag = 'kind' if issubclass(cls, ModelRequest | ModelResponse) else 'part_kind'
        siblings = [c for c in _family(cls) if _default(c, tag) == _default(cls, tag)]
        fields = [f.name for f in dataclasses.fields(cls) if f.default is None and not f.name.startswith('_')]
        names = _NULLABLE[cls] = tuple(n for n in fields if all(_default(c, n) is None for c in siblings))
    return names


_NULLABLE: dict[type, tuple[str, ...]] = {}


def _family(cls: type) -> set[type]:
    """Every dataclass sharing a base with `cls` below `object`: where a tagged JSON may land."""
    root = next((b for b in reversed(cls.__mro__) if b is not object and dataclasses.is_dataclass(b)), cls)
    found, todo = set(), [root]
    while todo:
        c = todo.pop()
        if c not in found:
            found.add(c)
            todo.extend(c.__subclasses__())
    return {c for c in found if dataclasses.is_dataclass(c)}


_NO_DEFAULT = object()

_USAGE_DEFAULTS: tuple[tuple[str, Any], ...] = tuple(
    (f.name, f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
    for f in dataclasses.fields(RequestUsage)
    if f.init and not f.name.startswith('_')
)
"""Each usage field and the value a usage read back without it gets."""


def _is_default(value: Any, default: Any) -> bool:
    """Equal and of the same type: `0.0` is not left out for a default of `0`, so it reads back as `0.0`."""
    return type(value) is type(default) and value == default


def _default(cls: type, name: str) -> Any:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.default if f.default is not dataclasses.MISSING else _NO_DEFAULT
    return _NO_DEFAULT


def stamp_changes(old_json: bytes, new_json: bytes) -> dict[str, Any] | None:
    """The top-level fields that differ between two `message_json`s of one message, if only those differ.

    None when the parts or the kind differ: then the message is sent again whole. A field
    `message_json` left out is null, so a field stamped from None to a value (or back) is a
    change like any other. Field values are Pydantic AI's JSON values.
    """
    old, new = json.loads(old_json), json.loads(new_json)
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None
    if old.get('kind') != new.get('kind') or old.get('parts') != new.get('parts'):
        return None
    changed = {key: new.get(key) for key in old.keys() | new.keys() if old.get(key) != new.get(key)}
    return changed or None


MessageState = tuple[tuple[Any, ...], tuple[tuple[Any, ...], ...]]
"""A message's class and field values, and each part's, by reference (`message_state`)."""


def message_state(message: ModelMessage) -> MessageState:
    """What `message` holds at the two levels the graph stamps in place: its fields and its parts'.

    Values are kept by reference, not copied: two states compare equal, field by field, exactly
    when the message's fields and its parts' fields are equal, and then their `message_json` is
    the same unless a value inside a part or a field (a tool's arguments, a returned object) was
    itself changed in place, which the graph does not do (decision 0019).
    """
    return _values(message), tuple(_values(part) for part in message.parts)


def stamps_since(state: MessageState, message: ModelMessage) -> dict[str, Any] | None:
    """The fields stamped on `message` since `state` was taken, as `stamp_changes` gives them.

    `{field: JSON value}` of each top-level field that changed (empty when none did), or None
    when the message's class or parts changed: then it is sent again whole. Only the changed
    fields are serialised; a field `message_json` would leave out is null, as in `stamp_changes`.
    """
    values, parts = state
    if values[0] is not type(message) or parts != tuple(_values(part) for part in message.parts):
        return None
    now = _values(message)
    if now == values:
        return {}
    names = _layout(type(message))[0]
    changed = {names[i] for i, (a, b) in enumerate(zip(values, now, strict=True)) if a is not b and a != b}
    if 'usage' in changed:  # its counters are lean too (`message_json`): take them from there
        lean = json.loads(message_json(message))
        return {name: lean.get(name) for name in changed}
    return _adapter(message).dump_python(message, mode='json', include=changed)


def _values(obj: Any) -> tuple[Any, ...]:
    """`obj`'s class and the values of its dataclass fields (a message's parts apart), in one C call."""
    return _layout(type(obj))[1](obj)


_LAYOUTS: dict[type, tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]] = {}


def _layout(cls: type) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]:
    """The names `_values` reads for `cls` (`__class__` first), and the getter that reads them."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        names = ('__class__', *(f.name for f in dataclasses.fields(cls) if f.name != 'parts'))
        getter: Callable[[Any], tuple[Any, ...]] = operator.attrgetter(*names)
        layout = _LAYOUTS[cls] = (names, getter)
    return layout


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
