"""What a replay serves in place of the model and of the tools, so that every capability has its say.

Answering a model request from `wrap_model_request` without calling its handler would skip every
capability's `before_model_request` and `after_model_request`: a capability that rewrites the
response (an on-call routing table that now pages another team) would replay as a match. So the
request goes down the handler as in production, and the model that serves it is `Served`: it
answers with the recorded response the replayer hands it, streamed or not, and every
capability's `after_model_request` runs on that answer. A tool call likewise goes down its
handler, through every capability's `before_tool_execute`, until the replayer's own raises
`Answer` in place of running the tool.

The recording holds each response as it entered the history, after the recorded code's
capabilities: that is what is served. A capability that changes its own output again when given
it (not idempotent) reads as a divergence; docs/replay.md says so.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.models import CompletedStreamedResponse, Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import RunContext


class Answers(Protocol):
    """What the served model asks: the response being served now, or None (a fork's live step)."""

    answer: ModelResponse | None


class Served(WrapperModel):
    """Answers with the replayer's current response; the wrapped model only when there is none."""

    def __init__(self, wrapped: Model, answers: Answers) -> None:
        super().__init__(wrapped)
        self.answers = answers

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        """The recorded response (a copy per attempt), or the wrapped model's when none is served."""
        answer = self.answers.answer
        if answer is None:
            return await super().request(messages, model_settings, model_request_parameters)
        return copy.deepcopy(answer)

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        """A streamed request (an event stream handler listens): the recorded response, part by part."""
        answer = self.answers.answer
        if answer is None:
            async with super().request_stream(
                messages, model_settings, model_request_parameters, run_context
            ) as stream:
                yield stream
            return
        yield CompletedStreamedResponse(
            copy.deepcopy(answer), model_request_parameters=model_request_parameters, replay_events=True
        )


class Answer(Exception):
    """Raised by the replayer's `before_tool_execute` with recorded tools: its `wrap_tool_execute` answers.

    It travels only between the two: every capability's `before_tool_execute` ran before it, and
    every capability's `wrap_tool_execute` outside the replayer's sees the recorded result returned
    (or the recorded retry or failure raised), as from a tool.
    """
