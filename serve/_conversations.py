"""Conversations in the API and the explorer: every conversation, newest activity first (decision 0062).

`GET /api/conversations` pages them (`after`: a page's `next_after`), `GET /api/conversations/{id}`
gives one; the explorer's `/conversations` page shows the same, each linking to its runs. A
conversation's shares are in every shard: a group member's service merges every member's
(`serve/_group_conversations.py`), and answers 503 naming a member that does not answer.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, Field

from stepstream.errors import NotFound
from stepstream.readmodel import Conversation, decode_conversation_cursor
from stepstream.serve._explorer import _page
from stepstream.serve._group_conversations import conversation_reads
from stepstream.serve._models import Problem, Usage
from stepstream.serve._source import Source

api = APIRouter(
    prefix='/api',
    responses={503: {'model': Problem, 'description': 'A shard this read needs is not readable here.'}},
)
pages = APIRouter(include_in_schema=False, default_response_class=HTMLResponse)

CONVERSATIONS_PAGE = 50
"""The conversations one page of the explorer shows; a link leads to the next."""


class ConversationView(BaseModel):
    """A conversation: its runs on the log summed, and its latest run."""

    conversation_id: str
    title: str | None = Field(
        description='The title a record gave it, else the first prompt of its earliest run (cut), or null.'
    )
    title_erased: bool = Field(
        default=False,
        description='Its title was sealed (erasure on) and its key destroyed (`stepstream forget`): '
        'title is null.',
    )
    runs: int = Field(description='How many of its runs the projection holds.')
    last_activity: datetime = Field(description='The newest record of any of its runs.')
    latest_run_id: str = Field(description='Its latest-started run.')
    last_status: str = Field(description="That run's status, judged now (running, stale, completed, ...).")
    live: bool = Field(description='Whether that run reads running now: its writer is still at it.')
    writer: str | None = Field(description='The writer that owns that run.')
    archived: bool = Field(description='Whether it is archived (`stepstream conversation archive`).')
    usage: Usage = Field(description="Its runs' usage and cost, summed.")

    @classmethod
    def of(cls, conversation: Conversation) -> ConversationView:
        """The API shape of a read-model `Conversation`."""
        return cls(
            conversation_id=conversation.conversation_id,
            title=conversation.title,
            title_erased=conversation.title_erased,
            runs=conversation.runs,
            last_activity=conversation.last_activity,
            latest_run_id=conversation.latest_run.run_id,
            last_status=conversation.last_status,
            live=conversation.live,
            writer=conversation.writer,
            archived=conversation.archived,
            usage=Usage.of(conversation.usage),
        )


class ConversationPage(BaseModel):
    """One page of conversations, newest activity first, and the cursor of the next."""

    conversations: list[ConversationView]
    next_after: str | None = Field(
        description='Pass as `after` for the next page; null when this page is the last.'
    )


def _source(request: Request) -> Source:
    found: Source = request.app.state.source
    return found


async def conversation_page(
    source: Source, *, after: str | None, limit: int, archived: bool | None = None, q: str | None = None
) -> ConversationPage:
    """One page of conversations (those `q`'s words find, by id); `BadCursor` (400) for a bad `after`."""
    cursor = None if after is None else decode_conversation_cursor(after)
    reader = conversation_reads(source)
    if q:
        found = await reader.search_conversations(q, limit=limit + 1, after=cursor, archived=archived)
    else:
        found = await reader.list_conversations(limit=limit + 1, after=cursor, archived=archived)
    shown = found[:limit]
    more = len(found) > limit and shown
    return ConversationPage(
        conversations=[ConversationView.of(c) for c in shown],
        next_after=shown[-1].cursor_text if more else None,
    )


@api.get(
    '/conversations',
    response_model=ConversationPage,
    summary='Conversations, newest activity first',
    responses={400: {'model': Problem, 'description': "An `after` that is no page's `next_after`."}},
)
async def list_conversations(
    request: Request,
    after: Annotated[str | None, Query(description="The previous page's next_after.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    archived: Annotated[
        bool | None, Query(description='Only the archived ones (true), or only the others (false).')
    ] = None,
    q: Annotated[
        str | None,
        Query(
            max_length=1000,
            description="Only those whose title or a run's user prompts hold every word (by id).",
        ),
    ] = None,
) -> ConversationPage:
    """Every conversation with a run on the log, the one with the newest activity first.

    Each with how many runs it has, their usage and cost summed, and its latest run: its status
    judged now, whether it is live, and its writer.
    """
    return await conversation_page(_source(request), after=after, limit=limit, archived=archived, q=q)


@api.get(
    '/conversations/{conversation_id}',
    response_model=ConversationView,
    summary='One conversation',
    responses={404: {'model': Problem, 'description': 'No run of this conversation is in the projection.'}},
)
async def get_conversation(
    request: Request, conversation_id: Annotated[str, Path(description='The conversation_id.')]
) -> ConversationView:
    """One conversation as the list shows it."""
    found = await conversation_reads(_source(request)).get_conversation(conversation_id)
    if found is None:
        raise NotFound(f'no run of conversation {conversation_id!r} in the projection')
    return ConversationView.of(found)


@pages.get('/conversations')
async def conversations(request: Request, after: str = '', archived: bool = False, q: str = '') -> Response:
    """The explorer's list of conversations, newest activity first: those not archived, or `archived=1`."""
    page = await conversation_page(
        _source(request), after=after or None, limit=CONVERSATIONS_PAGE, archived=archived, q=q[:1000] or None
    )
    query: dict[str, Any] = (
        {'after': page.next_after} | ({'archived': 1} if archived else {}) | ({'q': q} if q else {})
    )
    more = f'/conversations?{urlencode(query)}' if page.next_after else None
    return _page(request, 'conversations.html', page=page, more=more, archived=archived, q=q)
