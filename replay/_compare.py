"""How a replayed request is compared with the recorded one: volatile values normalised, then part by part.

The rules (docs/replay.md):

- a message is compared as Pydantic AI's JSON form of it (`ModelMessagesTypeAdapter`), media
  included byte for byte (base64);
- timestamps, run and conversation ids, usage, durations, provider ids and details, message
  metadata and state are dropped: they differ between any two executions;
- tool call ids are renamed in order of first appearance (`call-1`, `call-2`, ...) on each side,
  so generated ids compare equal when they name the same calls in the same order;
- instructions and system prompts are compared before the other parts and reported as
  `instructions`.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelRequest

VOLATILE = frozenset(
    {
        'timestamp',
        'run_id',
        'conversation_id',
        'usage',
        'duration',
        'provider_response_id',
        'provider_details',
        'provider_url',
        'metadata',
        'state',
        'history_digest',
        'failed_attempts',
        'workspace_ref',
    }
)
"""Keys whose values differ between two executions of the same code on the same recording."""


def normalised(message: ModelMessage) -> dict[str, Any]:
    """The message's JSON form with the volatile values dropped and tool call ids renamed."""
    (dumped,) = ModelMessagesTypeAdapter.dump_python([message], mode='json')
    names: dict[str, str] = {}
    return _strip(dumped, names)


def _strip(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in VOLATILE:
                continue
            if key == 'tool_call_id' and isinstance(item, str):
                item = names.setdefault(item, f'call-{len(names) + 1}')
            out[key] = _strip(item, names)
        return out
    if isinstance(value, list):
        return [_strip(item, names) for item in value]
    return value


def as_json(value: Any) -> str:
    """Stable, readable JSON for reports and diffs."""
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


def diff(recorded: Any, replayed: Any) -> str:
    """A unified diff of the two values' JSON, recorded first."""
    lines = difflib.unified_diff(
        as_json(recorded).splitlines(), as_json(replayed).splitlines(), 'recorded', 'replayed', lineterm=''
    )
    return '\n'.join(lines)


def request_difference(
    recorded: ModelRequest, replayed: ModelRequest, tool_names: set[str], *, instructions: bool = True
) -> tuple[str, Any, Any] | None:
    """(kind, recorded, replayed) for the first way the replayed request differs, or None when it matches.

    `tool_names` are the tools the replayed agent offers: a retry prompt for a tool the recording
    called and the agent no longer has is a `tool_name` divergence. `instructions=False` leaves
    the instructions out (a request recorded before it was sent has none yet).
    """
    old, new = normalised(recorded), normalised(replayed)
    if not instructions:
        old.pop('instructions', None)
        new.pop('instructions', None)
    if old == new:
        return None
    if old.get('instructions') != new.get('instructions'):
        return 'instructions', old.get('instructions'), new.get('instructions')
    old_system = [p for p in old['parts'] if p.get('part_kind') == 'system-prompt']
    new_system = [p for p in new['parts'] if p.get('part_kind') == 'system-prompt']
    if old_system != new_system:
        return 'instructions', old_system, new_system
    for was, now in zip(old['parts'], new['parts'], strict=False):
        if was == now:
            continue
        retried = now.get('part_kind') == 'retry-prompt' or now.get('outcome') == 'retried'
        if (
            retried
            and was.get('tool_call_id') == now.get('tool_call_id')
            and now.get('tool_name') not in tool_names
        ):
            return 'tool_name', was, now
        return 'request_content', was, now
    return 'request_content', old['parts'], new['parts']
