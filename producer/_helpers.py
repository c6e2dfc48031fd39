"""The provider-validity check, and the per-run context shared by the hooks."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart, ToolReturnPart

with warnings.catch_warnings():
    warnings.simplefilter('ignore', DeprecationWarning)
    from pydantic_ai.messages import RetryPromptPart

if TYPE_CHECKING:
    from stepstream.producer._capability import StepPersistence

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


def is_provider_valid(messages: Sequence[ModelMessage]) -> bool:
    """True when every tool call in `messages` is settled, in order, exactly once.

    A call is settled by a later tool return (a retry is a return with `outcome='retried'`) or
    by a legacy tool-bound retry prompt. A return or retry prompt that answers no open call
    (orphan, duplicate, or before its call) makes the history invalid. Empty is valid.
    A snapshot is `complete` when this holds and `interrupted` otherwise.
    """
    scan = ToolCallScan()
    for message in messages:
        scan.advance(message)
    return scan.settled


@dataclass(slots=True)
class ToolCallScan:
    """The tool calls left open after reading a history up to some point.

    Kept between snapshots so that each one only reads what is new, instead of the whole
    history at every step.
    """

    open_calls: set[str] = field(default_factory=set)
    broken: bool = False
    """A return or retry prompt answered no open call."""

    @property
    def settled(self) -> bool:
        """Whether the history read so far is provider-valid."""
        return not self.broken and not self.open_calls

    def copy(self) -> ToolCallScan:
        """An independent copy, to read on from."""
        return ToolCallScan(set(self.open_calls), self.broken)

    def advance(self, message: ModelMessage) -> None:
        """Read one more message."""
        if self.broken:
            return
        if isinstance(message, ModelResponse):
            self.open_calls.update(p.tool_call_id for p in message.parts if isinstance(p, ToolCallPart))
            return
        for part in message.parts:
            tool_bound_retry = isinstance(part, RetryPromptPart) and part.tool_name is not None
            if isinstance(part, ToolReturnPart) or tool_bound_retry:
                assert isinstance(part, ToolReturnPart | RetryPromptPart)
                if part.tool_call_id not in self.open_calls:
                    self.broken = True
                    return
                self.open_calls.remove(part.tool_call_id)


_MESSAGE = TypeAdapter(ModelMessage)


def message_json(message: ModelMessage) -> bytes:
    """One message as Pydantic AI's own JSON (the form snapshots carry and compare)."""
    return _MESSAGE.dump_json(message)


RECENT = 2
"""How many of a snapshot's last messages the next delta compares by JSON (see DeltaTracker)."""


@dataclass(frozen=True, slots=True)
class SnapshotPlan:
    """What the next snapshot record holds, and what the tracker keeps once it is acknowledged."""

    prefix_len: int
    tail_json: list[bytes]
    """Pydantic AI JSON of each message after `prefix_len`."""
    valid: bool
    """`is_provider_valid` of the whole history."""
    messages: Sequence[ModelMessage]
    recent_from: int
    recent_json: list[bytes]
    scan_at_recent: ToolCallScan


class DeltaTracker:
    """Plans each snapshot as (prefix shared with the previous snapshot, new tail), cheaply.

    Comparing or validating whole histories at every step would cost O(history) per step. The
    older part of the previous snapshot is compared by identity (the graph appends to one list,
    so unchanged messages are the same objects) and else by value (a history processor or
    compaction replaces objects). Its last `RECENT` messages, the only ones the graph still
    touches in place (a folded tool-return request is stamped with its run id and timestamp once
    it is sent), are compared by their JSON. Provider validity is read on from the tool calls
    that were open at that point. See docs/decisions/0003-delta-snapshots.md.
    """

    def __init__(self) -> None:
        """Start with no previous snapshot: the first plan holds the whole history."""
        self._refs: Sequence[ModelMessage] = ()
        self._recent_from = 0
        self._recent_json: list[bytes] = []
        self._scan_at_recent = ToolCallScan()
        self.saved = False

    def plan(self, messages: Sequence[ModelMessage]) -> SnapshotPlan:
        """The delta of `messages` against the last committed snapshot, and its validity."""
        refs = self._refs
        limit = min(len(refs), len(messages))
        stable = min(limit, self._recent_from)
        i = 0
        while i < stable and (refs[i] is messages[i] or refs[i] == messages[i]):
            i += 1
        tail: list[bytes] = []
        if i == stable:
            while i < limit:
                encoded = message_json(messages[i])
                if encoded != self._recent_json[i - self._recent_from]:
                    tail.append(encoded)  # the first changed message starts the new tail
                    break
                i += 1
        prefix_len = i
        tail.extend(message_json(m) for m in messages[prefix_len + len(tail) :])

        # Validity, read on from the last point known to be unchanged.
        if prefix_len >= self._recent_from:
            scan, start = self._scan_at_recent.copy(), self._recent_from
        else:
            scan, start = ToolCallScan(), 0
        recent_from = max(len(messages) - RECENT, 0)
        if recent_from < start:
            scan, start = ToolCallScan(), 0
        scan_at_recent = scan.copy()
        for index in range(start, len(messages)):
            if index == recent_from:
                scan_at_recent = scan.copy()
            scan.advance(messages[index])
        if recent_from == len(messages):
            scan_at_recent = scan.copy()
        recent_json = [
            tail[j - prefix_len] if j >= prefix_len else message_json(messages[j])
            for j in range(recent_from, len(messages))
        ]
        return SnapshotPlan(
            prefix_len=prefix_len,
            tail_json=tail,
            valid=scan.settled,
            messages=messages,
            recent_from=recent_from,
            recent_json=recent_json,
            scan_at_recent=scan_at_recent,
        )

    def unchanged(self, plan: SnapshotPlan) -> bool:
        """True when the planned snapshot is exactly the last saved one."""
        return self.saved and plan.prefix_len == len(plan.messages) == len(self._refs)

    def commit(self, plan: SnapshotPlan) -> None:
        """Remember a snapshot once the broker acknowledged it."""
        self._refs = list(plan.messages)  # shallow: the next plan compares identities against it
        self._recent_from = plan.recent_from
        self._recent_json = plan.recent_json
        self._scan_at_recent = plan.scan_at_recent
        self.saved = True
