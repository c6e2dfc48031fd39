"""Provider validity: whether every tool call of a history is settled (a snapshot's `complete`)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart, ToolReturnPart

with warnings.catch_warnings():
    warnings.simplefilter('ignore', DeprecationWarning)
    from pydantic_ai.messages import RetryPromptPart


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
