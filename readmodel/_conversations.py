"""The conversations view: every conversation, newest activity first, paged, from the shards' shares.

A conversation's runs are spread over the shards; each shard keeps its share of it (its runs there
summed, `CONVERSATION_STATE`) and lists the conversations by their newest activity there
(`ACTIVITY`). A listing merges the shards' `ACTIVITY` walks newest first and takes a conversation
where its entry is its newest activity of all (each shard's share read and combined): an older
entry in another shard is skipped, so a page of L conversations reads at most L x shards entries,
however many conversations and runs there are. Its last status, and whether it is live, are its
latest-started run's, judged now (decision 0062).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from decimal import Context, Decimal

from stepstream.errors import BadCursor, StepStreamError
from stepstream.readmodel._runs import Runs
from stepstream.readmodel._shards import Shards, ts
from stepstream.schemas import RunRecord, RunUsage
from stepstream.storage import ACTIVITY, CONVERSATION_STATE, WORD, ConversationState, words_of
from stepstream.timestamps import from_micros, micros

MAX_SEARCH_WORDS = 8
"""A search takes the first this many words it is given."""
SEARCH_PROBE = 1_000
"""A search counts each word's entries up to this many, to walk the rarest."""

CONVERSATIONS_INDEX = 6
"""The `RUN_INDEX_VERSION` from which a shard keeps the conversations' shares."""

ConversationCursor = tuple[datetime, str]
"""A place in the list of conversations: the last one seen's `last_activity` and id."""

_NOWHERE = "after={!r:.80} is not a place in the list of conversations: give a page's `next_after`"
_SUMS = Context(prec=200)


class ConversationsNotIndexed(StepStreamError):
    """A shard was made before the conversations' shares: rebuild the projection to list them."""


@dataclass(frozen=True)
class Conversation:
    """A conversation as the runs of it on the log say: how many, their sums, the latest one."""

    conversation_id: str
    runs: int
    """How many of its runs the projection holds."""
    last_activity: datetime
    """The newest record of any of its runs."""
    latest_run: RunRecord
    """Its latest-started run, its status judged now (`last_status`, `live`, `writer`)."""
    usage: RunUsage
    """Its runs' usage and cost summed."""
    title: str | None = None
    """The newest title a `conversation_marked` record gave it, else the first user prompt of its
    earliest run that has one (cut to `MAX_PROMPT_CHARS`); None: neither (no snapshot yet, or
    sealed content)."""
    archived: bool = False
    """Whether the newest archived flag a `conversation_marked` record gave it is `true`."""

    @property
    def last_status(self) -> str:
        """The latest run's status, judged now (`running`, `stale`, `completed`, ...)."""
        return self.latest_run.status

    @property
    def live(self) -> bool:
        """Whether its latest run reads `running` now: its writer is still at it."""
        return self.latest_run.status == 'running'

    @property
    def writer(self) -> str | None:
        """The writer that owns its latest run (`RunRecord.registration_id`)."""
        return self.latest_run.registration_id

    @property
    def cursor(self) -> ConversationCursor:
        """Where the next page starts (`after`)."""
        return (self.last_activity, self.conversation_id)

    @property
    def cursor_text(self) -> str:
        """`cursor` as the opaque text a page's `next_after` gives (`encode_conversation_cursor`)."""
        return encode_conversation_cursor(self.cursor)


@dataclass(frozen=True)
class ConversationHolding:
    """What some shards hold of one conversation: their shares, and what a merge needs besides.

    A group member's answer for its own shards (decision 0062): the readers' merge combines every
    member's holdings as it combines one reader's shards' shares.
    """

    conversation_id: str
    shares: list[ConversationState]
    """Each shard's share, for the shards that have one."""
    latest_run: RunRecord | None
    """The latest-started run of these shares (`latest_of`), its status judged now; None: no share."""
    words: list[str]
    """Those of the words asked about that these shards file the conversation under."""


def latest_of(shares: list[ConversationState]) -> str:
    """The run id of the latest-started run of a conversation's shares (the greatest [started_at, run_id])."""
    return str(max(share.latest for share in shares)[1])


def combined(conversation_id: str, shares: list[ConversationState], latest_run: RunRecord) -> Conversation:
    """A conversation from its shares (not empty), wherever they were read; `latest_run` is `latest_of`'s.

    Sums the runs, usage and cost; the newest activity; the newest title mark, else the earliest
    first prompt; the newest archived mark. Every field is a sum or a max, so the shares' order is moot.
    """
    usage: dict[str, int] = {}
    cost: Decimal | None = None
    for share in shares:
        for name, value in share.usage.items():
            usage[name] = usage.get(name, 0) + value
        if share.cost_usd is not None:
            cost = _SUMS.add(cost or Decimal(0), Decimal(share.cost_usd))
    prompts = [share.prompt for share in shares if share.prompt]
    titles = [share.title for share in shares if share.title]
    flags = [share.archived for share in shares if share.archived]
    when = ts(max(share.active for share in shares))
    assert when is not None
    return Conversation(
        conversation_id=conversation_id,
        runs=sum(share.runs for share in shares),
        last_activity=when,
        latest_run=latest_run,
        usage=RunUsage(**usage, cost_usd=None if cost is None else format(cost, 'f')),
        title=max(titles)[1] if titles else min(prompts)[2] if prompts else None,
        archived=bool(flags) and max(flags)[1],
    )


def encode_conversation_cursor(cursor: ConversationCursor) -> str:
    """A `ConversationCursor` as URL-safe opaque text, for the API, the explorer and the CLI."""
    raw = json.dumps([cursor[0].isoformat(), cursor[1]], separators=(',', ':')).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip('=')


def decode_conversation_cursor(text: str) -> ConversationCursor:
    """The cursor a text of `encode_conversation_cursor` names; `BadCursor` (a `NotFound`) for others."""
    try:
        when, conversation_id = json.loads(base64.urlsafe_b64decode(text + '=' * (-len(text) % 4)))
        at = datetime.fromisoformat(when)
    except (ValueError, TypeError, binascii.Error):
        raise BadCursor(_NOWHERE.format(text)) from None
    if at.tzinfo is None or not isinstance(conversation_id, str):
        raise BadCursor(_NOWHERE.format(text))
    return (at, conversation_id)


class Conversations:
    """The shards' `CONVERSATION_STATE` shares and `ACTIVITY` indexes as `Conversation`s."""

    def __init__(self, shards: Shards, runs: Runs) -> None:
        self._shards = shards
        self._runs = runs

    async def list_conversations(
        self, *, limit: int | None = 50, after: ConversationCursor | None = None, archived: bool | None = None
    ) -> list[Conversation]:
        """`ProjectionReader.list_conversations`."""

        def query() -> list[Conversation]:
            self._require_index()
            found: list[Conversation] = []
            for conversation in self._newest_first(after):
                if limit is not None and len(found) >= limit:
                    break
                if archived in (None, conversation.archived):
                    found.append(conversation)
            return found

        return await self._shards.query(query)

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

        return await self._shards.query(query)

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

        return await self._shards.query(query)

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
        return combined(conversation_id, shares, run)

    def _newest_first(self, after: ConversationCursor | None) -> Iterator[Conversation]:
        """Each conversation once, at its newest activity, from below `after`."""
        for active, conversation_id, shares in self._newest(after):
            conversation = self._combined(conversation_id, shares)
            if conversation is not None and micros(conversation.last_activity) == active:
                yield conversation

    def _newest(self, after: ConversationCursor | None) -> Iterator[tuple[int, str, list[ConversationState]]]:
        """Each conversation's place at its newest activity, and its shares, from below `after`."""
        cursor = b''
        if after is not None:
            cursor = ACTIVITY.key(micros(after[0]), after[1])[1:]
        previous = cursor
        for place in self._shards.walk([ACTIVITY.prefix()], cursor, reverse=True):
            if place == previous:  # the cursor itself, or the same entry in another shard
                continue
            previous = place
            active, conversation_id = ACTIVITY.parse(ACTIVITY.tag + place)
            assert isinstance(active, int) and isinstance(conversation_id, str)
            shares = self._shares(conversation_id)
            if shares and max(share.active for share in shares) == active:
                yield active, conversation_id, shares

    # -- a group member's part (`GroupConversations` merges the members') --------------------------

    async def places(self, after: ConversationCursor | None, limit: int) -> list[ConversationCursor]:
        """Up to `limit` of these shards' conversations at their newest activity here, newest first."""

        def query() -> list[ConversationCursor]:
            self._require_index()
            walk = self._newest(after)
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
