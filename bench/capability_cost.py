"""The capability's own CPU per agent step, without a broker: what a change to the hot path costs.

`python -m bench.capability_cost [--steps 200] [--repeats 7]` runs one agent (a FunctionModel that
calls a tool each turn, with usage on every response) for `steps` steps under `StepPersistence` on
an `InMemoryLog` (encoding, id checks and headers included; no Kafka, no S3), and the same agent
without persistence, alternating, and prints the median CPU time per step of each and their
difference. The in-memory log makes the figure the capability's work alone, so two checkouts can be
compared on a busy machine (CPU time, not wall time; still run them one after the other).

With `--otel` an OpenTelemetry SDK tracer provider (no exporter) is installed first and every run
happens inside a span, so events carry trace and span ids: what tracing adds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage, UsageLimits

from stepstream.media import DiskMediaStore
from stepstream.producer import StepPersistence
from stepstream.producer._memory import InMemoryLog


def _model(steps: int) -> FunctionModel:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = sum(isinstance(m, ModelResponse) for m in messages)
        usage = RequestUsage(input_tokens=1000 + turn, output_tokens=50, cache_read_tokens=200)
        if turn < steps:
            return ModelResponse(
                parts=[ToolCallPart('step', {'n': turn}, tool_call_id=f'c{turn}')],
                usage=usage,
                provider_name='openai',
            )
        return ModelResponse(parts=[TextPart('done')], usage=usage, provider_name='openai')

    return FunctionModel(model, model_name='gpt-4o')


def _agent(steps: int, persistence: StepPersistence[None] | None) -> Agent[None, str]:
    agent = Agent(_model(steps), capabilities=[persistence] if persistence is not None else [])

    @agent.tool_plain
    def step(n: int) -> str:
        return f'step {n}'

    return agent


async def _cpu_per_step(steps: int, persisted: bool, media: Path) -> float:
    persistence = None
    if persisted:
        persistence = StepPersistence(
            log=InMemoryLog(), agent_name='bench', media_store=DiskMediaStore(media)
        )
    agent = _agent(steps, persistence)
    started = time.process_time()
    await agent.run('go', usage_limits=UsageLimits(request_limit=None))
    return (time.process_time() - started) / steps


async def main(steps: int, repeats: int, otel: bool) -> None:
    """Print the median CPU per step with and without persistence, and the difference."""
    span = None
    if otel:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        trace.set_tracer_provider(TracerProvider())
        span = trace.get_tracer('bench').start_as_current_span('bench')
        span.__enter__()
    with tempfile.TemporaryDirectory() as tmp:
        await _cpu_per_step(20, True, Path(tmp))  # warm imports and caches
        await _cpu_per_step(20, False, Path(tmp))
        bare, persisted = [], []
        for _ in range(repeats):
            bare.append(await _cpu_per_step(steps, False, Path(tmp)))
            persisted.append(await _cpu_per_step(steps, True, Path(tmp)))
    b, p = statistics.median(bare), statistics.median(persisted)
    print(
        f'steps={steps} repeats={repeats} otel={otel}: no persistence {b * 1e3:.3f} ms/step, '
        f'StepPersistence(InMemoryLog) {p * 1e3:.3f} ms/step, added {(p - b) * 1e3:.3f} ms/step CPU'
    )
    if span is not None:
        span.__exit__(None, None, None)


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--steps', type=int, default=200)
    parser.add_argument('--repeats', type=int, default=7)
    parser.add_argument('--otel', action='store_true')
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.repeats, args.otel))
