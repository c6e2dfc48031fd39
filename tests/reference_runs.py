"""The same agents run with the reference's `StepPersistence` and with ours, and what both stores answer.

`REFERENCE_READS` reads every read method of the reference's `StepStore` (and `list_snapshots`)
for one run; `normalised` takes out what two runs of one agent cannot share (times, the ids Pydantic
AI draws per run, the registration id), so a reference store and a `ReferenceStore` over our
projection compare with `==`. Used by tests/test_reference_store.py (fast) and
tests/test_reference_store_e2e.py (on the brokers).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import asdict, is_dataclass
from datetime import datetime
from typing import Any

from pydantic_ai import Agent, CallDeferred, DeferredToolRequests
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai_harness.step_persistence import InMemoryStepStore
from pydantic_ai_harness.step_persistence import StepPersistence as ReferencePersistence

AgentFactory = Callable[[AbstractCapability[Any]], Agent[None, Any]]
Scenario = Callable[[AbstractCapability[Any]], Awaitable[None]]

MASKED = ('timestamp', 'started_at', 'ended_at', 'registration_id', 'run_id', 'provider_response_id')
"""Keys whose values differ between two runs of one agent: times, and the ids drawn per run (Pydantic
AI's own `run_id` on each message; the capability's run id is the same on both sides and kept
where it is a record's key, see `normalised`). None stays None: a time that is missing on one side
is a difference."""


def normalised(value: Any, *, run_ids: tuple[str, ...] = ()) -> Any:
    """`value` as plain data with the per-run values masked; `run_ids` (the runs' own ids) are kept."""
    if is_dataclass(value) and not isinstance(value, type):
        value = {f: getattr(value, f) for f in asdict(value)}
    if isinstance(value, dict):
        return {
            k: (
                '*'
                if k in MASKED and v is not None and not (k == 'run_id' and v in run_ids)
                else normalised(v, run_ids=run_ids)
            )
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        if value and _is_messages(value):
            return normalised(ModelMessagesTypeAdapter.dump_python(list(value), mode='json'), run_ids=run_ids)
        return [normalised(v, run_ids=run_ids) for v in value]
    if isinstance(value, datetime):
        return '*'
    return value


def _is_messages(value: list[Any] | tuple[Any, ...]) -> bool:
    return all(hasattr(m, 'parts') and hasattr(m, 'kind') for m in value)


async def reads(store: Any, run_id: str, tool_call_ids: tuple[str, ...] = ()) -> dict[str, Any]:
    """What every read method of the reference's protocol answers for `run_id`."""
    run = await store.get_run(run_id=run_id)
    return {
        'get_run': run,
        'list_runs': await store.list_runs(),
        'list_runs(conversation_id)': await store.list_runs(conversation_id=run.conversation_id)
        if run
        else None,
        'list_runs(parent_run_id)': await store.list_runs(parent_run_id=run_id),
        'list_events': await store.list_events(run_id=run_id),
        'latest_snapshot': await store.latest_snapshot(run_id=run_id),
        'latest_snapshot(include_interrupted)': await store.latest_snapshot(
            run_id=run_id, include_interrupted=True
        ),
        'list_snapshots': await store.list_snapshots(run_id=run_id),
        'list_snapshots(include_interrupted)': await store.list_snapshots(
            run_id=run_id, include_interrupted=True
        ),
        'get_tool_effect': {
            c: await store.get_tool_effect(run_id=run_id, tool_call_id=c) for c in tool_call_ids
        },
        'list_unresolved_tool_effects': await store.list_unresolved_tool_effects(run_id=run_id),
    }


def differences(theirs: dict[str, Any], ours: dict[str, Any], run_ids: tuple[str, ...]) -> list[str]:
    """Each read whose normalised answers differ, with both answers (empty: the stores agree)."""
    out = []
    for name, answer in theirs.items():
        a, b = normalised(answer, run_ids=run_ids), normalised(ours[name], run_ids=run_ids)
        if a != b:
            out.append(f'{name}:\n  reference: {a}\n  ours:      {b}')
    return out


async def run_reference(scenario: Scenario) -> InMemoryStepStore:
    """`scenario` run with the reference's capability over its in-memory store."""
    store = InMemoryStepStore()
    await scenario(ReferencePersistence(store=store, **OPTIONS))
    return store


# -- the agents --------------------------------------------------------------------------------


def _returns(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    return [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]


def text_agent(capability: AbstractCapability[Any]) -> Agent[None, Any]:
    """Answers in text, no tools."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        prompts = [p.content for m in messages for p in m.parts if p.part_kind == 'user-prompt']
        return ModelResponse(parts=[TextPart(f'you said {prompts[-1]!r}; the parcel code is AX-17')])

    return Agent(FunctionModel(model), capabilities=[capability])


def tool_agent(capability: AbstractCapability[Any]) -> Agent[None, Any]:
    """Looks up twice (two tool rounds), then answers."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = len(_returns(messages))
        if done >= 2:
            return ModelResponse(parts=[TextPart('found both')])
        return ModelResponse(parts=[ToolCallPart('lookup', {'q': f'q{done}'}, tool_call_id=f'call-{done}')])

    agent = Agent(FunctionModel(model), capabilities=[capability])

    @agent.tool_plain
    def lookup(q: str) -> str:
        return f'row for {q}'

    return agent


def failing_agent(capability: AbstractCapability[Any]) -> Agent[None, Any]:
    """Calls `lookup` and `charge` together; `charge` raises, so the run fails mid tool cycle."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if _returns(messages):
            return ModelResponse(parts=[TextPart('done')])
        return ModelResponse(
            parts=[
                ToolCallPart('lookup', {'q': 'card'}, tool_call_id='call-lookup'),
                ToolCallPart('charge', {'cents': 500}, tool_call_id='call-charge'),
            ]
        )

    agent = Agent(FunctionModel(model), capabilities=[capability])

    # One after the other: run together, `charge`'s failure may cancel `lookup` before or after it ends.
    @agent.tool_plain(sequential=True)
    def lookup(q: str) -> str:
        return 'visa'

    @agent.tool_plain(sequential=True)
    def charge(cents: int) -> str:
        raise RuntimeError(f'card declined for {cents}')

    return agent


def waiting_agent(capability: AbstractCapability[Any]) -> Agent[None, Any]:
    """Ends with deferred calls: `refund` needs an approval, `export`'s body defers it."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if _returns(messages):
            return ModelResponse(parts=[TextPart('done')])
        return ModelResponse(
            parts=[
                ToolCallPart('refund', {'amount': 120}, tool_call_id='call-refund'),
                ToolCallPart('export', {'table': 'orders'}, tool_call_id='call-export'),
            ]
        )

    agent: Agent[None, Any] = Agent(
        FunctionModel(model), capabilities=[capability], output_type=[str, DeferredToolRequests]
    )

    @agent.tool_plain(requires_approval=True)
    def refund(amount: int) -> str:
        return f'refunded {amount}'

    @agent.tool_plain
    def export(table: str) -> str:
        raise CallDeferred(metadata={'job': 'export-7'})

    return agent


def stuck_agent(capability: AbstractCapability[Any], entered: asyncio.Event) -> Agent[None, Any]:
    """Its second `step` call never returns: `entered` is set once it is inside it."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = len(_returns(messages))
        return ModelResponse(parts=[ToolCallPart('step', {'n': done}, tool_call_id=f'call-{done}')])

    agent = Agent(FunctionModel(model), capabilities=[capability])

    @agent.tool_plain
    async def step(n: int) -> str:
        if n == 1:
            entered.set()
            await asyncio.Event().wait()
        return f'step {n}'

    return agent


def delegating_agent(capability: AbstractCapability[Any]) -> Agent[None, Any]:
    """Asks a helper agent (its own run, a child of this one) from a tool, then answers."""
    helper = text_agent(dataclasses.replace(capability, run_id='child-1', agent_name='helper', metadata={}))  # type: ignore[type-var]

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if _returns(messages):
            return ModelResponse(parts=[TextPart('the helper answered')])
        return ModelResponse(
            parts=[ToolCallPart('ask_helper', {'question': 'code?'}, tool_call_id='call-ask')]
        )

    agent = Agent(FunctionModel(model), capabilities=[capability])

    @agent.tool_plain
    async def ask_helper(question: str) -> str:
        result = await helper.run(question, conversation_id='conv-1')
        return str(result.output)

    return agent


# -- the scenarios: one run each, with the capability given ------------------------------------

OPTIONS = {'run_id': 'run-1', 'agent_name': 'clerk', 'metadata': {'team': 'billing'}}


async def text_run(capability: AbstractCapability[Any]) -> None:
    """A text answer."""
    await text_agent(capability).run('hello', conversation_id='conv-1')


async def delegating_run(capability: AbstractCapability[Any]) -> None:
    """A run whose tool runs a helper agent: two runs, the helper's the child of the first."""
    await delegating_agent(capability).run('ask the helper', conversation_id='conv-1')


async def tool_run(capability: AbstractCapability[Any]) -> None:
    """Two tool rounds."""
    await tool_agent(capability).run('find q0 and q1', conversation_id='conv-1')


async def frontier_run(capability: AbstractCapability[Any]) -> None:
    """Two tool rounds with `capture_frontier`: inputs and tool-call frontiers are snapshotted too."""
    frontier = dataclasses.replace(capability, capture_frontier=True)  # type: ignore[type-var]
    await tool_agent(frontier).run('find q0 and q1', conversation_id='conv-1')


async def failing_run(capability: AbstractCapability[Any]) -> None:
    """A tool raises: the run fails with an interrupted snapshot."""
    try:
        await failing_agent(capability).run('charge the card', conversation_id='conv-1')
    except RuntimeError as exc:
        assert 'card declined' in str(exc)
    else:
        raise AssertionError('the run should have failed')


async def waiting_run(capability: AbstractCapability[Any]) -> None:
    """The run ends waiting on an approval and an outside call."""
    result = await waiting_agent(capability).run('refund order 7', conversation_id='conv-1')
    assert isinstance(result.output, DeferredToolRequests)


async def interrupted_run(capability: AbstractCapability[Any]) -> None:
    """The run is stopped inside its second tool call (its task cancelled), as a process stops."""
    entered = asyncio.Event()
    task = asyncio.create_task(stuck_agent(capability, entered).run('step on', conversation_id='conv-1'))
    await entered.wait()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError('the run should have been cancelled')


SCENARIOS: dict[str, tuple[Scenario, tuple[str, ...]]] = {
    'text': (text_run, ()),
    'tools': (tool_run, ('call-0', 'call-1', 'call-9')),
    'frontier': (frontier_run, ('call-0', 'call-1')),
    'failing tool': (failing_run, ('call-lookup', 'call-charge')),
    'waiting': (waiting_run, ('call-refund', 'call-export')),
    'delegating': (delegating_run, ('call-ask',)),
    'interrupted': (interrupted_run, ('call-0', 'call-1')),
}
"""Each scenario and the tool calls whose effects are read."""


KNOWN: dict[str, set[str]] = {
    # Waiting: we keep the run's final history, its deferred calls open (`interrupted`), which is what
    # resumes it (`resume_run`); the reference keeps no snapshot of it. Default reads agree.
    'waiting': {'latest_snapshot(include_interrupted)', 'list_snapshots(include_interrupted)'},
    # Cancelled: the reference's rescue snapshot takes the step of the last boundary its stash saw
    # (1), ours the step the run ended at (0), and so its key too; its `run_failed` says
    # `CancelledError()`, ours says why in a sentence that ends with it.
    'interrupted': {
        'latest_snapshot(include_interrupted)',
        'list_snapshots(include_interrupted)',
        'list_events',
    },
}
"""Reads whose answers still differ, by scenario: each is asserted in test_reference_store.py."""
