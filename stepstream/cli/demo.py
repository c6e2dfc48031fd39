"""The `make run` demo: an orchestrator, two delegates, and a crash in the middle of a tool.

The orchestrator asks a researcher (in this process) and a publisher (in a child process). The
publisher's tool is killed with SIGKILL while it runs, so its effect stays `started`. Its writer's
heartbeats stop with it: once they have been missing for `stale_after_s` (20 s by default) the run
reads `stale` and the call `unknown_after_crash`, and the demo waits for that before its summary.
The researcher's first search fails (its call reads `failed`), every model response reports a
price (so runs show a cost), and the orchestrator's answer says the publisher was interrupted.
A release manager's tool needs an approval (`requires_approval=True`): its run ends waiting, the
demo approves the call on the log as `demo-approver` (`decide_deferred_call`) and resumes the run
from the log (`resume_run`) in the same conversation (docs/approvals.md).
The demo runs on the stack `stepstream stack up` keeps under `.stepstream`, whose log is durable
and whose projector applies what the demo writes (the demo only reads the projection), so
running it again shows every earlier run too, and every `stepstream` command afterwards reads
the same log and projection.

`python -m stepstream.cli.demo --run-id R --parent-run-id P` is the publisher's child process
(settings from `STEPSTREAM_*`); nothing else should call it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, DeferredToolRequests, ModelRetry, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

from stepstream.console import effects_table, events_table, runs_table, tree
from stepstream.errors import StepStreamError
from stepstream.producer import (
    EventLog,
    StepPersistence,
    annotate_tool_effect,
    current_run_id,
    decide_deferred_call,
    resolver_id,
)
from stepstream.readmodel import RESUMES_KEY, ProjectionReader, resume_run
from stepstream.settings import Settings

Step = tuple[str, dict[str, object]] | str | Callable[[list[ModelMessage]], str]
"""A tool call (name, arguments), the final text, or a function of the history giving the final text."""

PRICE_PER_INPUT_TOKEN = Decimal('0.000002')
PRICE_PER_OUTPUT_TOKEN = Decimal('0.000008')
"""The demo model's price in USD ($2 and $8 per million tokens), so its runs show a cost."""


def _scripted(*steps: Step) -> FunctionModel:
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


DEMO_MODEL = 'demo-scripted'


def _returned(messages: list[ModelMessage], tool_name: str) -> str:
    """What the last call of `tool_name` returned, as text."""
    found = [
        p for m in messages for p in m.parts if isinstance(p, ToolReturnPart) and p.tool_name == tool_name
    ]
    return str(found[-1].content) if found else '(no answer)'


def _orchestrator_answer(messages: list[ModelMessage]) -> str:
    """The orchestrator's answer says what happened, including a publisher that did not finish."""
    published = _returned(messages, 'publish')
    outcome = (
        f'publishing was interrupted ({published}); whether the announcement went out is unknown '
        'until someone checks and resolves it'
        if 'killed' in published or 'exited' in published or 'never' in published
        else f'published ({published})'
    )
    return f'researched: {_returned(messages, "research")}; {outcome}'


async def run_crashing_delegate(settings: Settings, *, run_id: str, parent_run_id: str) -> None:
    """The child process: a publisher whose tool blocks until the parent kills the process."""
    async with EventLog(settings) as log:
        publisher = Agent(
            _scripted(('send_announcement', {'channel': '#releases'}), 'sent'),
            name='publisher',
            capabilities=[
                StepPersistence(log=log, agent_name='publisher', run_id=run_id, parent_run_id=parent_run_id)
            ],
        )

        @publisher.tool
        async def send_announcement(ctx: RunContext[Any], channel: str) -> str:
            await annotate_tool_effect(
                ctx, idempotency_key=f'announce:{channel}', effect_summary='posts to Slack'
            )
            await asyncio.sleep(3600)  # killed long before this returns
            return 'posted'

        await publisher.run('announce the release', conversation_id='release-demo')


async def _publish_in_child(
    settings: Settings, reader: ProjectionReader, parent_run_id: str, killed: list[str]
) -> str:
    run_id = f'publisher-{secrets.token_hex(4)}'
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        '-m',
        'stepstream.cli.demo',
        '--run-id',
        run_id,
        '--parent-run-id',
        parent_run_id,
        env={**os.environ, **settings.to_env()},
    )
    try:
        for _ in range(600):  # the started transition is acknowledged before the tool body runs
            if await reader.list_unresolved_tool_effects(run_id):
                break
            if child.returncode is not None:
                return f'publisher {run_id} exited early with code {child.returncode}'
            await asyncio.sleep(0.05)
        else:
            return f'publisher {run_id} never started its tool'
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGKILL)
            killed.append(run_id)
        await child.wait()
    return f'publisher {run_id} was killed in the middle of send_announcement'


async def _until_stale(reader: ProjectionReader, run_id: str, stale_after_s: float) -> None:
    """Wait until the killed run reads `stale`: its heartbeats stopped `stale_after_s` ago at most."""
    print(
        f'waiting up to {stale_after_s:g} s for {run_id} to read stale: its process was killed, '
        f'so its heartbeats stopped, and a run is judged dead once they have been missing for '
        f'STEPSTREAM_STALE_AFTER_S ({stale_after_s:g} s)',
        flush=True,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + stale_after_s + 30
    while loop.time() < deadline:
        run = await reader.get_run(run_id)
        if run is None or run.status != 'running':
            return
        await asyncio.sleep(0.2)


async def wait_applied(reader: ProjectionReader, positions: Mapping[Any, int], db_path: str) -> None:
    """Wait until the projection applied the log up to `positions` (`EventLog.flush()`'s answer).

    The stack's projector applies it; this process only reads (a RocksDB secondary), so it polls.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        applied = (await reader.status()).offsets
        if all(applied.get((tp.topic, tp.partition), 0) >= end for tp, end in positions.items()):
            return
        if loop.time() > deadline:
            raise StepStreamError(
                f"the projection at {db_path} did not apply the demo's records within 60 s: "
                'is a projector running? (`stepstream stack up` starts one; `stepstream status` says)'
            )
        await asyncio.sleep(0.05)


APPROVER = 'demo-approver'
"""Who approves the release manager's call (`resolved_by` on the log)."""


def _release_manager(log: EventLog, metadata: Mapping[str, str] | None = None) -> Agent[None, Any]:
    """An agent whose one tool needs an approval: its first run ends waiting on it."""
    agent = Agent(
        _scripted(('tag_release', {'version': '1.4.0'}), lambda m: _returned(m, 'tag_release')),
        name='release-manager',
        output_type=[str, DeferredToolRequests],
        capabilities=[StepPersistence(log=log, agent_name='release-manager', metadata=dict(metadata or {}))],
    )

    @agent.tool_plain(requires_approval=True)
    def tag_release(version: str) -> str:
        return f'tagged v{version}, approved by {APPROVER}'

    return agent


async def _approve_and_resume(settings: Settings, log: EventLog, reader: ProjectionReader) -> str:
    """A run that waits for an approval, the approval on the log, and the run resumed from the log.

    Returns the id of the run that waited.
    """
    paused = await _release_manager(log).run('tag the release', conversation_id='release-demo')
    assert isinstance(paused.output, DeferredToolRequests)  # the run ends waiting on the call
    await wait_applied(reader, await log.flush(), settings.projection.db_path)
    [call] = await reader.list_waiting(agent_name='release-manager', newest_first=True, limit=1)
    run_id, effect = call.effect.run_id, call.effect
    await decide_deferred_call(
        log,
        effect,
        decision='approved',
        operator=APPROVER,
        writer_id=resolver_id('demo'),
        note='the release notes are checked',
    )
    await wait_applied(reader, await log.flush(), settings.projection.db_path)
    decided = await reader.get_tool_effect(run_id, effect.tool_call_id)
    assert decided is not None and decided.resolution is not None
    print(
        f'== an approval: {run_id} waited for an approval of {effect.tool_name}({effect.args}); '
        f'{decided.resolution.resolved_by} {decided.resolution.resolution} it on the log '
        f'({decided.resolution.note!r})'
    )
    resumption = await resume_run(reader, run_id)
    resumed = await _release_manager(log, resumption.metadata).run(**resumption.run_kwargs())
    await wait_applied(reader, await log.flush(), settings.projection.db_path)
    newest = await reader.list_runs(agent_name='release-manager', newest_first=True, limit=5)
    again = next(r for r in newest if r.metadata.get(RESUMES_KEY) == run_id)
    print(f'resumed as {again.run_id} in conversation {again.conversation_id}: {resumed.output}\n')
    return run_id


async def run_demo(settings: Settings, *, stack_dir: str | Path = '.stepstream') -> None:
    """Run the demo against `settings` (the stack under `stack_dir`); print lineage, events and effects.

    The stack's projector applies what the demo writes; the demo reads the projection beside it.
    """
    async with EventLog(settings) as log, ProjectionReader.from_settings(settings) as reader:
        await _demo(settings, log, reader, stack_dir)


async def _demo(settings: Settings, log: EventLog, reader: ProjectionReader, stack_dir: str | Path) -> None:
    researcher = Agent(
        _scripted(
            ('search_docs', {'query': 'release notes'}),
            ('search_docs', {'query': 'changelog'}),
            lambda messages: f'the release adds delta snapshots ({_returned(messages, "search_docs")})',
        ),
        name='researcher',
        capabilities=[StepPersistence(log=log, agent_name='researcher')],
    )

    searches: list[str] = []

    @researcher.tool_plain
    def search_docs(query: str) -> str:
        searches.append(query)
        if len(searches) == 1:  # a tool that fails once: its call reads `failed`, the next `completed`
            raise ModelRetry('the search index is still warming up; search again')
        return f'3 documents match {query!r}'

    orchestrator = Agent(
        _scripted(('research', {'topic': 'release'}), ('publish', {}), _orchestrator_answer),
        name='orchestrator',
        capabilities=[StepPersistence(log=log, agent_name='orchestrator')],
    )

    @orchestrator.tool_plain
    async def research(topic: str) -> str:
        return (await researcher.run(f'research {topic}', conversation_id='release-demo')).output

    killed: list[str] = []

    @orchestrator.tool_plain
    async def publish() -> str:
        parent = current_run_id()
        assert parent is not None
        return await _publish_in_child(settings, reader, parent, killed)

    result = await orchestrator.run('research the release and announce it', conversation_id='release-demo')
    print(f'orchestrator answered: {result.output}\n')
    waited = await _approve_and_resume(settings, log, reader)  # while the killed publisher's heartbeats age
    await wait_applied(reader, await log.flush(), settings.projection.db_path)
    for run_id in killed:
        await _until_stale(reader, run_id, settings.liveness.stale_after_s)

    roots = await reader.list_runs(agent_name='orchestrator')
    print(f'== lineage ({len(roots)} orchestrator run(s) in the log so far)')
    for root in roots:
        print(tree(await reader.run_tree(root.run_id)))
    latest = await reader.run_tree(roots[-1].run_id)
    print("\n== this demo's runs: time, tokens (in/out) and cost at the demo model's price")
    print(runs_table(latest))
    for run in latest:
        print(f'\n== events of {run.run_id} ({run.agent_name}, {run.status})')
        print(events_table(await reader.list_events(run.run_id)))
    print('\n== unresolved tool effects (in_flight or unknown_after_crash), all runs')
    print(effects_table(await reader.list_unresolved_tool_effects()))
    here = '' if str(stack_dir) == '.stepstream' else f' --stack-dir {stack_dir}'
    orchestrator_id = roots[-1].run_id
    print(
        f'\nThe stack keeps running, and its log and projection persist under {stack_dir}; '
        '`make run` again adds to this history.\n'
        'Inspect it (`.venv/bin/stepstream` in a checkout):\n'
        f'  stepstream runs{here}                  # every run; also tree, events, snapshot, unresolved\n'
        f'  stepstream tree {orchestrator_id}{here}\n'
        f'  stepstream effects {waited}{here}   # the approval: who, when, why\n'
        f'  stepstream deferred{here}              # the calls that wait for a decision (the Waiting page)\n'
        f'  stepstream status{here}                # lag, apply rate, dead letters\n'
        f'  stepstream rebuild --into /tmp/rebuilt{here} && '
        f'stepstream verify {settings.projection.db_path} /tmp/rebuilt\n'
        f'  eval "$(stepstream stack env{here})"   # the settings, for other tools and terminals\n'
        f'Stop it: stepstream stack down{here}'
    )


def _delegate_main() -> None:
    parser = argparse.ArgumentParser(prog='python -m stepstream.cli.demo', description=__doc__)
    parser.add_argument('--run-id', required=True)
    parser.add_argument('--parent-run-id', required=True)
    args = parser.parse_args()
    asyncio.run(
        run_crashing_delegate(Settings.from_env(), run_id=args.run_id, parent_run_id=args.parent_run_id)
    )


if __name__ == '__main__':
    _delegate_main()
