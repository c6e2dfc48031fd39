"""`stepstream conversation title|archive|unarchive ID`: a `conversation_marked` record on the log.

The record is keyed by the conversation's latest run (read from the projection), so the
conversation must have a run there; the title or flag is shown once the projector applies it
(decision 0062). Listing is the `conversations` view (`_views.py`).
"""

from __future__ import annotations

import argparse
from typing import Any

from stepstream.cli._common import EXIT_OK, Declare, add_json, open_reader
from stepstream.erasure import is_sealed_text
from stepstream.errors import NotFound
from stepstream.schemas import TITLE_KEY
from stepstream.settings import Settings


def add_commands(command: Declare, sub: Any) -> None:
    """Declare `conversation title`, `conversation archive` and `conversation unarchive`."""
    conversation = sub.add_parser(
        'conversation',
        help='Title, archive or unarchive a conversation: a record on the log (title|archive|unarchive).',
    )
    actions = conversation.add_subparsers(metavar='ACTION', required=True)
    title = command(
        'title', _mark, 'Give a conversation a title (instead of its first prompt).', parent=actions
    )
    title.add_argument('conversation_id', help='the conversation')
    title.add_argument('title', help='its title (at most 200 characters)')
    archive = command('archive', _mark, 'Archive a conversation: listed only when asked for.', parent=actions)
    archive.add_argument('conversation_id', help='the conversation')
    archive.set_defaults(archived=True)
    unarchive = command('unarchive', _mark, 'List an archived conversation again.', parent=actions)
    unarchive.add_argument('conversation_id', help='the conversation')
    unarchive.set_defaults(archived=False)
    add_json(title, archive, unarchive)


async def _mark(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.console import to_json
    from stepstream.producer import EventLog, mark_conversation

    async with open_reader(settings) as reader:
        found = await reader.get_conversation(args.conversation_id)
    if found is None:
        raise NotFound(
            f'no run of conversation {args.conversation_id!r} in the projection at '
            f'{settings.projection.db_path}'
        )
    async with EventLog(settings, create_topics=False) as log:
        record = await mark_conversation(
            log,
            run_id=found.latest_run.run_id,
            conversation_id=args.conversation_id,
            title=getattr(args, 'title', None),
            archived=getattr(args, 'archived', None),
        )
    if args.json:
        print(to_json(record))
        return EXIT_OK
    title = record.metadata.get(TITLE_KEY)
    what = (
        ''
        if title is None
        else 'titled (sealed: erasure is on)'
        if is_sealed_text(title)
        else f'titled {title!r}'
    )
    what = what or ('archived' if args.archived else 'unarchived')
    print(f'conversation {args.conversation_id} {what} (a record on the log, keyed by run {record.run_id})')
    return EXIT_OK
