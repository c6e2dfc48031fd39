"""What the explorer's templates draw: messages as parts a person reads, and the diff of two histories.

Templates stay free of Pydantic AI's types: each message becomes a `MessageView` of `PartView`s
(text, an image, a tool call with its arguments, ...), built here once.
"""

from __future__ import annotations

import base64
import difflib
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai.messages import (
    BaseToolCallPart,
    BaseToolReturnPart,
    BinaryContent,
    FilePart,
    FileUrl,
    ImageUrl,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    RetryPromptPart,
    SystemPromptPart,
    TextPart,
    ThinkingPart,
    UserPromptPart,
)


@dataclass
class ItemView:
    """One piece of a part's content: text, an image, a link to media, or JSON."""

    kind: str
    """`text`, `image`, `media` or `json`."""
    text: str = ''
    src: str = ''
    media_type: str = ''


@dataclass
class PartView:
    """One part of a message, as the explorer shows it."""

    kind: str
    """Pydantic AI's `part_kind` (`user-prompt`, `text`, `tool-call`, `tool-return`, ...)."""
    title: str
    items: list[ItemView] = field(default_factory=list)
    tool_call_id: str | None = None
    changed: bool = False
    """In a diff: some field of this part differs from its counterpart's."""


@dataclass
class FieldChange:
    """A field that differs between a message and its counterpart in the other snapshot."""

    path: str
    """Where in Pydantic AI's JSON of the message: `parts[0].timestamp`, `usage.output_tokens`, ..."""
    left: str
    right: str


@dataclass
class MessageView:
    """One request or response of a history."""

    index: int
    kind: str
    """`request` or `response`."""
    parts: list[PartView]
    changes: list[FieldChange] = field(default_factory=list)
    """In a diff: the fields that differ from the message in the other snapshot's place."""


def message_views(messages: list[ModelMessage], start: int = 0) -> list[MessageView]:
    """The history as the explorer draws it, message `i` numbered `start + i`."""
    return [
        MessageView(
            index=start + i,
            kind='request' if isinstance(m, ModelRequest) else 'response',
            parts=[_part(p) for p in m.parts],
        )
        for i, m in enumerate(messages)
    ]


def _part(part: Any) -> PartView:
    kind = getattr(part, 'part_kind', type(part).__name__)
    if isinstance(part, SystemPromptPart):
        return PartView(kind, 'system prompt', [ItemView('text', part.content)])
    if isinstance(part, UserPromptPart):
        return PartView(kind, 'user', items_of(part.content))
    if isinstance(part, TextPart):
        return PartView(kind, 'text', [ItemView('text', part.content)])
    if isinstance(part, ThinkingPart):
        return PartView(kind, 'thinking', [ItemView('text', part.content)])
    if isinstance(part, BaseToolCallPart):
        return PartView(
            kind,
            f'tool call: {part.tool_name}',
            [ItemView('json', pretty(part.args_as_dict()))],
            part.tool_call_id,
        )
    if isinstance(part, BaseToolReturnPart):
        return PartView(kind, f'tool return: {part.tool_name}', items_of(part.content), part.tool_call_id)
    if isinstance(part, RetryPromptPart):
        content = part.content if isinstance(part.content, str) else pretty(part.content)
        return PartView(
            kind, f'retry: {part.tool_name or "output"}', [ItemView('text', content)], part.tool_call_id
        )
    if isinstance(part, FilePart):
        return PartView(kind, 'file', [_item(part.content)])
    dumped = ModelMessagesTypeAdapter.dump_python([ModelRequest(parts=[part])], mode='json')[0]['parts'][0]
    return PartView(kind, kind, [ItemView('json', pretty(dumped))])


def items_of(content: Any) -> list[ItemView]:
    """A part's content (text, media, JSON, or a list of them) as items the templates draw."""
    if isinstance(content, list | tuple):
        return [_item(c) for c in content]
    return [_item(content)]


def _item(item: Any) -> ItemView:
    if isinstance(item, str):
        return ItemView('text', item)
    if isinstance(item, BinaryContent):
        if item.is_image:
            encoded = base64.b64encode(item.data).decode()
            return ItemView(
                'image', src=f'data:{item.media_type};base64,{encoded}', media_type=item.media_type
            )
        return ItemView('text', f'[{item.media_type}, {len(item.data)} bytes inline]')
    if isinstance(item, FileUrl):
        kind = 'image' if isinstance(item, ImageUrl) else 'media'
        return ItemView(kind, src=item.url, media_type=item.media_type)
    return ItemView('json', pretty(item))


def pretty(value: Any) -> str:
    """Indented JSON of a value, or its repr when it is not JSON."""
    try:
        return json.dumps(value, indent=2, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(value)


@dataclass
class DiffRow:
    """A stretch of two histories: the same messages, or what one has in place of the other's."""

    op: str
    """`equal`, `replace`, `delete` (only in the left) or `insert` (only in the right)."""
    left: list[MessageView]
    right: list[MessageView]


def diff(left: list[ModelMessage], right: list[ModelMessage]) -> list[DiffRow]:
    """The two histories aligned message by message (messages compared as Pydantic AI's JSON).

    Where a stretch of one replaces a stretch of the other, each message is compared with the
    one in its place field by field, and both carry the `changes` (fields Pydantic AI stamps
    later, such as a timestamp or a usage, show up as exactly that).
    """
    a = [ModelMessagesTypeAdapter.dump_json([m]) for m in left]
    b = [ModelMessagesTypeAdapter.dump_json([m]) for m in right]
    rows = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        row = DiffRow(op, message_views(left[i1:i2], i1), message_views(right[j1:j2], j1))
        if op == 'replace':
            for k, (lv, rv) in enumerate(zip(row.left, row.right, strict=False)):
                changes = field_changes(_json(left[i1 + k]), _json(right[j1 + k]))
                lv.changes = rv.changes = changes
                for view in (lv, rv):
                    touched = {int(c.path[6:].split(']')[0]) for c in changes if c.path.startswith('parts[')}
                    for index, part in enumerate(view.parts):
                        part.changed = index in touched
        rows.append(row)
    return rows


def _json(message: ModelMessage) -> Any:
    return ModelMessagesTypeAdapter.dump_python([message], mode='json')[0]


def field_changes(left: Any, right: Any, path: str = '') -> list[FieldChange]:
    """Every leaf field where two JSON values differ, with its path (`parts[1].content`)."""
    if isinstance(left, dict) and isinstance(right, dict):
        found = []
        for key in [*left, *(k for k in right if k not in left)]:
            found += field_changes(left.get(key), right.get(key), f'{path}.{key}' if path else str(key))
        return found
    if isinstance(left, list) and isinstance(right, list) and len(left) == len(right):
        found = []
        for i, (x, y) in enumerate(zip(left, right, strict=True)):
            found += field_changes(x, y, f'{path}[{i}]')
        return found
    if left == right:
        return []
    return [FieldChange(path or '(message)', _short(left), _short(right))]


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + '…'
