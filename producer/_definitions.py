"""What a model request is made with: its tools' definitions, its output mode and tools, its settings.

Written on each `model_request_started` as a fingerprint, and in full when it changed within the
run (always on its first request), so that a replay can tell a changed tool definition, output
type or model setting from a changed prompt (docs/replay.md).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic_ai.models import ModelRequestContext, ModelRequestParameters
from pydantic_ai.tools import ToolDefinition
from pydantic_core import to_jsonable_python

TOOL_FIELDS = (
    'name',
    'description',
    'parameters_json_schema',
    'strict',
    'kind',
    'sequential',
    'outer_typed_dict_key',
    'return_schema',
)
"""What of a `ToolDefinition` the model is shown or that changes how the call is made (not ids)."""


def _opaque(value: object) -> str:
    return f'<{type(value).__name__}>'  # never an address: the same settings fingerprint alike


def _tool(tool: ToolDefinition) -> dict[str, Any]:
    return {name: to_jsonable_python(getattr(tool, name, None), fallback=_opaque) for name in TOOL_FIELDS}


def request_definitions(model_settings: Any, parameters: ModelRequestParameters) -> dict[str, Any]:
    """The request's definitions as JSON-ready data: `tools`, `output` and `settings`."""
    return {
        'tools': [_tool(t) for t in parameters.function_tools],
        'output': {
            'mode': parameters.output_mode,
            'tools': [_tool(t) for t in parameters.output_tools],
            'object': to_jsonable_python(parameters.output_object, fallback=_opaque),
            'allow_text_output': parameters.allow_text_output,
            'allow_image_output': parameters.allow_image_output,
        },
        'settings': to_jsonable_python(dict(model_settings or {}), fallback=_opaque),
    }


def definitions_of(request_context: ModelRequestContext) -> str:
    """A model request's definitions (`request_definitions`) as canonical JSON: sorted keys, no spaces."""
    definitions = request_definitions(
        request_context.model_settings, request_context.model_request_parameters
    )
    return json.dumps(definitions, sort_keys=True, separators=(',', ':'), ensure_ascii=False)


def fingerprint(text: str) -> str:
    """SHA-256 (hex) of the canonical JSON."""
    return hashlib.sha256(text.encode()).hexdigest()


class Definitions:
    """A run's model requests' definitions: each stamped with its fingerprint, in full when it changed."""

    def __init__(self) -> None:
        self.latest: str | None = None
        """The fingerprint of the run's latest request's definitions."""

    def stamp(self, definitions: str | None) -> tuple[str | None, str | None]:
        """(fingerprint, the definitions if they differ from the latest request's, else None)."""
        if definitions is None:
            return None, None
        found = fingerprint(definitions)
        if found == self.latest:
            return found, None  # unchanged: the run's earlier event holds them
        self.latest = found
        return found, definitions
