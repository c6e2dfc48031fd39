"""`stepstream replay`: re-run an agent against recorded runs, name the first divergence (docs/replay.md)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from stepstream.cli._common import EXIT_FAILED, EXIT_OK, Declare, open_reader
from stepstream.errors import UsageError
from stepstream.settings import Settings


def add_commands(command: Declare) -> None:
    """Declare `replay`."""
    replay = command(
        'replay',
        _replay,
        'Re-execute an agent against recorded runs with no model called: each request the code builds is '
        'compared with the recorded one and answered with the recorded response. Exit 0 when every run '
        'matches, 1 on any divergence (or an erased run), 2 on bad usage.',
    )
    replay.add_argument('run', nargs='?', metavar='RUN', help='the run to replay')
    replay.add_argument(
        '--agent', metavar='MODULE:ATTR', required=True, help='the agent to replay, e.g. myapp.agents:support'
    )
    replay.add_argument(
        '--deps', metavar='MODULE:ATTR', help="the value to pass as the agent's deps (default: none)"
    )
    replay.add_argument(
        '--tools',
        choices=('recorded', 'live'),
        default='recorded',
        help='recorded: each call gets its recorded result, no tool runs (default); live: tools run and '
        'a result that differs from the recorded one is reported as tool drift',
    )
    fork = replay.add_argument_group('fork RUN at a step, to compare models from identical state')
    fork.add_argument(
        '--from-step',
        metavar='K',
        type=int,
        help='serve the recording up to step K, then let --model answer; the new run is written to the '
        'log, its metadata naming RUN and K (stepstream.forked_from, stepstream.forked_at_step)',
    )
    fork.add_argument(
        '--model',
        metavar='MODEL',
        help='the model from step K on: a Pydantic AI model name (openai:gpt-4o) or MODULE:ATTR',
    )
    batch = replay.add_argument_group('several runs (instead of RUN), newest first')
    batch.add_argument('--agent-name', metavar='NAME', help='runs written under this agent name')
    batch.add_argument('--conversation', metavar='ID', help="a conversation's runs")
    batch.add_argument('--status', metavar='STATUS', help='runs in this status (completed, failed, ...)')
    batch.add_argument('--last', metavar='N', type=int, default=20, help='at most N runs (default 20)')
    replay.add_argument('--json', action='store_true', help='print the report(s) as JSON')


def load_object(spec: str, what: str) -> Any:
    """The object `module:attr` names (dots after the colon reach into it); `UsageError` if not found."""
    module_name, _, attr = spec.partition(':')
    if not module_name or not attr:
        raise UsageError(f'{what} must be MODULE:ATTR (for example myapp.agents:support), not {spec!r}')
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f'{what} {spec!r}: cannot import {module_name!r}: {exc}') from exc
    for name in attr.split('.'):
        if not hasattr(found, name):
            raise UsageError(f'{what} {spec!r}: {module_name!r} has no attribute {attr!r}')
        found = getattr(found, name)
    return found


async def _replay(args: argparse.Namespace, settings: Settings) -> int:
    from pydantic_ai import Agent

    from stepstream.replay import replay_run

    batch = args.agent_name is not None or args.conversation is not None or args.status is not None
    if (args.run is None) == (not batch):
        raise UsageError('give RUN, or select runs with --agent-name, --conversation or --status (not both)')
    if args.last < 1:
        raise UsageError(f'--last must be at least 1, not {args.last}')
    if (args.from_step is None) != (args.model is None):
        raise UsageError('--from-step and --model go together')
    if args.from_step is not None and batch:
        raise UsageError('--from-step forks one RUN, not a batch')
    sys.path.insert(0, '')  # MODULE:ATTR from the working directory, as `python -m` finds it
    agent = load_object(args.agent, '--agent')
    if not isinstance(agent, Agent):
        raise UsageError(f'--agent {args.agent!r} is a {type(agent).__name__}, not a pydantic_ai Agent')
    deps = load_object(args.deps, '--deps') if args.deps else None
    if args.from_step is not None:
        return await _fork(args, settings, agent, deps)
    async with open_reader(settings) as reader:
        if batch:
            runs = await reader.list_runs(
                conversation_id=args.conversation,
                status=args.status,
                agent_name=args.agent_name,
                newest_first=True,
                limit=args.last,
            )
            run_ids = [run.run_id for run in runs]
        else:
            run_ids = [args.run]
        reports = [
            await replay_run(agent, run_id, reader=reader, tools=args.tools, deps=deps) for run_id in run_ids
        ]
    if args.json:
        body: Any = reports[0].to_json() if not batch else [r.to_json() for r in reports]
        print(json.dumps(body, indent=2, default=str))
    elif batch:
        for report in reports:
            where = ''
            if report.divergence is not None:
                where = f' at step {report.divergence.step}: {report.divergence.kind}'
            print(f'{report.outcome:<12} {report.run_id}{where}')
        counts = {
            o: sum(r.outcome == o for r in reports) for o in ('matched', 'in_doubt', 'diverged', 'erased')
        }
        other = len(reports) - sum(counts.values())
        print(
            f'{len(reports)} run(s): {counts["matched"]} matched, {counts["diverged"]} diverged, '
            f'{counts["in_doubt"]} stopped in doubt, {counts["erased"]} erased'
            + (f', {other} not replayable' if other else '')
        )
    else:
        print(reports[0].text())
    return EXIT_OK if all(r.ok for r in reports) else EXIT_FAILED


def _model(spec: str) -> Any:
    """MODULE:ATTR when it names an object, else a Pydantic AI model by name; `UsageError` if neither."""
    from pydantic_ai.models import infer_model

    try:
        return load_object(spec, '--model')
    except UsageError:
        pass
    try:
        return infer_model(spec)
    except Exception as exc:  # the model library's own refusal (unknown provider, missing key), said plainly
        raise UsageError(
            f'--model {spec!r} is neither MODULE:ATTR nor a model Pydantic AI knows: {exc}'
        ) from exc


async def _fork(args: argparse.Namespace, settings: Settings, agent: Any, deps: Any) -> int:
    from stepstream.producer import EventLog
    from stepstream.replay import fork_run_from_step

    async with open_reader(settings) as reader, EventLog(settings) as log:
        report = await fork_run_from_step(
            agent,
            args.run,
            reader=reader,
            from_step=args.from_step,
            model=_model(args.model),
            log=log,
            tools=args.tools,
            deps=deps,
        )
    print(json.dumps(report.to_json(), indent=2, default=str) if args.json else report.text())
    return EXIT_OK if report.ok else EXIT_FAILED
