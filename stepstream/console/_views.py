"""The console views: each one query of the read model and its text, or its JSON for scripts.

A view is a function of its `ViewArgs`, a `ProjectionReader` and the `Settings`, returning what
the terminal shows: the CLI runs it over the projection it opens, and the read service runs the
same function for a CLI that asks it (`GET /api/console/{view}`), so the two cannot differ.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from stepstream.console._args import ViewArgs
from stepstream.console._conversations import conversations
from stepstream.console._deferred import deferred
from stepstream.console._fit import fit, ident
from stepstream.console._render import (
    UnresolvedEffect,
    events_table,
    ledger,
    messages_text,
    runs_table,
    to_json,
    tree,
    unresolved_table,
)
from stepstream.console._timeline import timeline
from stepstream.errors import NotFound
from stepstream.ids import short_id

if TYPE_CHECKING:
    from stepstream.readmodel import ProjectionReader
    from stepstream.schemas import RunRecord
    from stepstream.settings import Settings

View = Callable[[ViewArgs, 'ProjectionReader', 'Settings'], Awaitable[str]]


def _either(args: ViewArgs, value: object, text: str) -> str:
    return to_json(value) if args.json else text


async def _known_run(args: ViewArgs, reader: ProjectionReader) -> str:
    """The run a view of one run is about; `ValueError` without one, `NotFound` (`require_run`)."""
    if args.run_id is None:
        raise ValueError('this view needs a run_id')
    await reader.require_run(args.run_id)
    return args.run_id


RUNS_PAGE = 50
"""How many runs `stepstream runs` shows when not given `--limit`: the API's page."""


async def runs(args: ViewArgs, reader: ProjectionReader, settings: Settings) -> str:
    """`stepstream runs`: one page of the runs matching every filter, newest first (`oldest_first`).

    The text ends with the command for the next page when there is one; the JSON is the page.
    """
    limit = args.limit or RUNS_PAGE
    found = await runs_after(args, reader, args.after, limit + 1)
    page = found[:limit]
    if args.json:
        return to_json(page)
    text = runs_table(page, wide=args.wide)
    if len(found) > limit:
        text += f'\n... more: `stepstream runs --after {page[-1].run_id}` (same filters)'
    return text


async def runs_after(
    args: ViewArgs, reader: ProjectionReader, after: str | None, limit: int
) -> list[RunRecord]:
    """Up to `limit` runs of `args`' filters, in its order, after the run `after` (None: from the start)."""
    return await reader.list_runs(
        conversation_id=args.conversation_id,
        parent_run_id=args.parent_run_id,
        status=args.status,
        agent_name=args.agent_name,
        chain=args.chain,
        newest_first=not args.oldest_first,
        after=after,
        limit=limit,
    )


async def run_tree(args: ViewArgs, reader: ProjectionReader, settings: Settings) -> str:
    """`stepstream tree RUN`: the run and all its descendants."""
    run_id = await _known_run(args, reader)
    found = await reader.run_tree(run_id)
    return _either(args, found, tree(found, wide=args.wide))


async def events(args: ViewArgs, reader: ProjectionReader, settings: Settings) -> str:
    """`stepstream events RUN`: the run's timeline, its step events and every resolution or decision.

    Each resolution and decision on its calls is at its time (`timeline`); the JSON is the step
    events (the ledger's entries are `effects --json`'s).
    """
    run_id = await _known_run(args, reader)
    found = await reader.list_events(run_id)
    if args.json:
        return to_json(found)
    record = await reader.require_run(run_id)
    return events_table(timeline(found, await reader.list_tool_effects(run_id)), record, wide=args.wide)


async def snapshot(args: ViewArgs, reader: ProjectionReader, settings: Settings) -> str:
    """`stepstream snapshot RUN`: the latest complete (or, asked, any) snapshot, its messages in full."""
    run_id = await _known_run(args, reader)
    snap = await reader.latest_snapshot(run_id, include_interrupted=args.include_interrupted)
    if snap is None:
        which = 'snapshot' if args.include_interrupted else 'complete snapshot (try --include-interrupted)'
        raise NotFound(f'run {run_id!r} has no {which} in the projection at {settings.projection.db_path}')
    head = f'snapshot {snap.snapshot_seq} of {snap.run_id}: {snap.state}, step {snap.step_index}'
    if snap.erased and args.json:
        erased = {
            'run_id': snap.run_id,
            'snapshot_seq': snap.snapshot_seq,
            'state': snap.state,
            'step_index': snap.step_index,
            'erased': True,
            'messages': [],
        }
        return json.dumps(erased, indent=2)
    if snap.erased:
        return f'{head}, content erased'
    if args.json:
        from pydantic_ai.messages import ModelMessagesTypeAdapter

        return ModelMessagesTypeAdapter.dump_json(snap.messages, indent=2).decode()
    return f'{head}, {len(snap.messages)} messages\n{messages_text(snap.messages)}'


async def effects(args: ViewArgs, reader: ProjectionReader, settings: Settings) -> str:
    """`stepstream effects RUN`: the run's tool-effect ledger, each call and every resolution."""
    run_id = await _known_run(args, reader)
    found = await reader.list_tool_effects(run_id)
    return _either(args, found, ledger(found, wide=args.wide))


async def unresolved(args: ViewArgs, reader: ProjectionReader, settings: Settings) -> str:
    """`stepstream unresolved [RUN]`: tool calls that have not ended, beside their run's status."""
    if args.run_id is not None:
        await reader.require_run(args.run_id)
    found = await reader.list_unresolved_tool_effects(args.run_id)
    statuses: dict[str, str] = {}
    for effect in found:
        if effect.run_id not in statuses:
            run = await reader.get_run(effect.run_id)
            statuses[effect.run_id] = run.status if run is not None else 'unknown'
    items = [UnresolvedEffect(effect, statuses[effect.run_id]) for effect in found]
    return _either(args, items, unresolved_table(items, wide=args.wide))


async def conflicts(args: ViewArgs, reader: ProjectionReader, settings: Settings) -> str:
    """`stepstream conflicts`: run ids claimed by more than one writer."""
    found: list[RunRecord] = await reader.list_conflicts()
    wide = args.wide
    rows = [
        (
            ident(r.run_id, wide),
            ident(r.registration_id, wide),
            ', '.join(r.conflicting_writers if wide else map(short_id, r.conflicting_writers)),
        )
        for r in found
    ]
    headers = ['run_id', 'registered_by', 'conflicting_writers']
    return _either(args, found, fit(headers, rows, wide=wide, cut=('conflicting_writers',)))


VIEWS: dict[str, View] = {
    'runs': runs,
    'tree': run_tree,
    'events': events,
    'snapshot': snapshot,
    'effects': effects,
    'unresolved': unresolved,
    'deferred': deferred,
    'conversations': conversations,
    'conflicts': conflicts,
}
"""Every console view by its command's name; the read service serves each at `/api/console/{name}`
(a view of one run at `/api/console/{name}/{run_id}`)."""


async def show(name: str, args: ViewArgs, reader: ProjectionReader, settings: Settings) -> str:
    """What view `name` shows for `args`: `NotFound` for an unknown run, `ValueError` for bad args."""
    view = VIEWS.get(name)
    if view is None:
        raise ValueError(f'no console view {name!r}: one of {", ".join(VIEWS)}')
    return await view(args, reader, settings)
