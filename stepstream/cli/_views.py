"""The console views as commands (`runs`, `tree`, `events`, ...): a table, or JSON with `--json`.

Each is `stepstream.console`'s view of that name. With a read service at hand (the stack's
`serve`, or `STEPSTREAM_SERVE_URL`) the CLI asks it (`_remote`); otherwise it opens the
projection and runs the same view itself.
"""

from __future__ import annotations

import argparse

from stepstream.cli._common import EXIT_OK, Declare, add_json, open_reader
from stepstream.settings import Settings

RUN_STATUSES = ('running', 'stale', 'completed', 'failed', 'cancelled')


def add_commands(command: Declare) -> None:
    """Declare the views; each parser's `view` names the console view it runs."""
    runs = command('runs', view, 'List runs, in the order they started.')
    runs.add_argument('--conversation-id', help='only runs of this conversation')
    runs.add_argument('--parent-run-id', help='only direct children of this run')
    runs.add_argument('--status', choices=RUN_STATUSES, help='only runs in this status')
    runs.add_argument('--agent-name', help='only runs of this agent')

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
        'List tool calls that have not ended: in_flight (run live) or unknown_after_crash, with run status.',
    )
    unresolved.add_argument('run_id', nargs='?', help='only this run (default: every run)')
    conflicts = command('conflicts', view, 'List run ids claimed by more than one writer.')
    parsers = {
        'runs': runs,
        'tree': tree,
        'events': events,
        'snapshot': snapshot,
        'effects': effects,
        'unresolved': unresolved,
        'conflicts': conflicts,
    }
    for name, parser in parsers.items():
        parser.set_defaults(view=name)
    add_json(*parsers.values())


async def view(args: argparse.Namespace, settings: Settings) -> int:
    """Run the console view `args.view` over the projection at `settings.db_path`, and print it."""
    from stepstream.console import ViewArgs, show

    async with open_reader(settings) as reader:
        text = await show(args.view, ViewArgs.of(args), reader, settings)
    print(text)
    return EXIT_OK
