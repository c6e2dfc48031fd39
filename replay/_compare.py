"""How a replayed request is compared with the recorded one: volatile values normalised, then part by part.

The rules (docs/replay.md):

- a message is compared as Pydantic AI's JSON form of it (`ModelMessagesTypeAdapter`), media
  included byte for byte (base64);
- timestamps, run and conversation ids, usage, durations, provider ids and details, message
  metadata and state are dropped: they differ between any two executions;
- tool call ids are renamed in order of first appearance (`call-1`, `call-2`, ...) on each side,
  so generated ids compare equal when they name the same calls in the same order;
- a tool call's arguments are compared as the JSON object they hold, whether the part carries
  them as text or as a dict (a capability that rebuilds a call's arguments unchanged still matches);
- instructions and system prompts are compared before the other parts and reported as
  `instructions`;
- a call on its way to its tool is compared with the recorded call as the tool validates it
  today (`validated`): the tool's own parsing is normalisation, a capability's change is not.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    ToolCallPart,
)
from pydantic_ai.tools import RunContext
from pydantic_core import to_jsonable_python

from stepstream.producer import definitions_of, fingerprint

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
    out: dict[str, Any] = _strip(dumped, names)
    for part in out.get('parts', ()):
        if part.get('part_kind') == 'tool-call':
            part['args'] = _arguments(part.get('args'))
    return out


def _arguments(args: Any) -> Any:
    """A call's arguments as the JSON they hold: text parsed, none as `{}`, text that is not JSON as is."""
    if args is None or args == '':
        return {}
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


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


def response_difference(
    recorded: ModelResponse, replayed: ModelResponse
) -> tuple[str, Any, Any, ToolCallPart | None] | None:
    """(kind, recorded, replayed, call) for the first way a response differs from the recorded one, or None.

    `replayed` is the response as it entered the replayed history, after the code's capabilities
    had their say. When the first part that differs is the same tool call (same place, same tool)
    with other arguments, the kind is `tool_arguments`, the values are the two calls' arguments
    and `call` is the recorded call. Anything else (text rewritten, a call added, dropped or
    renamed, another finish reason) is `response`, with both responses' parts (or both whole
    responses, when only fields outside the parts differ).
    """
    old, new = normalised(recorded), normalised(replayed)
    if old == new:
        return None
    for index, (was, now) in enumerate(zip(old['parts'], new['parts'], strict=False)):
        if was == now:
            continue
        call = recorded.parts[index]
        if (
            isinstance(call, ToolCallPart)
            and now.get('part_kind') == 'tool-call'
            and {**was, 'args': None} == {**now, 'args': None}
        ):
            return 'tool_arguments', was['args'], now['args'], call
        break
    if old['parts'] == new['parts']:
        return 'response', old, new, None
    return 'response', old['parts'], new['parts'], None


def arguments_differ(recorded: Any, executed: Any) -> bool:
    """Whether two validated argument sets differ as JSON (models, dates and the like by their JSON form)."""
    return to_jsonable_python(recorded, fallback=str) != to_jsonable_python(executed, fallback=str)


def validated(ctx: RunContext[Any], call: ToolCallPart) -> Any:
    """The call's arguments as the tool validates them today; as recorded when it no longer can."""
    manager = ctx.tool_manager
    tool = manager.tools.get(call.tool_name) if manager is not None and manager.tools is not None else None
    if tool is None:
        return call.args_as_dict()
    try:
        if isinstance(call.args, str):
            return tool.args_validator.validate_json(call.args or '{}', context=ctx.validation_context)
        return tool.args_validator.validate_python(call.args or {}, context=ctx.validation_context)
    except ValueError:  # pydantic's ValidationError: the tool refuses it (on_tool_validate_error said so)
        return call.args_as_dict()


def definitions_difference(
    recorded: tuple[str, dict[str, Any]] | None, request_context: Any
) -> tuple[str, Any, Any] | None:
    """(kind, recorded, replayed) when the request's tools, output or settings are not the recorded ones."""
    if recorded is None:
        return None  # written before schema v6: not checked (the report says so)
    text = definitions_of(request_context)
    if fingerprint(text) == recorded[0]:
        return None
    was, now = recorded[1], json.loads(text)
    if was == now:
        return None  # the same definitions written in another order
    if was.get('tools') != now['tools']:
        old_tools = {t['name']: t for t in was.get('tools', [])}
        new_tools = {t['name']: t for t in now['tools']}
        changed = sorted(
            n for n in old_tools.keys() | new_tools.keys() if old_tools.get(n) != new_tools.get(n)
        )
        return (
            'tool_definitions',
            {n: old_tools.get(n) for n in changed},
            {n: new_tools.get(n) for n in changed},
        )
    if was.get('output') != now['output']:
        return 'output_type', was.get('output'), now['output']
    return 'settings', was.get('settings'), now['settings']
