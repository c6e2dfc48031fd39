"""The console views as commands (`runs`, `tree`, `events`, ...): a table, or JSON with `--json`.

Each is `stepstream.console`'s view of that name. With a read service at hand (the stack's
`serve`, or `STEPSTREAM_SERVE_URL`) the CLI asks it (`_remote`); otherwise it opens the
projection and runs the same view itself.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from stepstream.cli._common import EXIT_OK, Declare, add_json, add_wide, open_reader
from stepstream.settings import Settings

if TYPE_CHECKING:
    from stepstream.readmodel import ProjectionReader

RUN_STATUSES = ('running', 'stale', 'waiting', 'resumed', 'completed', 'failed', 'cancelled')
CHAIN_STATUSES = ('intact', 'broken', 'unchained')
DEFERRALS = ('approval', 'question', 'external')
"""`schemas.RUN_STATUSES`, `CHAIN_STATUSES` and `DEFERRALS`, without importing the schemas (a command
starts fast: fastavro comes with them); tests/test_waiting_surfaces.py and tests/test_deferred_cli.py
hold the copies equal."""


def add_commands(command: Declare) -> None:
    """Declare the views; each parser's `view` names the console view it runs."""
    runs = command('runs', view, 'List runs, a page at a time: the newest first.')
    runs.add_argument('--conversation-id', help='only runs of this conversation')
    runs.add_argument('--parent-run-id', help='only direct children of this run')
    runs.add_argument(
        '--status',
        choices=RUN_STATUSES,
        help='only runs in this status (waiting: ended with deferred tool calls, to be resumed)',
    )
    runs.add_argument('--agent-name', help='only runs of this agent')
    runs.add_argument(
        '--chain',
        choices=CHAIN_STATUSES,
        help='only runs whose hash chain reads so (broken: a record does not link to the one before it)',
    )
    runs.add_argument('--limit', type=_positive, help='runs per page (default 50)')
    runs.add_argument(
        '--after', metavar='RUN_ID', help='the page after this run (the last of the previous page)'
    )
    runs.add_argument('--oldest-first', action='store_true', help='in the order they started')
    runs.add_argument(
        '--all',
        action='store_true',
        help='every run, as JSON lines, read page by page from the projection (never held whole)',
    )

    tree = command('tree', view, 'Show a run and all its descendants.')
    tree.add_argument('run_id', help='the root of the tree')
    events = command('events', view, "List a run's events in seq order.")
    events.add_argument('run_id', help='the run')
    snapshot = command('snapshot', view, "Show a run's latest snapshot.")
    snapshot.add_argument('run_id', help='the run')
    snapshot.add_argument(
        '--include-interrupted', action='store_true', help='the latest of any state, not the latest complete'
    )
    effects = command(
        'effects', view, "List a run's tool-effect ledger: each call's status and every resolution."
    )
    effects.add_argument('run_id', help='the run')
    unresolved = command(
        'unresolved',
        view,
        'List tool calls that have not ended: in_flight (run live) or unknown_after_crash, with run '
        'status (a deferred call waits, it is not in doubt: `effects RUN` shows it).',
    )
    unresolved.add_argument('run_id', nargs='?', help='only this run (default: every run)')
    conflicts = command('conflicts', view, 'List run ids claimed by more than one writer.')
    deferred = _deferred(command)
    conversations = command(
        'conversations',
        view,
        'List conversations, the newest activity first: runs, last status, live, latest run, last active, '
        'title (--wide: also its writer, tokens and cost; continue one with continue_conversation).',
    )
    conversations.add_argument('--limit', type=_positive, help='conversations per page (default 50)')
    conversations.add_argument(
        '--archived', choices=('true', 'false'), help='only the archived ones (true) or the others (false)'
    )
    conversations.add_argument(
        '--search', metavar='WORDS', help="only those whose title or a run's user prompts hold every word"
    )
    conversations.add_argument(
        '--after', metavar='CURSOR', help='the page after this one: the cursor a page ends with (next_after)'
    )
    parsers = {
        'runs': runs,
        'tree': tree,
        'events': events,
        'snapshot': snapshot,
        'effects': effects,
        'unresolved': unresolved,
        'deferred': deferred,
        'conversations': conversations,
        'conflicts': conflicts,
    }
    for name, parser in parsers.items():
        parser.set_defaults(view=name)
    add_json(*parsers.values())
    add_wide(*(parser for name, parser in parsers.items() if name != 'snapshot'))


def _deferred(command: Declare) -> argparse.ArgumentParser:
    """`stepstream deferred`: the calls that wait for a decision, across runs (decide: `approve`, ...)."""
    deferred = command(
        'deferred',
        view,
        'List the tool calls that wait for a decision, across runs, the longest waiting first: run, '
        'call, tool, kind, agent, how long, arguments (--wide: also the conversation and since when; '
        'decide with approve, deny, complete).',
    )
    deferred.add_argument(
        '--agent', dest='agent_name', metavar='NAME', help='only calls of runs of this agent'
    )
    deferred.add_argument(
        '--conversation', dest='conversation_id', metavar='ID', help='only calls of runs of this conversation'
    )
    deferred.add_argument(
        '--kind',
        dest='deferral',
        choices=DEFERRALS,
        help='only calls waiting for this: approval (a person), question (an answer), external (a result)',
    )
    deferred.add_argument(
        '--newest', dest='newest_first', action='store_true', help='the calls that started waiting last first'
    )
    deferred.add_argument('--limit', type=_positive, help='calls per page (default 100)')
    deferred.add_argument(
        '--after',
        metavar='CURSOR',
        help="the page after this call: the cursor the previous page ends with (the API's next_after)",
    )
    return deferred


ALL_PAGE = 1000
"""The page `stepstream runs --all` reads at a time: what it holds in memory at once."""


async def view(args: argparse.Namespace, settings: Settings) -> int:
    """Run the console view `args.view` over the projection at `settings.projection.db_path`, and print it."""
    from stepstream.console import ViewArgs, show

    async with open_reader(settings) as reader:
        if getattr(args, 'all', False):
            await _every_run(args, reader)
            return EXIT_OK
        text = await show(args.view, ViewArgs.of(args), reader, settings)
    print(text)
    return EXIT_OK


async def _every_run(args: argparse.Namespace, reader: ProjectionReader) -> None:
    """`stepstream runs --all`: each run as one JSON line, a page at a time, in the list's order."""
    from stepstream.console import ViewArgs, runs_after, to_json

    asked, after = ViewArgs.of(args), args.after
    while True:
        page = await runs_after(asked, reader, after, ALL_PAGE)
        for run in page:
            print(to_json(run, indent=None))
        if len(page) < ALL_PAGE:
            return
        after = page[-1].run_id


def _positive(raw: str) -> int:
    """A page size: a whole number of at least 1."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f'a whole number, got {raw!r}') from None
    if value < 1:
        raise argparse.ArgumentTypeError(f'at least 1, got {value}')
    return value
