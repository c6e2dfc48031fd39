"""The demo's agents, importable: what `stepstream demo` (`make run`) runs, and what replays it.

The agents are module-level objects with no capability of their own: the demo hands each run its
`StepPersistence` (`Agent.run(capabilities=[...])`), bound to the demo's log, and the orchestrator
its `DemoDeps` (the log, the projection, the settings the publisher's process is started with).
So the same objects serve `stepstream replay`, which brings its own capability and model:

```sh
stepstream replay RUN --agent stepstream.demo:orchestrator
stepstream replay RUN --agent stepstream.demo:orchestrator \
    --from-step 2 --model stepstream.demo:cautious_model
```

The first re-executes a recorded orchestrator run with no model called and no tool run (its
tools get their recorded results); the second serves the recording up to step 2 (the research
done) and lets `cautious_model` answer from there, a new run on the log. The orchestrator's tools
use `DemoDeps`, which a replay does not have: replay it with recorded tools (the default).

Every model is a script (`scripted`): tool calls one turn at a time, then a final text; each
response reports tokens and their cost at the demo's price, so runs show a cost.

`python -m stepstream.demo --run-id R --parent-run-id P` is the publisher's child process
(settings from `STEPSTREAM_*`), whose tool blocks until the demo kills it; nothing else should
call it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from pydantic_ai import Agent, DeferredToolRequests, ModelRetry, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

from stepstream.producer import EventLog, StepPersistence, annotate_tool_effect, current_run_id
from stepstream.readmodel import ProjectionReader
from stepstream.settings import Settings

Step = tuple[str, dict[str, object]] | str | Callable[[list[ModelMessage]], str]
"""A tool call (name, arguments), the final text, or a function of the history giving the final text."""

DEMO_MODEL = 'demo-scripted'
PRICE_PER_INPUT_TOKEN = Decimal('0.000002')
PRICE_PER_OUTPUT_TOKEN = Decimal('0.000008')
"""The demo model's price in USD ($2 and $8 per million tokens), so its runs show a cost."""

APPROVER = 'demo-approver'
"""Who approves the release manager's call (`resolved_by` on the log)."""


def scripted(*steps: Step) -> FunctionModel:
    """A model that makes the given tool calls one turn at a time, then answers with the final text.

    Steps advance with the tool returns in the history, so a call whose tool failed moves the
    script on too. Every response reports its tokens (words, roughly) and their cost at the
    demo's price, as a priced provider would.
    """

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = sum(isinstance(p, ToolReturnPart) for m in messages for p in m.parts)
        calls = sum(isinstance(p, ToolCallPart) for m in messages for p in m.parts)
        step = steps[min(done, len(steps) - 1)]
        if isinstance(step, tuple):
            name, args = step
            part: TextPart | ToolCallPart = ToolCallPart(name, args, tool_call_id=f'{name}-{calls}')
        else:
            part = TextPart(step if isinstance(step, str) else step(messages))
        input_tokens = 50 + sum(len(str(p).split()) for m in messages for p in m.parts)
        output_tokens = 10 + len(str(part).split())
        cost = input_tokens * PRICE_PER_INPUT_TOKEN + output_tokens * PRICE_PER_OUTPUT_TOKEN
        usage = RequestUsage(input_tokens=input_tokens, output_tokens=output_tokens, cost=cost)
        return ModelResponse(parts=[part], usage=usage, model_name=DEMO_MODEL)

    return FunctionModel(model, model_name=DEMO_MODEL)


def returned(messages: list[ModelMessage], tool_name: str) -> str:
    """What the last call of `tool_name` returned, as text."""
    found = [
        p for m in messages for p in m.parts if isinstance(p, ToolReturnPart) and p.tool_name == tool_name
    ]
    return str(found[-1].content) if found else '(no answer)'


@dataclass
class DemoDeps:
    """What the orchestrator's tools use: the log its delegates write to, the projection, the settings."""

    settings: Settings
    log: EventLog
    reader: ProjectionReader
    killed: list[str] = field(default_factory=list)
    """The publisher runs whose process the demo killed."""


def persistence(log: EventLog, agent_name: str, **options: Any) -> list[Any]:
    """The `capabilities=` of one demo run: its `StepPersistence` on `log`."""
    return [StepPersistence(log=log, agent_name=agent_name, **options)]


researcher: Agent[None, str] = Agent(
    scripted(
        ('search_docs', {'query': 'release notes'}),
        ('search_docs', {'query': 'changelog'}),
        lambda messages: f'the release adds delta snapshots ({returned(messages, "search_docs")})',
    ),
    name='researcher',
)
"""The orchestrator's delegate, run in the orchestrator's process by its `research` tool."""


@researcher.tool
def search_docs(ctx: RunContext[None], query: str) -> str:
    """A search that fails at its run's first call (that call reads `failed`) and answers after."""
    if not any(isinstance(p, RetryPromptPart | ToolReturnPart) for m in ctx.messages for p in m.parts):
        raise ModelRetry('the search index is still warming up; search again')
    return f'3 documents match {query!r}'


def _orchestrator_answer(messages: list[ModelMessage]) -> str:
    """The orchestrator's answer says what happened, including a publisher that did not finish."""
    published = returned(messages, 'publish')
    outcome = (
        f'publishing was interrupted ({published}); whether the announcement went out is unknown '
        'until someone checks and resolves it'
        if 'killed' in published or 'exited' in published or 'never' in published
        else f'published ({published})'
    )
    return f'researched: {returned(messages, "research")}; {outcome}'


orchestrator: Agent[DemoDeps, str] = Agent(
    scripted(('research', {'topic': 'release'}), ('publish', {}), _orchestrator_answer),
    name='orchestrator',
    deps_type=DemoDeps,
)
"""Asks the researcher (in this process), then the publisher (in a child process the demo kills)."""


def _deps(ctx: RunContext[DemoDeps]) -> DemoDeps:
    """The demo's deps; a clear refusal where a replay runs the tools live without them."""
    if not isinstance(ctx.deps, DemoDeps):
        raise RuntimeError(
            "the orchestrator's tools need the demo's DemoDeps (its log and projection), which a replay "
            'does not have: replay it with recorded tools (the default)'
        )
    return ctx.deps


@orchestrator.tool
async def research(ctx: RunContext[DemoDeps], topic: str) -> str:
    """The researcher's answer, from a run of its own (a child of this one on the log)."""
    with_log = persistence(_deps(ctx).log, 'researcher')
    found = await researcher.run(f'research {topic}', conversation_id='release-demo', capabilities=with_log)
    return found.output


@orchestrator.tool
async def publish(ctx: RunContext[DemoDeps]) -> str:
    """Start the publisher in a child process and kill it in the middle of its tool."""
    parent = current_run_id()
    assert parent is not None
    return await _publish_in_child(_deps(ctx), parent)


cautious_model = scripted(
    lambda messages: (
        f'researched: {returned(messages, "research")}; not publishing until a person has read the notes'
    )
)
"""Another model for the orchestrator, to fork a run at step 2 (`--model stepstream.demo:cautious_model`):
it answers without calling `publish`, so a fork from there runs no tool."""


async def _publish_in_child(deps: DemoDeps, parent_run_id: str) -> str:
    run_id = f'publisher-{secrets.token_hex(4)}'
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        '-m',
        'stepstream.demo',
        '--run-id',
        run_id,
        '--parent-run-id',
        parent_run_id,
        env={**os.environ, **deps.settings.to_env()},
    )
    try:
        for _ in range(600):  # the started transition is acknowledged before the tool body runs
            if await deps.reader.list_unresolved_tool_effects(run_id):
                break
            if child.returncode is not None:
                return f'publisher {run_id} exited early with code {child.returncode}'
            await asyncio.sleep(0.05)
        else:
            return f'publisher {run_id} never started its tool'
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGKILL)
            deps.killed.append(run_id)
        await child.wait()
    return f'publisher {run_id} was killed in the middle of send_announcement'


publisher: Agent[None, str] = Agent(
    scripted(('send_announcement', {'channel': '#releases'}), 'sent'), name='publisher'
)
"""Runs in the child process; its tool blocks until the demo kills the process."""


@publisher.tool
async def send_announcement(ctx: RunContext[None], channel: str) -> str:
    """Declare the effect, then block: the process is killed long before this returns."""
    await annotate_tool_effect(ctx, idempotency_key=f'announce:{channel}', effect_summary='posts to Slack')
    await asyncio.sleep(3600)
    return 'posted'


release_manager: Agent[None, Any] = Agent(
    scripted(('tag_release', {'version': '1.4.0'}), lambda m: returned(m, 'tag_release')),
    name='release-manager',
    output_type=[str, DeferredToolRequests],
)
"""An agent whose one tool needs an approval: its first run ends waiting on it."""


@release_manager.tool_plain(requires_approval=True)
def tag_release(version: str) -> str:
    """Tag the release (after an approval)."""
    return f'tagged v{version}, approved by {APPROVER}'


async def run_crashing_delegate(settings: Settings, *, run_id: str, parent_run_id: str) -> None:
    """The child process: the publisher, whose tool blocks until the parent kills the process."""
    async with EventLog(settings) as log:
        await publisher.run(
            'announce the release',
            conversation_id='release-demo',
            capabilities=persistence(log, 'publisher', run_id=run_id, parent_run_id=parent_run_id),
        )


def _delegate_main() -> None:
    parser = argparse.ArgumentParser(prog='python -m stepstream.demo', description=__doc__)
    parser.add_argument('--run-id', required=True)
    parser.add_argument('--parent-run-id', required=True)
    args = parser.parse_args()
    asyncio.run(
        run_crashing_delegate(Settings.from_env(), run_id=args.run_id, parent_run_id=args.parent_run_id)
    )


if __name__ == '__main__':
    _delegate_main()
