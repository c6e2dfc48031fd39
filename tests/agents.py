"""Small deterministic models for tests: no network, real `Agent` runs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel


def tool_returns(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    """Every tool return in the history, oldest first."""
    return [
        p
        for m in messages
        if not isinstance(m, ModelResponse)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    ]


def calls_then_answers(
    tool_name: str, calls: int = 1, *, args: dict[str, object] | None = None
) -> FunctionModel:
    """A model that calls `tool_name` once per turn until it has `calls` returns, then answers."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = len(tool_returns(messages))
        if done < calls:
            return ModelResponse(
                parts=[ToolCallPart(tool_name, dict(args or {}), tool_call_id=f'call-{done}')]
            )
        return ModelResponse(parts=[TextPart(f'answered after {done} tool calls')])

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str | DeltaToolCalls]:
        # The same turns, streamed: used when a capability listens to the event stream.
        part = model(messages, info).parts[0]
        if isinstance(part, ToolCallPart):
            yield {0: DeltaToolCall(part.tool_name, json.dumps(part.args), tool_call_id=part.tool_call_id)}
        else:
            assert isinstance(part, TextPart)
            yield part.content

    return FunctionModel(model, stream_function=stream)


def answers(text: str = 'ok') -> FunctionModel:
    """A model that answers at once, without tools."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[TextPart(text)])

    return FunctionModel(model)


def turns_then_answers(tool_name: str, calls: int) -> FunctionModel:
    """Like `calls_then_answers`, but counts its own turns: for histories a processor rewrites."""
    turns = iter(range(1_000_000))

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = next(turns)
        if turn < calls:
            return ModelResponse(parts=[ToolCallPart(tool_name, {}, tool_call_id=f'call-{turn}')])
        return ModelResponse(parts=[TextPart(f'answered after {turn} tool calls')])

    return FunctionModel(model)


def priced_calls(tool_name: str, calls: int, *, price_per_token: str = '0.00001') -> FunctionModel:
    """Like `calls_then_answers` (argument `n` counting up), but every response reports tokens and a cost."""
    from decimal import Decimal

    from pydantic_ai.usage import RequestUsage

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = len(tool_returns(messages))
        part: ToolCallPart | TextPart = (
            ToolCallPart(tool_name, {'n': done + 1}, tool_call_id=f'call-{done}')
            if done < calls
            else TextPart(f'answered after {done} tool calls')
        )
        usage = RequestUsage(
            input_tokens=100 + done, output_tokens=10, cost=Decimal(price_per_token) * (110 + done)
        )
        return ModelResponse(parts=[part], usage=usage, model_name='priced-model')

    return FunctionModel(model, model_name='priced-model')
