"""Conversations over a group's members: each member's shares merged as one reader merges its shards'.

A group member holds only its own shards (decision 0016), and a conversation's shares are in
several of them. `GroupConversations` lists, searches and reads conversations over members that
each answer for their own shards (`ConversationMember`: this member's reader, the others over
HTTP): the walks merge the members' places in the listing's order, and each conversation found
is combined from every member's `ConversationHolding` by `combined`, the single reader's own
merge. So a member's page is the page a reader of every shard gives (decision 0062); a page reads
about what the single reader's does, `limit` x shards places, in a few requests per member.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from stepstream.readmodel._conversations import (
    MAX_SEARCH_WORDS,
    SEARCH_PROBE,
    Conversation,
    ConversationCursor,
    ConversationHolding,
    combined,
    latest_of,
)
from stepstream.readmodel._shards import ShardUnavailable
from stepstream.storage import words_of

MEMBER_BATCH = 200
"""The most places or conversations asked of a member at once when a page wants more."""
_REREADS = 3

Place = TypeVar('Place', ConversationCursor, str)


class ConversationMember(Protocol):
    """One member's part of the conversations: its own shards' places and holdings."""

    async def places(self, after: ConversationCursor | None, limit: int) -> list[ConversationCursor]:
        """Its conversations at their newest activity in its shards, newest first, below `after`."""
        ...

    async def filed(self, word: str, after: str | None, limit: int) -> list[str]:
        """The conversation ids its shards file under `word`, in order, after `after`."""
        ...

    async def word_entries(self, words: list[str]) -> list[int]:
        """Each word's entries in its shards, counted up to `SEARCH_PROBE`."""
        ...

    async def holdings(self, conversation_ids: list[str], words: list[str]) -> list[ConversationHolding]:
        """What its shards hold of each conversation, in order."""
        ...


class ConversationReads(Protocol):
    """Conversations as `ProjectionReader` reads them: what the API, explorer and console ask."""

    async def list_conversations(
        self, *, limit: int | None = 50, after: ConversationCursor | None = None, archived: bool | None = None
    ) -> list[Conversation]:
        """`ProjectionReader.list_conversations`."""
        ...

    async def search_conversations(
        self,
        words: str,
        *,
        limit: int | None = 50,
        after: ConversationCursor | None = None,
        archived: bool | None = None,
    ) -> list[Conversation]:
        """`ProjectionReader.search_conversations`."""
        ...

    async def get_conversation(self, conversation_id: str) -> Conversation | None:
        """`ProjectionReader.get_conversation`."""
        ...


class GroupConversations:
    """`ConversationReads` over every member of a group, each answering for its own shards."""

    def __init__(self, members: Sequence[ConversationMember]) -> None:
        """Merge `members` (this one's reader among them): together they must hold every shard."""
        self._members = list(members)

    async def list_conversations(
        self, *, limit: int | None = 50, after: ConversationCursor | None = None, archived: bool | None = None
    ) -> list[Conversation]:
        """`ProjectionReader.list_conversations` over the group."""
        pages = [member.places for member in self._members]
        places = _merged(pages, after, _batch(limit), reverse=True)

        def found_at(place: ConversationCursor, conversation: Conversation | None) -> bool:
            # Taken at its newest activity of all: an older place of it (another member's) is skipped.
            return conversation is not None and conversation.last_activity == place[0]

        return await self._take(places, lambda place: place[1], found_at, [], limit, archived)

    async def search_conversations(
        self,
        words: str,
        *,
        limit: int | None = 50,
        after: ConversationCursor | None = None,
        archived: bool | None = None,
    ) -> list[Conversation]:
        """`ProjectionReader.search_conversations` over the group: a word may be filed by any member."""
        wanted = words_of(words)[:MAX_SEARCH_WORDS]
        if not wanted:
            return []
        counts = await asyncio.gather(*(member.word_entries(wanted) for member in self._members))
        entries = {word: min(sum(c[i] for c in counts), SEARCH_PROBE) for i, word in enumerate(wanted)}
        first, *others = sorted(wanted, key=entries.__getitem__)
        if entries[first] == 0:  # a word filed nowhere: nothing holds every word
            return []
        pages = [_filed_by(member, first) for member in self._members]
        places = _merged(pages, None if after is None else after[1], _batch(limit), reverse=False)
        return await self._take(places, str, lambda _, c: c is not None, others, limit, archived)

    async def get_conversation(self, conversation_id: str) -> Conversation | None:
        """`ProjectionReader.get_conversation` over the group."""
        [(conversation, _)] = await self._conversations([conversation_id], [])
        return conversation

    async def _take(
        self,
        places: AsyncIterator[Place],
        id_of: Callable[[Place], str],
        found_at: Callable[[Place, Conversation | None], bool],
        words: list[str],
        limit: int | None,
        archived: bool | None,
    ) -> list[Conversation]:
        """The conversations at `places` that are found there, filed under `words`, and `archived` so.

        Places are read a batch at a time, as many as the page still wants, and each batch's
        conversations asked of every member at once.
        """
        found: list[Conversation] = []
        while limit is None or len(found) < limit:
            want = MEMBER_BATCH if limit is None else min(limit - len(found), MEMBER_BATCH)
            batch = [place async for place in _first(places, want)]
            if not batch:
                break
            conversations = await self._conversations([id_of(place) for place in batch], words)
            for place, (conversation, filed) in zip(batch, conversations, strict=True):
                if limit is not None and len(found) >= limit:
                    break
                if found_at(place, conversation) and set(words) <= filed:
                    assert conversation is not None
                    if archived in (None, conversation.archived):
                        found.append(conversation)
        return found

    async def _conversations(
        self, conversation_ids: list[str], words: list[str]
    ) -> list[tuple[Conversation | None, set[str]]]:
        """Each conversation combined from every member's holdings, and the words any member files it by."""
        answers = await asyncio.gather(*(m.holdings(conversation_ids, words) for m in self._members))
        result = []
        for i, conversation_id in enumerate(conversation_ids):
            holdings = [answer[i] for answer in answers]
            conversation = await self._combined(conversation_id, holdings, words)
            result.append((conversation, {word for h in holdings for word in h.words}))
        return result

    async def _combined(
        self, conversation_id: str, holdings: list[ConversationHolding], words: list[str]
    ) -> Conversation | None:
        for _ in range(_REREADS):
            shares = [share for holding in holdings for share in holding.shares]
            if not shares:
                return None
            latest = latest_of(shares)
            runs = [h.latest_run for h in holdings if h.latest_run is not None]
            run = next((r for r in runs if r.run_id == latest), None)
            if run is not None:
                return combined(conversation_id, shares, run)
            # The members were read at different moments (a run moved or was dropped): read again.
            answers = await asyncio.gather(*(m.holdings([conversation_id], words) for m in self._members))
            holdings = [answer[0] for answer in answers]
        raise ShardUnavailable(
            f'the members of the group did not agree on conversation {conversation_id!r} '
            f'in {_REREADS} reads (its runs moving between members); try again'
        )


def _batch(limit: int | None) -> int:
    """How many places to ask each member for at once: a page's worth, at most `MEMBER_BATCH`."""
    return MEMBER_BATCH if limit is None else max(1, min(limit, MEMBER_BATCH))


def _filed_by(member: ConversationMember, word: str) -> Callable[[str | None, int], Awaitable[list[str]]]:
    return lambda after, limit: member.filed(word, after, limit)


async def _merged(
    pages: Sequence[Callable[[Place | None, int], Awaitable[list[Place]]]],
    after: Place | None,
    batch: int,
    *,
    reverse: bool,
) -> AsyncIterator[Place]:
    """The places every member's `pages` give from after `after`, merged in order, each once.

    A member is asked for `batch` places at a time, the next batch once its last is taken: a
    member's places are in order, so the greatest (or least) head of all is the next of all.
    """
    buffers: list[collections.deque[Place]] = [collections.deque() for _ in pages]
    cursors: list[Place | None] = [after for _ in pages]
    done = [False for _ in pages]
    last = after
    while True:
        empty = [i for i, buffer in enumerate(buffers) if not buffer and not done[i]]
        answers = await asyncio.gather(*(pages[i](cursors[i], batch) for i in empty))
        for i, answer in zip(empty, answers, strict=True):
            buffers[i].extend(answer)
            done[i] = len(answer) < batch
            if answer:
                cursors[i] = answer[-1]
        heads = [i for i, buffer in enumerate(buffers) if buffer]
        if not heads:
            return
        pick = max if reverse else min
        i = pick(heads, key=lambda i: buffers[i][0])
        place = buffers[i].popleft()
        if place != last:  # the same place in two members' shards
            last = place
            yield place


async def _first(places: AsyncIterator[Place], n: int) -> AsyncIterator[Place]:
    """The next `n` of `places` (fewer at their end)."""
    for _ in range(n):
        try:
            yield await anext(places)
        except StopAsyncIteration:
            return
