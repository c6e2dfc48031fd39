"""A tool call's sealed content opened for a reader: a deferred call's arguments and metadata, its decisions'.

With erasure on (decision 0033), a `deferred` transition's `args` and `deferral_metadata`, and a
decision's `args`, `result` and message (`error`), are sealed with the key of the run's conversation,
bound to the run, the tool call and the field. A reader opens them with its `KeyRing`; once
`stepstream forget` destroyed the key they read as None, and the call says `content_erased`. A reader
without keys (erasure off on its side) shows them as stored, sealed: `resume_run` refuses those.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from stepstream.erasure import (
    SEALED_CALL_ARGS,
    SEALED_CALL_METADATA,
    SEALED_DECISION_ARGS,
    SEALED_DECISION_ERROR,
    SEALED_DECISION_RESULT,
    is_sealed_text,
)
from stepstream.schemas import ToolEffectRecord

if TYPE_CHECKING:
    from stepstream.erasure import KeyRing

_Erased = object()
"""What `_open` returns for content whose key was destroyed."""


def open_effect(effect: ToolEffectRecord, keys: KeyRing | None) -> ToolEffectRecord:
    """`effect` with its sealed content opened with `keys`; erased content None, and `content_erased` set."""
    if keys is None:
        return effect
    erased = False
    where = (effect.run_id, effect.tool_call_id)

    def opened(value: str | None, context: str) -> str | None:
        nonlocal erased
        text = _open(value, keys, *where, context)
        if text is _Erased:
            erased = True
            return None
        assert text is None or isinstance(text, str)
        return text

    args = opened(effect.args, SEALED_CALL_ARGS)
    metadata = opened(effect.deferral_metadata, SEALED_CALL_METADATA)
    resolutions = [
        dataclasses.replace(
            r,
            args=opened(r.args, SEALED_DECISION_ARGS),
            result=opened(r.result, SEALED_DECISION_RESULT),
            error=opened(r.error, SEALED_DECISION_ERROR),
        )
        for r in effect.resolutions
    ]
    if resolutions == effect.resolutions and (args, metadata) == (effect.args, effect.deferral_metadata):
        return effect
    resolution = next((r for r in resolutions if r.applied), None) if effect.resolution is not None else None
    return dataclasses.replace(
        effect,
        args=args,
        deferral_metadata=metadata,
        resolutions=resolutions,
        resolution=resolution,
        content_erased=erased,
    )


def _open(value: str | None, keys: KeyRing, *context: str) -> str | object | None:
    """The plaintext of `value` if sealed (`_Erased` when its key was destroyed), else `value`."""
    if value is None or not is_sealed_text(value):
        return value
    key = keys.opening(value)
    return _Erased if key is None else key.open_text(value, *context)


def any_content_erased(found: object) -> bool:
    """Whether a call in `found` (one, none, or a list of calls or of `WaitingCall`s) reads as erased.

    `with_keys` then looks once more for its key.
    """
    items = found if isinstance(found, list) else [found]
    calls = (getattr(item, 'effect', item) for item in items)
    return any(isinstance(call, ToolEffectRecord) and call.content_erased for call in calls)
