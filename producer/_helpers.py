"""Run-id rules, the provider-validity check, and the per-run context shared by the hooks."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart, ToolReturnPart

with warnings.catch_warnings():
    warnings.simplefilter('ignore', DeprecationWarning)
    from pydantic_ai.messages import RetryPromptPart

if TYPE_CHECKING:
    from stepstream.producer._capability import StepPersistence

_RUN_ID = re.compile(r'[A-Za-z0-9_.-]{1,200}')

current_run: ContextVar[StepPersistence[Any] | None] = ContextVar('stepstream.current_run', default=None)
"""The run-bound capability of the innermost persisted run in this task.

Set around a run by `StepPersistence.wrap_run`. A delegate started from a tool reads it in
`for_run` to learn its parent; `annotate_tool_effect` reads it to find the run to annotate.
A ContextVar (not pydantic-ai's own run context) because the nested run overwrites those
before the delegate's capability can see its parent.
"""


def current_run_id() -> str | None:
    """The run id of the innermost persisted run in this task, or None.

    Pass it as `parent_run_id` to a delegate in another process, where ContextVars do not reach.
    """
    run = current_run.get()
    return run.run_id if run is not None else None


def check_run_id(run_id: str, *, what: str = 'run_id') -> str:
    """Return `run_id` if it is safe as a Kafka key, a RocksDB key and a path segment."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id) or '..' in run_id:
        raise ValueError(
            f'{what} {run_id!r} is not allowed: use 1 to 200 characters from [A-Za-z0-9_.-] '
            'and no ".." (ids end up in keys and paths)'
        )
    return run_id


def is_provider_valid(messages: Sequence[ModelMessage]) -> bool:
    """True when every tool call in `messages` is settled, in order, exactly once.

    A call is settled by a later tool return (a retry is a return with `outcome='retried'`) or
    by a legacy tool-bound retry prompt. A return or retry prompt that answers no open call
    (orphan, duplicate, or before its call) makes the history invalid. Empty is valid.
    A snapshot is `complete` when this holds and `interrupted` otherwise.
    """
    open_calls: set[str] = set()
    for message in messages:
        if isinstance(message, ModelResponse):
            open_calls.update(p.tool_call_id for p in message.parts if isinstance(p, ToolCallPart))
            continue
        for part in message.parts:
            tool_bound_retry = isinstance(part, RetryPromptPart) and part.tool_name is not None
            if isinstance(part, ToolReturnPart) or tool_bound_retry:
                assert isinstance(part, ToolReturnPart | RetryPromptPart)
                if part.tool_call_id not in open_calls:
                    return False
                open_calls.remove(part.tool_call_id)
    return not open_calls


_MESSAGE = TypeAdapter(ModelMessage)


def message_json(message: ModelMessage) -> bytes:
    """One message as Pydantic AI's own JSON (the form snapshots carry and compare)."""
    return _MESSAGE.dump_json(message)


class DeltaTracker:
    """Computes each snapshot as (prefix shared with the previous snapshot, new tail).

    Comparing whole histories at every step would cost O(history) per step. Instead the older
    part is compared by identity (the graph appends to one list, so unchanged messages are the
    same objects) and the previous tail, the only part the graph may still touch in place (a
    folded tool-return request is stamped with its run id after it was saved), is compared by
    its JSON. A message replaced by a history processor or compaction is a different object and
    is caught by value. See docs/decisions/0003-delta-snapshots.md.
    """

    def __init__(self) -> None:
        """Start with no previous snapshot: the first delta is the whole history."""
        self._refs: list[ModelMessage] = []
        self._tail_start = 0
        self._tail_json: list[bytes] = []
        self.saved = False

    def delta(self, messages: Sequence[ModelMessage]) -> tuple[int, list[bytes]]:
        """The shared prefix length and the JSON of each message after it."""
        refs = self._refs
        limit = min(len(refs), len(messages))
        stable = min(limit, self._tail_start)
        i = 0
        while i < stable and (refs[i] is messages[i] or refs[i] == messages[i]):
            i += 1
        tail: list[bytes] = []
        if i == stable:
            # The previous tail is compared by JSON; a mismatch's encoding starts the new tail.
            while i < limit:
                encoded = message_json(messages[i])
                if encoded != self._tail_json[i - self._tail_start]:
                    tail.append(encoded)
                    break
                i += 1
        prefix_len = i
        tail.extend(message_json(m) for m in messages[prefix_len + len(tail) :])
        return prefix_len, tail

    def unchanged(self, messages: Sequence[ModelMessage]) -> bool:
        """True when `messages` is exactly the last saved snapshot."""
        if not self.saved or len(messages) != len(self._refs):
            return False
        prefix_len, _ = self.delta(messages)
        return prefix_len == len(messages)

    def commit(self, messages: Sequence[ModelMessage], prefix_len: int, tail_json: list[bytes]) -> None:
        """Remember a snapshot once the broker acknowledged it."""
        self._refs = list(messages)  # shallow: the next delta compares identities against it
        self._tail_start = prefix_len
        self._tail_json = tail_json
        self.saved = True
