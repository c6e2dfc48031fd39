"""The `make run` demo: an orchestrator, two delegates, and a crash in the middle of a tool.

The agents are `stepstream.demo`'s (importable, so `stepstream replay` can re-execute them); this
module runs them and prints what they left. The orchestrator asks a researcher (in this process)
and a publisher (in a child process). The publisher's tool is killed with SIGKILL while it runs,
so its effect stays `started`. Its writer's heartbeats stop with it: once they have been missing
for `stale_after_s` (20 s by default) the run reads `stale` and the call `unknown_after_crash`,
and the demo waits for that before its summary. The researcher's first search fails (its call
reads `failed`), every model response reports a price (so runs show a cost), and the
orchestrator's answer says the publisher was interrupted.
A release manager's tool needs an approval (`requires_approval=True`): its run ends waiting, the
demo approves the call on the log as `demo-approver` (`decide_deferred_call`) and resumes the run
from the log (`resume_run`) in the same conversation (docs/approvals.md).
The demo runs on the stack `stepstream stack up` keeps under `.stepstream`, whose log is durable
and whose projector applies what the demo writes (the demo only reads the projection), so
running it again shows every earlier run too, and every `stepstream` command afterwards reads
the same log and projection. It ends with the commands that replay and fork its orchestrator run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic_ai import DeferredToolRequests

from stepstream.cli._common import program
from stepstream.console import effects_table, events_table, runs_table, tree
from stepstream.demo import APPROVER, DemoDeps, orchestrator, persistence, release_manager
from stepstream.errors import StepStreamError
from stepstream.ids import to_run_id
from stepstream.producer import EventLog, decide_deferred_call, resolver_id
from stepstream.readmodel import RESUMES_KEY, ProjectionReader, resume_run
from stepstream.settings import Settings


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


async def _approve_and_resume(settings: Settings, log: EventLog, reader: ProjectionReader) -> str:
    """A run that waits for an approval, the approval on the log, and the run resumed from the log.

    Returns the id of the run that waited.
    """
    paused = await release_manager.run(
        'tag the release', conversation_id='release-demo', capabilities=persistence(log, 'release-manager')
    )
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
    resumed = await release_manager.run(
        **resumption.run_kwargs(),
        capabilities=persistence(log, 'release-manager', metadata=dict(resumption.metadata)),
    )
    await wait_applied(reader, await log.flush(), settings.projection.db_path)
    newest = await reader.list_runs(agent_name='release-manager', newest_first=True, limit=5)
    again = next(r for r in newest if r.metadata.get(RESUMES_KEY) == run_id)
    print(f'resumed as {again.run_id} in conversation {again.conversation_id}: {resumed.output}\n')
    return run_id


async def run_demo(
    settings: Settings, *, stack_dir: str | Path = '.stepstream', explorer_url: str | None = None
) -> None:
    """Run the demo against `settings` (the stack under `stack_dir`); print lineage, events and effects.

    The stack's projector applies what the demo writes; the demo reads the projection beside it.
    It ends with the commands that replay and fork its orchestrator run (`replay_commands`).
    """
    async with EventLog(settings) as log, ProjectionReader.from_settings(settings) as reader:
        run_id = await _demo(settings, log, reader, stack_dir)
    if explorer_url is not None:
        print(f'\nRun explorer (served by the stack): {explorer_url}')
    print('\n' + replay_commands(run_id, stack_dir))


def replay_commands(run_id: str, stack_dir: str | Path = '.stepstream') -> str:
    """The demo's last lines: replay the orchestrator run `run_id`, and fork it at step 2 (docs/replay.md)."""
    here = '' if str(stack_dir) == '.stepstream' else f' --stack-dir {stack_dir}'
    agent = f'--agent {AGENT}{here}'
    return (
        'Replay its orchestrator run with no model called, then fork it at step 2 with another model '
        '(docs/replay.md):\n'
        f'  {program()} replay {run_id} {agent}\n'
        f'  {program()} replay {run_id} {agent} --from-step {FORK_STEP} --model {FORK_MODEL}'
    )


AGENT = 'stepstream.demo:orchestrator'
FORK_MODEL = 'stepstream.demo:cautious_model'
FORK_STEP = 2
"""The step the fork starts at: the research done, the publishing not yet asked for."""


async def _demo(settings: Settings, log: EventLog, reader: ProjectionReader, stack_dir: str | Path) -> str:
    deps = DemoDeps(settings, log, reader)
    result = await orchestrator.run(
        'research the release and announce it',
        conversation_id='release-demo',
        deps=deps,
        capabilities=persistence(log, 'orchestrator'),
    )
    print(f'orchestrator answered: {result.output}\n')
    run_id = to_run_id(f'orchestrator-{result.run_id}')
    waited = await _approve_and_resume(settings, log, reader)  # while the killed publisher's heartbeats age
    await wait_applied(reader, await log.flush(), settings.projection.db_path)
    for killed in deps.killed:
        await _until_stale(reader, killed, settings.liveness.stale_after_s)

    roots = await reader.list_runs(agent_name='orchestrator')
    print(f'== lineage ({len(roots)} orchestrator run(s) in the log so far)')
    for root in roots:
        print(tree(await reader.run_tree(root.run_id)))
    latest = await reader.run_tree(run_id)
    print("\n== this demo's runs: time, tokens (in/out) and cost at the demo model's price")
    print(runs_table(latest))
    for run in latest:
        print(f'\n== events of {run.run_id} ({run.agent_name}, {run.status})')
        print(events_table(await reader.list_events(run.run_id), run))
    print('\n== unresolved tool effects (in_flight or unknown_after_crash), all runs')
    print(effects_table(await reader.list_unresolved_tool_effects()))
    here = '' if str(stack_dir) == '.stepstream' else f' --stack-dir {stack_dir}'
    me = program()
    print(
        f'\nThe stack keeps running, and its log and projection persist under {stack_dir}; '
        '`make run` again adds to this history.\n'
        'Inspect it:\n'
        f'  {me} runs{here}                  # every run; also tree, events, snapshot, unresolved\n'
        f'  {me} tree {run_id}{here}\n'
        f'  {me} effects {waited}{here}   # the approval: who, when, why\n'
        f'  {me} deferred{here}              # the calls that wait for a decision (the Waiting page)\n'
        f'  {me} status{here}                # lag, apply rate, dead letters\n'
        f'  {me} rebuild --into /tmp/rebuilt{here} && '
        f'{me} verify {settings.projection.db_path} /tmp/rebuilt\n'
        f'  eval "$({me} stack env{here})"   # the settings, for other tools and terminals\n'
        f'Stop it: {me} stack down{here}'
    )
    return run_id
