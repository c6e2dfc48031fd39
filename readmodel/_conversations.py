"""The conversations view: every conversation, newest activity first, paged, from the shards' shares.

A conversation's runs are spread over the shards; each shard keeps its share of it (its runs there
summed, `CONVERSATION_STATE`) and lists the conversations by their newest activity there
(`ACTIVITY`). A listing merges the shards' `ACTIVITY` walks newest first and takes a conversation
where its entry is its newest activity of all (each shard's share read and combined): an older
entry in another shard is skipped, so a page of L conversations reads at most L x shards entries,
however many conversations and runs there are. A listing filtered by `archived` walks only the
range each shard files that way (`ConversationState.filed`), so it costs the same whatever share
is archived. Its last status, and whether it is live, are its latest-started run's, judged now
(decision 0062). A conversation is made from its shares, and placed in a listing, by
`_conversation.py`'s functions, which a group's merge (`GroupConversations`) uses too; the methods
below the listing's are what a group member answers for its own shards.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

from stepstream.errors import StepStreamError
from stepstream.readmodel._conversation import (
    Conversation,
    ConversationCursor,
    ConversationHolding,
    any_erased,
    combined,
    filed_as,
    latest_of,
    listed_at,
    newest_filed,
    with_keys,
)
from stepstream.readmodel._runs import Runs
from stepstream.readmodel._shards import Shards
from stepstream.storage import ACTIVITY, CONVERSATION_STATE, OPEN, WORD, ConversationState, words_of
from stepstream.timestamps import from_micros, micros

if TYPE_CHECKING:
    from stepstream.erasure import KeyRing

MAX_SEARCH_WORDS = 8
"""A search takes the first this many words it is given."""
SEARCH_PROBE = 1_000
"""A search counts each word's entries up to this many, to walk the rarest."""

CONVERSATIONS_INDEX = 7
"""The `RUN_INDEX_VERSION` from which a shard keeps the conversations' shares as this reader reads them."""


class ConversationsNotIndexed(StepStreamError):
    """A shard was made before the conversations' shares: rebuild the projection to list them."""


class Conversations:
    """The shards' `CONVERSATION_STATE` shares and `ACTIVITY` indexes as `Conversation`s."""

    def __init__(self, shards: Shards, runs: Runs, keys: KeyRing | None = None) -> None:
        self._shards = shards
        self._runs = runs
        self._keys = keys

    async def list_conversations(
        self, *, limit: int | None = 50, after: ConversationCursor | None = None, archived: bool | None = None
    ) -> list[Conversation]:
        """`ProjectionReader.list_conversations`."""

        def query() -> list[Conversation]:
            self._require_index()
            return list(itertools.islice(self._newest_first(after, archived), limit))

        return await with_keys(self._keys, lambda: self._shards.query(query), any_erased)

    async def search_conversations(
        self,
        words: str,
        *,
        limit: int | None = 50,
        after: ConversationCursor | None = None,
        archived: bool | None = None,
    ) -> list[Conversation]:
        """`ProjectionReader.search_conversations`."""

        def query() -> list[Conversation]:
            self._require_index()
            found: list[Conversation] = []
            for conversation in self._matching(words_of(words)[:MAX_SEARCH_WORDS], after):
                if limit is not None and len(found) >= limit:
                    break
                if archived in (None, conversation.archived):
                    found.append(conversation)
            return found

        return await with_keys(self._keys, lambda: self._shards.query(query), any_erased)

    def _matching(self, words: list[str], after: ConversationCursor | None) -> Iterator[Conversation]:
        """The conversations filed under every word, by conversation id, from after `after`'s.

        The rarest word's entries are walked (every shard's, merged; rarest as counted up to
        `SEARCH_PROBE` entries each); each conversation there is checked for the others by a seek
        per word and shard. A word filed nowhere ends the search at once.
        """
        if not words:
            return
        first, *others = sorted(words, key=self._entries)
        prefix = WORD.prefix(first)
        start = None if after is None else WORD.prefix(first, after[1]) + b'\xff'
        seen = None if after is None else after[1]
        for k, _ in self._shards.scan(prefix, start=start):
            conversation_id = str(WORD.parse(k)[1])
            if conversation_id == seen:
                continue
            seen = conversation_id
            if all(self._filed(word, conversation_id) for word in others):
                conversation = self.conversation(conversation_id)
                if conversation is not None:
                    yield conversation

    def _entries(self, word: str) -> int:
        """How many entries `word` has in the shards, counted up to `SEARCH_PROBE`."""
        return sum(1 for _ in itertools.islice(self._shards.scan(WORD.prefix(word)), SEARCH_PROBE))

    def _filed(self, word: str, conversation_id: str) -> bool:
        prefix = WORD.prefix(word, conversation_id)
        return any(next(iter(db.scan(prefix)), None) is not None for db in self._shards.all())

    async def get_conversation(self, conversation_id: str) -> Conversation | None:
        """`ProjectionReader.get_conversation`."""

        def query() -> Conversation | None:
            self._require_index()
            return self.conversation(conversation_id)

        def erased(found: Conversation | None) -> bool:
            return found is not None and found.title_erased

        return await with_keys(self._keys, lambda: self._shards.query(query), erased)

    def conversation(self, conversation_id: str) -> Conversation | None:
        """The conversation's shares combined, in the reader's thread; None if no shard has one."""
        shares = self._shares(conversation_id)
        return self._combined(conversation_id, shares) if shares else None

    def _shares(self, conversation_id: str) -> list[ConversationState]:
        key = CONVERSATION_STATE.key(conversation_id)
        return [s for s in (db.get_state(key, ConversationState) for db in self._shards.all()) if s]

    def _combined(self, conversation_id: str, shares: list[ConversationState]) -> Conversation | None:
        run = self._runs.run(latest_of(shares))
        if run is None:  # dropped between the reads: read again
            return self.conversation(conversation_id)
        return combined(conversation_id, shares, run, self._keys)

    def _newest_first(
        self, after: ConversationCursor | None, archived: bool | None
    ) -> Iterator[Conversation]:
        """Each conversation once, from below `after`, where a listing filtered by `archived` takes it.

        At its newest activity; filtered, where its entry is the newest of the shards that file it
        so, when its flag (the newest mark of all shards) agrees (`listed_at`): at its newest
        activity, unless that shard's share has not seen the newest mark (`Conversation.placed`).
        Each one with the flag is filed so in the shard holding its newest mark, so none is missed.
        """
        for active, conversation_id, shares in self._newest(after, archived):
            conversation = self._combined(conversation_id, shares)
            if conversation is not None:
                taken = listed_at(conversation, shares, active, archived)
                if taken is not None:
                    yield taken

    def _newest(
        self, after: ConversationCursor | None, archived: bool | None
    ) -> Iterator[tuple[int, str, list[ConversationState]]]:
        """Each conversation's entry a listing filtered by `archived` may take it at, and its shares.

        Only the `ACTIVITY` ranges that filter asks for are walked (`filed_as`), newest first from
        below `after`, and an entry is given when it is the newest of the shares that file the
        conversation so (`newest_filed`): a page reads about L x shards entries.
        """
        cursor = b'' if after is None else _place(micros(after[0]), after[1])
        previous = cursor
        for place in self._shards.walk(
            [ACTIVITY.prefix(f) for f in filed_as(archived)], cursor, reverse=True
        ):
            if place == previous:  # the cursor itself, or the same entry in another shard
                continue
            previous = place
            _, active, conversation_id = ACTIVITY.parse(ACTIVITY.prefix(OPEN) + place)
            assert isinstance(active, int) and isinstance(conversation_id, str)
            shares = self._shares(conversation_id)
            if newest_filed(shares, archived) == active:
                yield active, conversation_id, shares

    # -- a group member's part (`GroupConversations` merges the members') --------------------------

    async def places(
        self, after: ConversationCursor | None, limit: int, archived: bool | None = None
    ) -> list[ConversationCursor]:
        """Up to `limit` entries a listing filtered by `archived` may take these shards' conversations at.

        Newest first, below `after`: for each, the newest of the shares here that file it so (`_newest`).
        """

        def query() -> list[ConversationCursor]:
            self._require_index()
            walk = self._newest(after, archived)
            return [(from_micros(active), cid) for active, cid, _ in itertools.islice(walk, limit)]

        return await self._shards.query(query)

    async def filed(self, word: str, after: str | None, limit: int) -> list[str]:
        """Up to `limit` conversation ids these shards file under `word`, each once, from after `after`."""

        def query() -> list[str]:
            self._require_index()
            start = None if after is None else WORD.prefix(word, after) + b'\xff'
            found: list[str] = []
            for k, _ in self._shards.scan(WORD.prefix(word), start=start):
                conversation_id = str(WORD.parse(k)[1])
                if conversation_id != after and (not found or found[-1] != conversation_id):
                    if len(found) == limit:
                        break
                    found.append(conversation_id)
            return found

        return await self._shards.query(query)

    async def word_entries(self, words: list[str]) -> list[int]:
        """How many entries each word has in these shards, counted up to `SEARCH_PROBE`."""
        return await self._shards.query(lambda: [self._entries(word) for word in words])

    async def holdings(self, conversation_ids: list[str], words: list[str]) -> list[ConversationHolding]:
        """What these shards hold of each conversation, and which of `words` they file it under."""

        def holding(conversation_id: str) -> ConversationHolding:
            shares = self._shares(conversation_id)
            run = self._runs.run(latest_of(shares)) if shares else None
            if shares and run is None:  # dropped between the reads: read again
                return holding(conversation_id)
            filed = [word for word in words if self._filed(word, conversation_id)]
            return ConversationHolding(conversation_id, shares, run, filed)

        def query() -> list[ConversationHolding]:
            self._require_index()
            return [holding(conversation_id) for conversation_id in conversation_ids]

        return await self._shards.query(query)

    def _require_index(self) -> None:
        if self._runs.index_version() < CONVERSATIONS_INDEX:
            raise ConversationsNotIndexed(
                'a shard of this projection was made before conversations were indexed '
                f'(run index below {CONVERSATIONS_INDEX}): rebuild it (`stepstream rebuild`) to list them'
            )


def _place(active: int, conversation_id: str) -> bytes:
    """The place of an `ACTIVITY` entry: what follows its range's prefix (as `Shards.walk` gives it)."""
    return ACTIVITY.key(OPEN, active, conversation_id)[len(ACTIVITY.prefix(OPEN)) :]
