"""Conversations over a group's members: each member's shares merged as one reader merges its shards'.

A group member holds only its own shards (decision 0016), and a conversation's shares are in
several of them. `GroupConversations` lists, searches and reads conversations over members that
each answer for their own shards (`ConversationMember`: this member's reader, the others over
HTTP): the walks merge the members' places in the listing's order (a filtered listing's places in
the `ACTIVITY` range each member's shards file that way), and each conversation found is combined
from every member's `ConversationHolding` by `combined` and placed by `listed_at`, the single
reader's own, its sealed title opened with the asking member's keys. So a member's page is the
page a reader of every shard gives (decision 0062); a page reads about what the single reader's
does, `limit` x shards places, in a few requests per member.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from stepstream.readmodel._conversation import (
    Conversation,
    ConversationCursor,
    ConversationHolding,
    any_erased,
    combined,
    latest_of,
    listed_at,
    with_keys,
)
from stepstream.readmodel._conversations import MAX_SEARCH_WORDS, SEARCH_PROBE
from stepstream.readmodel._shards import ShardUnavailable
from stepstream.storage import ConversationState, words_of
from stepstream.timestamps import micros

if TYPE_CHECKING:
    from stepstream.erasure import KeyRing

MEMBER_BATCH = 200
"""The most places or conversations asked of a member at once when a page wants more."""
_REREADS = 3

Place = TypeVar('Place', ConversationCursor, str)
Found = tuple[Conversation | None, list[ConversationState], set[str]]
"""A conversation combined from every member's holdings, the shares it was combined from, and the
words any member files it under."""


class ConversationMember(Protocol):
    """One member's part of the conversations: its own shards' places and holdings."""

    async def places(
        self, after: ConversationCursor | None, limit: int, archived: bool | None = None
    ) -> list[ConversationCursor]:
        """Its conversations' entries a listing filtered by `archived` may take them at, below `after`.

        The newest of its shares that file each so, newest first (`Conversations.places`).
        """
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

    def __init__(self, members: Sequence[ConversationMember], keys: KeyRing | None = None) -> None:
        """Merge `members` (this one's reader among them): together they must hold every shard.

        `keys` (erasure on: the asking member's reader's) open the sealed titles the members' shares hold.
        """
        self._members = list(members)
        self._keys = keys

    async def list_conversations(
        self, *, limit: int | None = 50, after: ConversationCursor | None = None, archived: bool | None = None
    ) -> list[Conversation]:
        """`ProjectionReader.list_conversations` over the group."""

        def taken(
            place: ConversationCursor, conversation: Conversation, shares: list[ConversationState]
        ) -> Conversation | None:
            # As the single reader takes it (`listed_at`): another member's older entry of it is skipped.
            return listed_at(conversation, shares, micros(place[0]), archived)

        async def read() -> list[Conversation]:
            pages = [_places_of(member, archived) for member in self._members]
            places = _merged(pages, after, _batch(limit), reverse=True)
            return await self._take(places, lambda place: place[1], taken, [], limit)

        return await with_keys(self._keys, read, any_erased)

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

        def taken(_: str, conversation: Conversation, __: list[ConversationState]) -> Conversation | None:
            return conversation if archived in (None, conversation.archived) else None

        async def read() -> list[Conversation]:
            counts = await asyncio.gather(*(member.word_entries(wanted) for member in self._members))
            entries = {word: min(sum(c[i] for c in counts), SEARCH_PROBE) for i, word in enumerate(wanted)}
            first, *others = sorted(wanted, key=entries.__getitem__)
            if entries[first] == 0:  # a word filed nowhere: nothing holds every word
                return []
            pages = [_filed_by(member, first) for member in self._members]
            places = _merged(pages, None if after is None else after[1], _batch(limit), reverse=False)
            return await self._take(places, str, taken, others, limit)

        return await with_keys(self._keys, read, any_erased)

    async def get_conversation(self, conversation_id: str) -> Conversation | None:
        """`ProjectionReader.get_conversation` over the group."""

        async def read() -> Conversation | None:
            [(conversation, _, _)] = await self._conversations([conversation_id], [])
            return conversation

        return await with_keys(self._keys, read, lambda found: found is not None and found.title_erased)

    async def _take(
        self,
        places: AsyncIterator[Place],
        id_of: Callable[[Place], str],
        taken: Callable[[Place, Conversation, list[ConversationState]], Conversation | None],
        words: list[str],
        limit: int | None,
    ) -> list[Conversation]:
        """The conversations at `places` filed under `words`, as `taken` takes each there (None: not).

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
            for place, (conversation, shares, filed) in zip(batch, conversations, strict=True):
                if limit is not None and len(found) >= limit:
                    break
                took = (
                    None
                    if conversation is None or not set(words) <= filed
                    else taken(place, conversation, shares)
                )
                if took is not None:
                    found.append(took)
        return found

    async def _conversations(self, conversation_ids: list[str], words: list[str]) -> list[Found]:
        """Each conversation combined from every member's holdings (`Found`)."""
        answers = await asyncio.gather(*(m.holdings(conversation_ids, words) for m in self._members))
        result = []
        for i, conversation_id in enumerate(conversation_ids):
            holdings = [answer[i] for answer in answers]
            result.append(await self._combined(conversation_id, holdings, words))
        return result

    async def _combined(
        self, conversation_id: str, holdings: list[ConversationHolding], words: list[str]
    ) -> Found:
        for _ in range(_REREADS):
            shares = [share for holding in holdings for share in holding.shares]
            filed = {word for holding in holdings for word in holding.words}
            if not shares:
                return None, shares, filed
            latest = latest_of(shares)
            runs = [h.latest_run for h in holdings if h.latest_run is not None]
            run = next((r for r in runs if r.run_id == latest), None)
            if run is not None:
                return combined(conversation_id, shares, run, self._keys), shares, filed
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


def _places_of(
    member: ConversationMember, archived: bool | None
) -> Callable[[ConversationCursor | None, int], Awaitable[list[ConversationCursor]]]:
    return lambda after, limit: member.places(after, limit, archived)


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
