"""Workload 1, shared by both environments: one agent, N tool steps, timed per step.

This module imports only pydantic-ai (no stepstream), because the same code drives the
reference library in its own virtual environment, which pins another pydantic-ai version.
The model keeps its own cost O(1) per turn (it counts turns from the history's length instead
of walking it), so what grows with the run is the framework's and the persistence's work.
"""

from __future__ import annotations

import gc
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage, UsageLimits

TOOL_RESULT_BYTES = 500
_VOCABULARY = """
archive shelf volume call number condition catalogue binding folio margin index entry record author
title edition printer year place note copy leaf plate map chart letter ledger account deed charter
register survey parish county estate court roll box file series item page line column date name
trade street house owner tenant rent sum paid received witness clerk seal signed dated copied
checked missing damaged repaired
"""
_WORDS = tuple(_VOCABULARY.split())


def tool_result(index: int) -> str:
    """About 500 bytes of text, different for every call and no more compressible than prose.

    Words drawn from a seeded generator: a repeated sentence would flatter any compression.
    """
    rng = random.Random(index)
    text = f'record {index:06d}:'
    while len(text) < TOOL_RESULT_BYTES:
        text += ' ' + rng.choice(_WORDS)
    return text[:TOOL_RESULT_BYTES]


_USAGE = RequestUsage(input_tokens=200, output_tokens=20)


def make_model(n_calls: int) -> FunctionModel:
    """Each turn: a short text and one `lookup` call, until `n_calls` calls are done; then an answer."""

    async def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        # History is [request, (response, tool-return request) * done]: O(1), not a walk.
        # Async, and with usage set, so that FunctionModel neither hops to a thread nor
        # estimates tokens over the whole history: a real model reports usage too.
        done = (len(messages) - 1) // 2
        if done < n_calls:
            return ModelResponse(
                parts=[
                    TextPart(f'Step {done}: looking up the next record.'),
                    ToolCallPart('lookup', {'index': done}, tool_call_id=f'call-{done}'),
                ],
                usage=_USAGE,
            )
        return ModelResponse(parts=[TextPart(f'Done after {done} lookups.')], usage=_USAGE)

    return FunctionModel(respond)


class BudgetExceeded(Exception):
    """Raised from the tool to stop a run that would take longer than its time budget."""


@dataclass
class StepClock:
    """Stamps the start of every tool call; optionally stops the run past a time budget."""

    budget_s: float | None = None
    on_stop: Callable[[int], None] | None = None
    """Called (untimed) with the number of completed steps, just before a budget stop."""
    start: float = 0.0
    stamps: list[float] = field(default_factory=list)

    def begin(self) -> None:
        self.start = time.perf_counter()
        self.stamps = []

    def tick(self) -> None:
        now = time.perf_counter()
        if self.budget_s is not None and now - self.start > self.budget_s:
            if self.on_stop is not None:
                self.on_stop(len(self.stamps))
            raise BudgetExceeded(f'stopped after {len(self.stamps)} steps')
        self.stamps.append(now)

    def step_ms(self) -> list[float]:
        """Duration of each step: from one tool call to the next (the first from the run start)."""
        edges = [self.start, *self.stamps]
        return [(b - a) * 1000 for a, b in itertools.pairwise(edges)]


def build_agent(n_calls: int, clock: StepClock, capabilities: Sequence[Any] = ()) -> Agent[None, str]:
    """The workload agent, with the given capabilities (none, stepstream's or the reference's)."""
    agent: Agent[None, str] = Agent(make_model(n_calls), capabilities=list(capabilities))

    @agent.tool_plain
    def lookup(index: int) -> str:
        """Look up one archive record."""
        clock.tick()
        return tool_result(index)

    return agent


@dataclass
class RunTiming:
    """What one timed run measured."""

    n: int
    wall_s: float
    cpu_s: float
    steps_done: int
    step_ms: list[float]
    truncated: bool

    @property
    def per_step_ms(self) -> float:
        return self.wall_s * 1000 / max(self.steps_done, 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            'n': self.n,
            'wall_s': self.wall_s,
            'cpu_s': self.cpu_s,
            'steps_done': self.steps_done,
            'per_step_ms': self.per_step_ms,
            'cpu_per_step_ms': self.cpu_s * 1000 / max(self.steps_done, 1),
            'step_ms': [round(x, 3) for x in self.step_ms],
            'truncated': self.truncated,
        }


async def timed_run(
    n: int, capabilities: Sequence[Any] = (), *, budget_s: float | None = None, **run_kwargs: Any
) -> RunTiming:
    """Run the workload once with `n` tool calls and time it (GC collected first, not during)."""
    clock = StepClock(budget_s=budget_s)
    agent = build_agent(n, clock, capabilities)
    gc.collect()
    cpu0 = time.process_time()
    clock.begin()
    truncated = False
    try:
        result = await agent.run(
            'Look up the archive records one by one.',
            usage_limits=UsageLimits(request_limit=n + 2),
            **run_kwargs,
        )
        assert result.output.startswith('Done after'), result.output
    except BudgetExceeded:
        truncated = True
    wall = time.perf_counter() - clock.start
    cpu = time.process_time() - cpu0
    steps = clock.step_ms()
    if truncated:
        wall = clock.stamps[-1] - clock.start if clock.stamps else wall
    return RunTiming(n=n, wall_s=wall, cpu_s=cpu, steps_done=len(steps), step_ms=steps, truncated=truncated)


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares `y = a + b*x`; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def extrapolate_mean_step_ms(step_ms: Sequence[float], n: int) -> float:
    """Mean step time of an `n`-step run, from the first steps of a truncated one.

    Persistence that rewrites the history every step costs a + b*k at step k, so the mean
    over n steps is a + b*(n+1)/2. Fitted on the second half of the measured steps, where the
    growth dominates warm-up effects.
    """
    half = len(step_ms) // 2
    xs = [float(i + 1) for i in range(half, len(step_ms))]
    a, b = linear_fit(xs, step_ms[half:])
    return a + b * (n + 1) / 2
