"""`stepstream conversations`: every conversation, newest activity first (decision 0062).

One line per conversation (its id, how many runs, its latest run's status judged now, whether it
is live, that run, its newest activity, its title; `--wide` adds the writer, tokens and cost
summed); or their JSON for scripts. A page ends with the command for the next (`--after` the last
one's cursor, the API's `next_after`); in the JSON each carries its `cursor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from stepstream.console._args import ViewArgs
from stepstream.console._fit import fit, ident, when
from stepstream.console._render import to_json

if TYPE_CHECKING:
    from stepstream.readmodel import Conversation, ConversationReads
    from stepstream.settings import Settings

CONVERSATIONS_PAGE = 50
"""How many conversations `stepstream conversations` shows when not given `--limit`."""
TITLE_WIDTH = 50
"""The table shows this much of a title (`--json` shows it whole)."""


def conversation_json(c: Conversation) -> dict[str, Any]:
    """One conversation as `--json` (and the read service's console) shows it."""
    return {
        'conversation_id': c.conversation_id,
        'title': c.title,
        'title_erased': c.title_erased,
        'runs': c.runs,
        'last_activity': c.last_activity,
        'latest_run_id': c.latest_run.run_id,
        'last_status': c.last_status,
        'live': c.live,
        'writer': c.writer,
        'archived': c.archived,
        'usage': c.usage,
        'cursor': c.cursor_text,
    }


def conversations_table(found: Sequence[Conversation], *, wide: bool = False) -> str:
    """One line per conversation.

    In 120 columns (not `wide`): ids shortened, the title cut to fit, and no writer, tokens or cost.
    """
    if not found:
        return 'no conversation in the projection'
    rows = [
        (
            ident(c.conversation_id, wide),
            c.runs,
            c.last_status,
            ('live' if c.live else '') + (' archived' if c.archived else ''),
            ident(c.latest_run.run_id, wide),
            c.writer,
            f'{c.usage.input_tokens}/{c.usage.output_tokens}',
            c.usage.cost_usd or '',
            when(c.last_activity, wide),
            '(erased)' if c.title_erased else _cut(c.title or ''),
        )
        for c in found
    ]
    headers = [
        'conversation',
        'runs',
        'last status',
        'live',
        'latest run',
        'writer',
        'tokens',
        'cost',
        'active',
        'title',
    ]
    shown = {'conversation', 'runs', 'last status', 'live', 'latest run', 'active', 'title'}
    return fit(headers, rows, wide=wide, shown=shown, cut=('title',))


def _cut(text: str) -> str:
    return text if len(text) <= TITLE_WIDTH else text[: TITLE_WIDTH - 3] + '...'


async def conversations(args: ViewArgs, reader: ConversationReads, settings: Settings) -> str:
    """`stepstream conversations`: one page, newest activity first, from `after` (a page's cursor).

    `reader`: a `ProjectionReader`, or a group member's service's merge of every member's.
    """
    from stepstream.readmodel import decode_conversation_cursor

    limit = args.limit or CONVERSATIONS_PAGE
    after = None if args.after is None else decode_conversation_cursor(args.after)
    if args.archived not in (None, 'true', 'false'):
        raise ValueError(f'archived is true or false, got {args.archived!r}')
    archived = None if args.archived is None else args.archived == 'true'
    if args.search:
        found = await reader.search_conversations(
            args.search, limit=limit + 1, after=after, archived=archived
        )
    else:
        found = await reader.list_conversations(limit=limit + 1, after=after, archived=archived)
    shown = found[:limit]
    if args.json:
        return to_json([conversation_json(c) for c in shown])
    text = conversations_table(shown, wide=args.wide)
    if len(found) > limit:
        more = f'stepstream conversations --after {shown[-1].cursor_text}'
        text += f'\n... more: the next page is `{more}`' + (
            '' if archived is None and not args.search else ' (same filters)'
        )
    return text
