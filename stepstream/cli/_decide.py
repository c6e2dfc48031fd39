"""Decisions on deferred calls: `approve`, `deny` and `complete` (issue 49, decision 0056).

Each reads the call from the projection, writes its decision to the log as a `resolved` transition
answering the call's `deferred` one (`decide_deferred_call`, redacted as the run's own records
are), then waits, a bounded while, for the projection to apply it: the first decision in the log
decides, so only then does the command know whether this one stands. It exits 0 when it does (or
when the projection did not show it in time: written, the views show it once applied), 1 when an
earlier decision stands (it says which), or the call does not wait for one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TYPE_CHECKING, Any

from stepstream.cli._common import EXIT_FAILED, EXIT_OK, Declare, add_json, open_reader
from stepstream.errors import NotFound, NotWaiting, UsageError
from stepstream.settings import Settings

if TYPE_CHECKING:
    from stepstream.readmodel import ProjectionReader
    from stepstream.schemas import EffectResolution, ToolEffectTransition

APPLY_WAIT_S = 10.0
"""How long a decision waits for the projection to show it before saying it was written."""
POLL_S = 0.2


def add_commands(command: Declare) -> None:
    """Declare `approve`, `deny` and `complete`."""
    approve = command(
        'approve', _decide, 'Approve a deferred call that waits for approval: its run resumes and runs it.'
    )
    approve.add_argument('--args', metavar='JSON', help='the arguments it runs with instead (a JSON object)')
    deny = command('deny', _decide, 'Deny a deferred call that waits for approval: the model is told why.')
    deny.add_argument('--message', required=True, metavar='TEXT', help='what the model is told')
    complete = command(
        'complete',
        _decide,
        "Give a deferred call (a question, an outside system's call) its result, or its error.",
    )
    answer = complete.add_mutually_exclusive_group(required=True)
    answer.add_argument('--result', metavar='JSON', help='the result (any JSON value)')
    answer.add_argument('--error', metavar='TEXT', help='the call failed: what the model is told')
    for name, parser in (('approve', approve), ('deny', deny), ('complete', complete)):
        parser.add_argument('run_id', help='the run')
        parser.add_argument('tool_call_id', help='the deferred call (`stepstream deferred` lists them)')
        parser.add_argument('--note', metavar='TEXT', help='why (kept in the log with your name, redacted)')
        parser.add_argument(
            '--by', metavar='NAME', help='who decides (default: STEPSTREAM_OPERATOR, else your OS user)'
        )
        parser.set_defaults(action=name)
        add_json(parser)


def _json_value(flag: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise UsageError(f'{flag} must be JSON ({exc}), got {raw!r:.80}') from None


def decision_of(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The decision a command line asks for, and `decide_deferred_call`'s arguments for it."""
    what: dict[str, Any] = {'note': args.note}
    if args.action == 'approve':
        if args.args is not None:
            what['args'] = _json_value('--args', args.args)
            if not isinstance(what['args'], dict):
                raise UsageError(f'--args must be a JSON object, got {args.args!r:.80}')
        return 'approved', what
    if args.action == 'deny':
        return 'denied', {**what, 'message': args.message}
    if args.error is not None:
        return 'failed', {**what, 'message': args.error}
    return 'returned', {**what, 'result': _json_value('--result', args.result)}


async def _decide(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.producer import EventLog, Redaction, decide_deferred_call, resolver_id

    decision, what = decision_of(args)
    operator = args.by or settings.serve.operator_name
    async with open_reader(settings) as reader:
        run = await reader.require_run(args.run_id)
        effect = await reader.get_tool_effect(args.run_id, args.tool_call_id)
        if effect is None:
            raise NotFound(
                f'run {args.run_id!r} has no tool call {args.tool_call_id!r} '
                f'in the projection at {settings.projection.db_path}'
            )
        try:
            async with EventLog(settings, create_topics=False) as log:
                record = await decide_deferred_call(
                    log,
                    effect,
                    decision=decision,  # type: ignore[arg-type]
                    operator=operator,
                    writer_id=resolver_id('cli'),
                    conversation_id=run.conversation_id or run.run_id,
                    redaction=Redaction.from_settings(settings),
                    **what,
                )
        except NotWaiting as exc:
            standing = exc.decision
            said = f'; the decision that stands: {standing_text(standing)}' if standing is not None else ''
            print(f'stepstream: {exc}{said}', file=sys.stderr)
            return EXIT_FAILED
        except ValueError as exc:  # a decision the projector would refuse: nothing was written
            print(f'stepstream: {exc}: nothing was written', file=sys.stderr)
            return EXIT_FAILED
        ours = await _applied(reader, record)
    return _report(args, settings, record, ours)


async def _applied(reader: ProjectionReader, record: ToolEffectTransition) -> Any:
    """The call's record once the projection shows `record` among its resolutions, or None in time."""
    deadline = asyncio.get_running_loop().time() + APPLY_WAIT_S
    while True:
        effect = await reader.get_tool_effect(record.run_id, record.tool_call_id)
        if effect is not None and any(_is(r, record) for r in effect.resolutions):
            return effect
        if asyncio.get_running_loop().time() > deadline:
            return None
        await asyncio.sleep(POLL_S)


def _is(resolution: EffectResolution, record: ToolEffectTransition) -> bool:
    return (resolution.writer_id, resolution.resolved_at, resolution.resolution) == (
        record.writer_id,
        record.timestamp,
        record.resolution,
    )


def standing_text(decision: Any) -> str:
    """The decision that stands on a call, as the commands say it: kind, by whom, when, why."""
    from stepstream.console import time_text

    note = f' ({decision.note})' if getattr(decision, 'note', None) else ''
    return f'{decision.resolution} by {decision.resolved_by} at {time_text(decision.resolved_at)}{note}'


def _report(args: argparse.Namespace, settings: Settings, record: ToolEffectTransition, effect: Any) -> int:
    from stepstream.console import to_json

    ours = next((r for r in effect.resolutions if _is(r, record)), None) if effect is not None else None
    stands = None if ours is None else ours.applied
    if args.json:
        standing = effect.resolution if effect is not None else None
        print(to_json({'recorded': record, 'stands': stands, 'decision': standing}))
    elif stands is None:
        print(
            f'{record.resolution} {record.tool_call_id} of {record.run_id} by {record.resolved_by} '
            f'(written to {settings.topics.tool_effects_topic}; the projection did not show it within '
            f'{APPLY_WAIT_S:g}s: the views show it once the projector applies it)'
        )
    elif stands:  # what it says as the projection reads it: opened, erasure on
        print(
            f'{record.resolution} {record.tool_call_id} of {record.run_id} by {record.resolved_by}'
            + _what(ours or record)
        )
    else:
        print(
            f'stepstream: an earlier decision on {record.tool_call_id} of {record.run_id} stands: '
            f'{standing_text(effect.resolution)}; yours ({record.resolution} by {record.resolved_by}) '
            'is kept as history only',
            file=sys.stderr,
        )
    return EXIT_FAILED if stands is False else EXIT_OK


def _what(record: EffectResolution | ToolEffectTransition) -> str:
    parts = []
    if record.args is not None:
        parts.append(f'with arguments {record.args}')
    if record.result is not None:
        parts.append(f'result {record.result}')
    if record.error is not None:
        parts.append(f'message {record.error!r}')
    if record.note:
        parts.append(f'note {record.note!r}')
    return ': ' + '; '.join(parts) if parts else ''
