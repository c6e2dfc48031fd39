"""What a model request is made with: its tools' definitions, its output mode and tools, its settings.

Written on each `model_request_started` as a fingerprint, and in full when it changed within the
run (always on its first request), so that a replay can tell a changed tool definition, output
type or model setting from a changed prompt (docs/replay.md).
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic_ai.models import ModelRequestContext
from pydantic_core import to_json

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


def _tool(tool: Any) -> dict[str, Any]:
    return {name: getattr(tool, name, None) for name in TOOL_FIELDS}


def definitions_of(request_context: ModelRequestContext) -> str:
    """A model request's definitions as JSON: `tools`, `output` and `settings`.

    Written by pydantic-core in the order the code builds them (no key sorting: a reader compares
    them parsed, and a fingerprint that differs only by order costs one more copy in the log).
    """
    parameters = request_context.model_request_parameters
    definitions = {
        'tools': [_tool(t) for t in parameters.function_tools],
        'output': {
            'mode': parameters.output_mode,
            'tools': [_tool(t) for t in parameters.output_tools],
            'object': parameters.output_object,
            'allow_text_output': parameters.allow_text_output,
            'allow_image_output': parameters.allow_image_output,
        },
        'settings': request_context.model_settings or {},
    }
    return to_json(definitions, fallback=_opaque).decode()


def fingerprint(text: str) -> str:
    """SHA-256 (hex) of the definitions' JSON."""
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
