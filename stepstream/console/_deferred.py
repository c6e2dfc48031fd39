"""`stepstream deferred`: the calls that wait for a decision, across runs (issue 49, decision 0056).

One line per deferred call (run, call, tool, what it waits for, agent, how long it has waited, its
arguments as stored, redacted; `--wide` adds the conversation and since when), oldest first; or
their JSON for scripts. A page
ends with the command for the next (`--after` the last call's cursor, the API's `next_after`); in
the JSON each call carries its `cursor`. The CLI runs it over the projection it opens, and the read
service can run it for a CLI that asks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from stepstream.console._args import ViewArgs
from stepstream.console._fit import fit, ident, when
from stepstream.console._render import to_json
from stepstream.schemas import DEFERRALS

if TYPE_CHECKING:
    from stepstream.readmodel import ProjectionReader, WaitingCall, WaitingCursor
    from stepstream.schemas import Deferral
    from stepstream.settings import Settings

DEFERRED_PAGE = 100
"""How many waiting calls `stepstream deferred` shows when not given `--limit`."""
ARGS_WIDTH = 60
"""The table shows this much of a call's arguments (`--json` shows them whole)."""


def waited(seconds: float) -> str:
    """A wait as a person reads it: `42s`, `7m 3s`, `5h 12m`, `3d 4h`."""
    whole = max(int(seconds), 0)
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f'{days}d {hours}h'
    if hours:
        return f'{hours}h {minutes}m'
    return f'{minutes}m {secs}s' if minutes else f'{secs}s'


def _stored(raw: str | None) -> Any:
    """A stored JSON value (arguments, metadata) as JSON, or the text as stored if it is not JSON."""
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def waiting_json(calls: Sequence[WaitingCall], now: datetime) -> str:
    """`stepstream deferred --json`: one object per waiting call, its `cursor` the next page's `--after`."""
    return to_json(
        [
            {
                'run_id': c.effect.run_id,
                'tool_call_id': c.effect.tool_call_id,
                'tool_name': c.effect.tool_name,
                'kind': c.effect.deferral,
                'agent_name': c.agent_name,
                'conversation_id': c.conversation_id,
                'waiting_since': c.waiting_since,
                'waited_seconds': round(max((now - c.waiting_since).total_seconds(), 0.0), 3),
                'args': _stored(c.effect.args),
                'metadata': _stored(c.effect.deferral_metadata),
                'content_erased': c.effect.content_erased,
                'cursor': c.cursor_text,
            }
            for c in calls
        ]
    )


def waiting_table(calls: Sequence[WaitingCall], now: datetime, *, wide: bool = False) -> str:
    """`stepstream deferred`: one line per waiting call, its arguments cut to `ARGS_WIDTH` characters.

    In 120 columns (not `wide`): ids shortened, no conversation or start (how long it waited
    stays), and the arguments, then the agent, then the tool cut to fit.
    """
    if not calls:
        return 'no tool call waits for a decision'
    rows = [
        (
            ident(c.effect.run_id, wide),
            ident(c.effect.tool_call_id, wide),
            c.effect.tool_name,
            c.effect.deferral or 'approval',
            c.agent_name,
            ident(c.conversation_id, wide),
            when(c.waiting_since, wide),
            waited((now - c.waiting_since).total_seconds()),
            '(erased)' if c.effect.content_erased else _cut(c.effect.args or '{}'),
        )
        for c in calls
    ]
    headers = ['run_id', 'tool_call_id', 'tool', 'kind', 'agent', 'conversation', 'since', 'waited', 'args']
    shown = {'run_id', 'tool_call_id', 'tool', 'kind', 'agent', 'waited', 'args'}
    return fit(headers, rows, wide=wide, shown=shown, cut=('args', 'agent', 'tool'))


def _cut(text: str) -> str:
    return text if len(text) <= ARGS_WIDTH else text[: ARGS_WIDTH - 3] + '...'


async def deferred(args: ViewArgs, reader: ProjectionReader, settings: Settings) -> str:
    """`stepstream deferred`: one page of the calls waiting for a decision, oldest first (`newest_first`).

    Filtered by agent, conversation and kind; `after` is the cursor of the call the page starts
    after (a `NotFound` for text no page gave). The text ends with the command for the next page.
    """
    from stepstream.readmodel import decode_waiting_cursor

    if args.deferral is not None and args.deferral not in DEFERRALS:
        raise ValueError(f'kind is approval, question or external, got {args.deferral!r}')
    limit = args.limit or DEFERRED_PAGE
    after: WaitingCursor | None = None if args.after is None else decode_waiting_cursor(args.after)
    found = await reader.list_waiting(
        newest_first=args.newest_first,
        limit=limit + 1,
        after=after,
        agent_name=args.agent_name,
        conversation_id=args.conversation_id,
        deferral=cast('Deferral | None', args.deferral),
    )
    calls, now = found[:limit], datetime.now(UTC)
    if args.json:
        return waiting_json(calls, now)
    text = waiting_table(calls, now, wide=args.wide)
    if len(found) > limit:
        following = f'stepstream deferred --after {calls[-1].cursor_text}'
        text += f'\n... more wait: the next page is `{following}` (same filters)'
    return text
