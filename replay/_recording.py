"""A recorded run as replay reads it: the history it began from, its requests, responses and tool outcomes.

Read once per run through a `ProjectionReader`: the run's latest snapshot (complete or
interrupted, media restored by the reader), its record (status, agent, conversation) and the
tool effects the ledger still holds in doubt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from stepstream.errors import StepStreamError

if TYPE_CHECKING:
    from stepstream.readmodel import ProjectionReader
    from stepstream.schemas import RunRecord, ToolEffectRecord


class NotReplayable(StepStreamError):
    """The run cannot be replayed: unknown, erased, or with nothing recorded to replay."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        """`unknown`, `erased` or `empty`."""


@dataclass(slots=True)
class Recording:
    """One recorded run, split the way a replay serves it."""

    run: RunRecord
    history: list[ModelMessage]
    """The messages the run was given (`message_history`), before its own."""
    requests: list[ModelRequest]
    """The run's own requests, in order; one more than `responses` when the run ended at a request."""
    responses: list[ModelResponse]
    """The model's responses, in order: what replay serves."""
    interrupted: bool
    """The latest snapshot is interrupted: the run did not end there cleanly."""
    definitions: dict[int, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    """By step: the fingerprint and the definitions (parsed) of what the step's model request was made
    with (since schema v6; empty for runs written before, and a step whose JSON does not parse is
    left out: its check is skipped)."""
    in_doubt: dict[str, ToolEffectRecord] = field(default_factory=dict)
    """By tool call id: effects `started` without an end (`unknown_after_crash` once the run is stale)."""
    failed: dict[str, str] = field(default_factory=dict)
    """By tool call id: the calls that ended by raising, with their error."""

    def in_doubt_text(self) -> str:
        """The calls in doubt, for a report: each tool's name and call id, and whether its run is gone."""
        return ', '.join(
            f'tool {e.tool_name!r} ({e.tool_call_id}, '
            f'{"unknown_after_crash" if e.unknown_after_crash else "in flight"})'
            for e in self.in_doubt.values()
        )

    @property
    def user_prompt(self) -> str | list[Any] | None:
        """What the run was started with: its first request's user prompt, or None."""
        first = self.requests[0] if self.requests else None
        for part in first.parts if first is not None else ():
            if isinstance(part, UserPromptPart):
                return part.content if isinstance(part.content, str) else list(part.content)
        return None

    def outcome(self, tool_call_id: str) -> ToolReturnPart | RetryPromptPart | None:
        """What the recorded run got back for a tool call: its return or its retry prompt, or None."""
        for request in self.requests:
            for part in request.parts:
                if isinstance(part, ToolReturnPart | RetryPromptPart) and part.tool_call_id == tool_call_id:
                    return part
        return None

    def call(self, tool_call_id: str) -> ToolCallPart | None:
        """The recorded model's call with this id."""
        for response in self.responses:
            for part in response.parts:
                if isinstance(part, ToolCallPart) and part.tool_call_id == tool_call_id:
                    return part
        return None


async def load_recording(reader: ProjectionReader, run_id: str) -> Recording:
    """The run `run_id` as its projection holds it; `NotReplayable` when it cannot be replayed."""
    from stepstream.erasure import ContentErased

    run = await reader.get_run(run_id)
    if run is None:
        raise NotReplayable(f'no run {run_id!r} in the projection', reason='unknown')
    try:
        snapshot = await reader.latest_snapshot(run_id, include_interrupted=True)
    except ContentErased as exc:
        raise NotReplayable(f'erased: cannot replay run {run_id!r} ({exc})', reason='erased') from exc
    if snapshot is not None and snapshot.erased:
        raise NotReplayable(
            f'erased: cannot replay run {run_id!r}: its conversation {run.conversation_id!r} was forgotten',
            reason='erased',
        )
    if snapshot is None or not snapshot.messages:
        raise NotReplayable(f'run {run_id!r} has no snapshot to replay', reason='empty')
    history, own = _split(snapshot.messages)
    effects = await reader.list_tool_effects(run_id)  # once: the calls in doubt and the failed ones
    definitions: dict[int, tuple[str, dict[str, Any]]] = {}
    latest: dict[str, Any] | None = None
    for event in await reader.list_events(run_id):
        if event.kind == 'model_request_started' and event.request_fingerprint is not None:
            latest = _parsed(event.request_definitions) or latest
            if latest is not None:
                definitions[event.step_index] = (event.request_fingerprint, latest)
    return Recording(
        run=run,
        history=history,
        requests=[m for m in own if isinstance(m, ModelRequest)],
        responses=[m for m in own if isinstance(m, ModelResponse)],
        interrupted=snapshot.state != 'complete',
        definitions=definitions,
        in_doubt={e.tool_call_id: e for e in effects if e.status == 'started'},
        failed={e.tool_call_id: e.error or 'an error' for e in effects if e.status == 'failed'},
    )


def _split(messages: list[ModelMessage]) -> tuple[list[ModelMessage], list[ModelMessage]]:
    """(the history the run was given, its own messages): its own carry the run's Pydantic AI run id."""
    own_id = messages[-1].run_id
    first = next((i for i, m in enumerate(messages) if m.run_id == own_id), 0) if own_id else 0
    return list(messages[:first]), list(messages[first:])


def _parsed(text: str | None) -> dict[str, Any] | None:
    """Recorded definitions as data; None when absent or not a JSON object (anything may be on a topic)."""
    if text is None:
        return None
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None
