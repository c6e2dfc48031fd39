"""The reference's record types, imported when first needed: pydantic-ai-harness is no dependency.

A user moving from the reference has it installed; stepstream itself runs without it, so nothing
here is imported before a `ReferenceStore` answers its first read.
"""

from __future__ import annotations

import importlib
from types import ModuleType

HARNESS = 'pydantic_ai_harness.step_persistence'
INSTALL = 'pip install --no-deps pydantic-ai-harness'
"""Its step persistence runs on stepstream's Pydantic AI; its own pins would move Pydantic AI back."""


def harness() -> ModuleType:
    """`pydantic_ai_harness.step_persistence`, or an `ImportError` saying how to install it."""
    try:
        return importlib.import_module(HARNESS)
    except ImportError as exc:
        raise ImportError(
            f'stepstream.reference answers with the records of pydantic-ai-harness, which is not '
            f'installed here ({exc}): {INSTALL}'
        ) from exc
