"""Conversations in a group: each member answers for its own shards, the asked one merges (decision 0062).

A member's service lists conversations as a reader of every shard would: `GroupConversations`
(the read model's merge) over this member's reader and the others, each reached here through
the group's `Peers` at the member-only routes below (`/api/group/conversations/...`), which answer
from the receiving member's own shards and are never sent on. A member that does not answer makes
the read a 503 naming it, as every other read of the group.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field, TypeAdapter

from stepstream.readmodel import (
    MAX_SEARCH_WORDS,
    MEMBER_BATCH,
    ConversationCursor,
    ConversationHolding,
    ConversationReads,
    GroupConversations,
    decode_conversation_cursor,
    encode_conversation_cursor,
)
from stepstream.serve._group import Peers, forwarded
from stepstream.serve._source import Source

PATH = '/api/group/conversations'
"""Where a member answers for its own shards' part of the conversations."""

router = APIRouter(prefix=PATH, include_in_schema=False)
_HOLDINGS = TypeAdapter(list[ConversationHolding])


def conversation_reads(source: Source) -> ConversationReads:
    """What the service reads conversations from: its reader, or in a group every member merged."""
    peers = source.peers
    if peers is None or forwarded.get():
        return source.reader
    members = [source.reader.conversation_member(), *(Member(peers, url) for url in peers.others())]
    return GroupConversations(members, keys=source.reader.keys)


class Member:
    """Another member's part of the conversations, asked over HTTP (`ConversationMember`)."""

    def __init__(self, peers: Peers, url: str) -> None:
        """Ask the member at `url` through `peers`."""
        self._peers = peers
        self._url = url

    async def _ask(self, method: str, path: str, **kwargs: Any) -> Any:
        return await self._peers.ask(self._url, method, PATH + path, **kwargs)

    async def places(
        self, after: ConversationCursor | None, limit: int, archived: bool | None = None
    ) -> list[ConversationCursor]:
        """The member's `ConversationMember.places`."""
        after_text = None if after is None else encode_conversation_cursor(after)
        params = {'after': after_text, 'limit': limit, 'archived': archived}
        answer = await self._ask('GET', '/places', params=params)
        return [decode_conversation_cursor(text) for text in answer]

    async def filed(self, word: str, after: str | None, limit: int) -> list[str]:
        """The member's `ConversationMember.filed`."""
        answer = await self._ask('GET', '/filed', params={'word': word, 'after': after, 'limit': limit})
        return [str(conversation_id) for conversation_id in answer]

    async def word_entries(self, words: list[str]) -> list[int]:
        """The member's `ConversationMember.word_entries`."""
        return [int(n) for n in await self._ask('GET', '/words', params={'word': words})]

    async def holdings(self, conversation_ids: list[str], words: list[str]) -> list[ConversationHolding]:
        """The member's `ConversationMember.holdings`."""
        body = {'conversation_ids': conversation_ids, 'words': words}
        return _HOLDINGS.validate_python(await self._ask('POST', '/holdings', body=body))


def _source(request: Request) -> Source:
    found: Source = request.app.state.source
    return found


Limit = Annotated[int, Query(ge=1, le=MEMBER_BATCH)]


@router.get('/places')
async def places(
    request: Request, limit: Limit, after: str | None = None, archived: bool | None = None
) -> list[str]:
    """Where this member's shards place their conversations in a listing filtered by `archived`.

    For each, the newest entry of the shares here that file it so; newest first, as cursors.
    """
    cursor = None if after is None else decode_conversation_cursor(after)
    found = await _source(request).reader.conversation_member().places(cursor, limit, archived)
    return [encode_conversation_cursor(place) for place in found]


@router.get('/filed')
async def filed(request: Request, word: str, limit: Limit, after: str | None = None) -> list[str]:
    """The conversation ids this member's shards file under `word`, in order, after `after`."""
    return await _source(request).reader.conversation_member().filed(word, after, limit)


@router.get('/words')
async def words(
    request: Request, word: Annotated[list[str], Query(max_length=MAX_SEARCH_WORDS)]
) -> list[int]:
    """Each word's entries in this member's shards, counted up to `SEARCH_PROBE`."""
    return await _source(request).reader.conversation_member().word_entries(word)


class HoldingsAsked(BaseModel):
    """The conversations a member is asked about, and the words it is asked whether it files them by."""

    conversation_ids: list[str] = Field(max_length=MEMBER_BATCH)
    words: list[str] = Field(default_factory=list, max_length=MAX_SEARCH_WORDS)


@router.post('/holdings')
async def holdings(request: Request, asked: HoldingsAsked) -> Any:
    """What this member's shards hold of each conversation (`ConversationHolding`), in order."""
    found = await _source(request).reader.conversation_member().holdings(asked.conversation_ids, asked.words)
    return _HOLDINGS.dump_python(found, mode='json')
