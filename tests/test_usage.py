"""Usage in the log: each model request's model, tokens, cost and duration, each tool call's duration,
summed per run by the projection and shown by the run record, the CLI and the HTTP API."""

from __future__ import annotations

import json
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from pydantic_ai import Agent, ModelRetry
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage
from test_cli import cli

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.serve import app_for, running

from agents import tool_returns

pytestmark = pytest.mark.broker

TOOL_BODY_NS = 2_000_000
"""How long the `lookup` tool body runs at least (it spins on the monotonic clock, it does not sleep)."""


def priced_model() -> FunctionModel:
    """gpt-4o as OpenAI would answer: genai-prices prices its usage, as it would a real response.

    Turn 0 calls `lookup`, turn 1 calls `flaky` (which asks for a retry, a failed tool call),
    turn 2 calls `flaky` again (it succeeds), turn 3 answers.
    """

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = sum(isinstance(m, ModelResponse) for m in messages)
        usage = RequestUsage(
            input_tokens=1000 + 100 * turn,
            output_tokens=50 + turn,
            cache_read_tokens=200,
            cache_write_tokens=7,
        )
        if turn < 3:
            tool = 'lookup' if turn == 0 else 'flaky'
            part = ToolCallPart(tool, {'n': turn}, tool_call_id=f'call-{turn}')
            return ModelResponse(parts=[part], usage=usage, provider_name='openai', finish_reason='tool_call')
        done = len(tool_returns(messages))
        return ModelResponse(
            parts=[TextPart(f'{done} answers')], usage=usage, provider_name='openai', finish_reason='stop'
        )

    return FunctionModel(model, model_name='gpt-4o')


def analyst(log: EventLog) -> Agent[None, str]:
    agent = Agent(priced_model(), capabilities=[StepPersistence(log=log, agent_name='analyst')])

    @agent.tool_plain
    def lookup(n: int) -> str:
        started = time.perf_counter_ns()
        while time.perf_counter_ns() - started < TOOL_BODY_NS:
            pass
        return f'found {n}'

    @agent.tool_plain
    def flaky(n: int) -> str:
        if n == 1:
            raise ModelRetry('try again')
        return 'ok'

    return agent


async def test_each_model_request_carries_its_usage_and_the_run_sums_it(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    result = await analyst(event_log).run('how much?', conversation_id='conv-usage')
    await projector.wait_for(await event_log.flush())
    reader = ProjectionReader.of(projector)
    [run] = await reader.list_runs(conversation_id='conv-usage')
    events = await reader.list_events(run.run_id)

    responses = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    completed = [e for e in events if e.kind == 'model_request_completed']
    assert len(completed) == len(responses) == 4
    for event, response in zip(completed, responses, strict=True):
        assert event.usage is not None and event.duration_us is not None and event.duration_us >= 0
        assert event.usage.model_name == 'gpt-4o' and event.usage.provider == 'openai'
        assert event.usage.input_tokens == response.usage.input_tokens
        assert event.usage.output_tokens == response.usage.output_tokens
        assert (event.usage.cache_read_tokens, event.usage.cache_write_tokens) == (200, 7)
        assert event.usage.finish_reason == response.finish_reason
        assert response.usage.cost is not None and event.usage.cost_usd == str(response.usage.cost)

    tool_ends = {e.tool_call_id: e for e in events if e.kind in ('tool_call_completed', 'tool_call_failed')}
    assert {k: e.kind for k, e in tool_ends.items()} == {
        'call-0': 'tool_call_completed',
        'call-1': 'tool_call_failed',
        'call-2': 'tool_call_completed',
    }
    lookup = tool_ends['call-0'].duration_us
    assert lookup is not None and lookup >= TOOL_BODY_NS // 1000  # the body's time is inside it
    assert all(e.duration_us is not None for e in tool_ends.values())
    assert all(e.usage is None for e in events if e.kind != 'model_request_completed')
    # A body that asked for a retry ended: its effect is `failed`, not left unknown.
    assert await reader.list_unresolved_tool_effects(run.run_id) == []
    assert (await reader.get_tool_effect(run.run_id, 'call-1')).status == 'failed'  # type: ignore[union-attr]

    # The run record's sums are Pydantic AI's own for the run.
    expected = result.usage
    usage = run.usage
    assert usage.model_requests == 4 and usage.requests == expected.requests == 4
    assert (usage.input_tokens, usage.output_tokens) == (expected.input_tokens, expected.output_tokens)
    assert (usage.cache_read_tokens, usage.cache_write_tokens) == (800, 28)
    assert Decimal(usage.cost_usd or 'NaN') == sum(r.usage.cost or 0 for r in responses) > 0
    assert usage.unpriced_requests == 0
    assert usage.model_request_us == sum(e.duration_us or 0 for e in completed)
    assert (usage.tool_calls, usage.tool_call_failures) == (3, 1)
    assert usage.tool_call_us == sum(e.duration_us or 0 for e in tool_ends.values()) >= lookup

    # The CLI shows them: tokens in/out and cost in the runs table, everything with --json.
    code, out, err = await cli(settings, db_path, 'runs', '--conversation-id', 'conv-usage')
    assert code == 0, err
    header, _, row = out.splitlines()
    assert header.split()[-2:] == ['tokens', 'cost']
    assert f'{usage.input_tokens}/{usage.output_tokens}' in row.split()
    assert row.split()[-1] == f'${float(usage.cost_usd or 0):.4f}'
    code, out, err = await cli(settings, db_path, 'runs', '--conversation-id', 'conv-usage', '--json')
    assert code == 0, err
    [shown] = json.loads(out)
    assert shown['usage']['cost_usd'] == usage.cost_usd and shown['usage']['tool_call_failures'] == 1
    code, out, err = await cli(settings, db_path, 'events', run.run_id)
    assert code == 0, err
    assert 'gpt-4o 1000/50 tokens' in out

    # And so does the HTTP API's run model, and its events.
    async with (
        running(app_for(settings, reader=ProjectionReader.of(projector)), port=0) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        served = (await client.get(f'/api/runs/{run.run_id}')).json()
        served_events = (await client.get(f'/api/runs/{run.run_id}/events')).json()
    assert served['usage']['input_tokens'] == usage.input_tokens
    assert served['usage']['cost_usd'] == usage.cost_usd
    first = next(e for e in served_events if e['kind'] == 'model_request_completed')
    assert first['usage']['model_name'] == 'gpt-4o' and first['duration_us'] is not None


async def test_a_run_without_pricing_counts_its_unpriced_requests(
    event_log: EventLog, projector: Projector
) -> None:
    """TestModel has no price: tokens are summed, the cost stays unknown (None), not zero."""
    from pydantic_ai.models.test import TestModel

    agent = Agent(TestModel(), capabilities=[StepPersistence(log=event_log, agent_name='unpriced')])
    result = await agent.run('hello', conversation_id='conv-unpriced')
    await projector.wait_for(await event_log.flush())
    [run] = await ProjectionReader.of(projector).list_runs(conversation_id='conv-unpriced')
    assert run.usage.cost_usd is None and run.usage.unpriced_requests == run.usage.model_requests == 1
    assert run.usage.input_tokens == result.usage.input_tokens > 0
