"""The conversations view: every conversation, newest activity first, paged, from the shards' shares.

A conversation's runs are spread over the shards; each shard keeps its share of it (its runs there
summed, `CONVERSATION_STATE`) and lists the conversations by their newest activity there
(`ACTIVITY`). A listing merges the shards' `ACTIVITY` walks newest first and takes a conversation
where its entry is its newest activity of all (each shard's share read and combined): an older
entry in another shard is skipped, so a page of L conversations reads at most L x shards entries,
however many conversations and runs there are. A listing filtered by `archived` walks only the
range each shard files that way (`ConversationState.filed`), so it costs the same whatever share
is archived. Its last status, and whether it is live, are its latest-started run's, judged now
(decision 0062).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import Context, Decimal
from typing import TYPE_CHECKING, TypeVar

from stepstream.erasure import SEALED_TITLE, ErasureError, is_sealed_text, split_sealed_text
from stepstream.errors import NotFound, StepStreamError
from stepstream.readmodel._runs import Runs
from stepstream.readmodel._shards import Shards, ts
from stepstream.schemas import RunRecord, RunUsage
from stepstream.storage import ACTIVITY, ARCHIVED, CONVERSATION_STATE, OPEN, WORD, ConversationState, words_of
from stepstream.timestamps import micros

if TYPE_CHECKING:
    from stepstream.erasure import KeyRing

T = TypeVar('T')

MAX_SEARCH_WORDS = 8
"""A search takes the first this many words it is given."""
SEARCH_PROBE = 1_000
"""A search counts each word's entries up to this many, to walk the rarest."""

CONVERSATIONS_INDEX = 7
"""The `RUN_INDEX_VERSION` from which a shard keeps the conversations' shares as this reader reads them."""

ConversationCursor = tuple[datetime, str]
"""A place in the list of conversations: the last one seen's `last_activity` and id."""

_NOWHERE = "{!r:.80} is not a place in the list of conversations: give a page's `next_after`"
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
    title_erased: bool = False
    """Its newest title was sealed (erasure on) and its key destroyed (`stepstream forget`): `title`
    is None, as erased content reads."""
    placed: datetime | None = field(default=None, compare=False)
    """Where a listing filtered by `archived` placed it when not at `last_activity`: at the newest
    activity of the shards that file it that way (its newest mark is in another shard than its
    newest activity; decision 0062). None: at `last_activity`."""

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
        return (self.placed or self.last_activity, self.conversation_id)

    @property
    def cursor_text(self) -> str:
        """`cursor` as the opaque text a page's `next_after` gives (`encode_conversation_cursor`)."""
        return encode_conversation_cursor(self.cursor)


def encode_conversation_cursor(cursor: ConversationCursor) -> str:
    """A `ConversationCursor` as URL-safe opaque text, for the API, the explorer and the CLI."""
    raw = json.dumps([cursor[0].isoformat(), cursor[1]], separators=(',', ':')).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip('=')


def decode_conversation_cursor(text: str) -> ConversationCursor:
    """The cursor a text of `encode_conversation_cursor` names; `NotFound` for any other text."""
    try:
        when, conversation_id = json.loads(base64.urlsafe_b64decode(text + '=' * (-len(text) % 4)))
        at = datetime.fromisoformat(when)
    except (ValueError, TypeError, binascii.Error):
        raise NotFound(_NOWHERE.format(text)) from None
    if at.tzinfo is None or not isinstance(conversation_id, str):
        raise NotFound(_NOWHERE.format(text))
    return (at, conversation_id)


class Conversations:
    """The shards' `CONVERSATION_STATE` shares and `ACTIVITY` indexes as `Conversation`s."""

    def __init__(self, shards: Shards, runs: Runs, keys: KeyRing | None = None) -> None:
        self._shards = shards
        self._runs = runs
        self._keys = keys

    async def _read(self, fn: Callable[[], T], erased: Callable[[T], bool]) -> T:
        """`fn` in a query thread, its sealed titles opened with the reader's keys (read up to date).

        A key never seen (`erased(answer)` says some title read as erased) is looked for once more
        to the end of the key topic, as a snapshot's is (`Snapshots._materialize`).
        """
        keys = self._keys
        if keys is not None:
            await keys.refresh()  # a key destroyed a moment ago is gone from here on
        answer = await self._shards.query(fn)
        if keys is not None and keys.missed and erased(answer):
            keys.missed.clear()
            await keys.refresh(thorough=True)
            answer = await self._shards.query(fn)
            keys.erased |= keys.missed  # read to the end twice: gone, not late
            keys.missed.clear()
        return answer

    async def list_conversations(
        self, *, limit: int | None = 50, after: ConversationCursor | None = None, archived: bool | None = None
    ) -> list[Conversation]:
        """`ProjectionReader.list_conversations`."""

        def query() -> list[Conversation]:
            self._require_index()
            found: list[Conversation] = []
            for conversation in self._newest_first(after, archived):
                if limit is not None and len(found) >= limit:
                    break
                found.append(conversation)
            return found

        return await self._read(query, _any_erased)

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

        return await self._read(query, _any_erased)

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

        return await self._read(query, lambda found: found is not None and found.title_erased)

    def _shares(self, conversation_id: str) -> list[ConversationState]:
        key = CONVERSATION_STATE.key(conversation_id)
        return [s for s in (db.get_state(key, ConversationState) for db in self._shards.all()) if s]

    def conversation(self, conversation_id: str) -> Conversation | None:
        """The conversation's shares combined, in the reader's thread; None if no shard has one."""
        return self._combined(conversation_id, self._shares(conversation_id))

    def _combined(self, conversation_id: str, shares: list[ConversationState]) -> Conversation | None:
        if not shares:
            return None
        usage: dict[str, int] = {}
        cost: Decimal | None = None
        for share in shares:
            for name, value in share.usage.items():
                usage[name] = usage.get(name, 0) + value
            if share.cost_usd is not None:
                cost = _SUMS.add(cost or Decimal(0), Decimal(share.cost_usd))
        latest_run_id = max(share.latest for share in shares)[1]
        run = self._runs.run(latest_run_id)
        if run is None:  # dropped between the reads: read again
            return self.conversation(conversation_id)
        prompts = [share.prompt for share in shares if share.prompt]
        titles = [share.title for share in shares if share.title]
        flags = [share.archived for share in shares if share.archived]
        active = max(share.active for share in shares)
        when = ts(active)
        assert when is not None
        title: str | None = max(titles)[1] if titles else min(prompts)[2] if prompts else None
        erased = False
        if title is not None and is_sealed_text(title):
            title = self._open_title(conversation_id, title)
            erased = title is None and self._keys is not None
        return Conversation(
            conversation_id=conversation_id,
            runs=sum(share.runs for share in shares),
            last_activity=when,
            latest_run=run,
            usage=RunUsage(**usage, cost_usd=None if cost is None else format(cost, 'f')),
            title=title,
            archived=bool(flags) and max(flags)[1],
            title_erased=erased,
        )

    def _open_title(self, conversation_id: str, sealed: str) -> str | None:
        """A sealed title's text; None when its key was destroyed, or this reader has no keys.

        A reader without keys reads no title, as it reads no first prompt under erasure.
        """
        if self._keys is None:
            return None
        key_id, _ = split_sealed_text(sealed)
        key = self._keys.get(key_id)
        if key is None:
            if key_id in self._keys.unreadable:
                raise ErasureError(self._keys.unreadable[key_id])
            return None
        if key.conversation_id != conversation_id:
            raise ErasureError(
                f"a title of conversation {conversation_id!r} is sealed with another one's key"
            )
        return key.open_text(sealed, SEALED_TITLE)

    def _newest_first(
        self, after: ConversationCursor | None, archived: bool | None
    ) -> Iterator[Conversation]:
        """Each conversation once, from below `after`: at its newest activity, or filtered by `archived`.

        Filtered, only the range each shard files that way is walked, and a conversation is taken
        where its entry is the newest of the shards that file it so, when its flag (the newest
        mark of all shards) agrees: at its newest activity, unless that shard's share has not seen
        the newest mark (`Conversation.placed`). Each one with the flag is filed so in the shard
        holding its newest mark, so none is missed, and a page reads about L x shards entries.
        """
        filed = [ARCHIVED, OPEN] if archived is None else [ARCHIVED if archived else OPEN]
        cursor = b'' if after is None else _place(micros(after[0]), after[1])
        previous = cursor
        for place in self._shards.walk([ACTIVITY.prefix(f) for f in filed], cursor, reverse=True):
            if place == previous:  # the cursor itself, or the same entry in another shard
                continue
            previous = place
            _, active, conversation_id = ACTIVITY.parse(ACTIVITY.prefix(OPEN) + place)
            assert isinstance(conversation_id, str)
            shares = self._shares(conversation_id)
            agreeing = [s.active for s in shares if archived is None or s.filed == filed[0]]
            if not agreeing or max(agreeing) != active:
                continue
            conversation = self._combined(conversation_id, shares)
            if conversation is None or archived not in (None, conversation.archived):
                continue
            if micros(conversation.last_activity) != active:
                conversation = replace(conversation, placed=ts(active))
            yield conversation

    def _require_index(self) -> None:
        if self._runs.index_version() < CONVERSATIONS_INDEX:
            raise ConversationsNotIndexed(
                'a shard of this projection was made before conversations were indexed '
                f'(run index below {CONVERSATIONS_INDEX}): rebuild it (`stepstream rebuild`) to list them'
            )


def _place(active: int, conversation_id: str) -> bytes:
    """The place of an `ACTIVITY` entry: what follows its range's prefix (as `Shards.walk` gives it)."""
    return ACTIVITY.key(OPEN, active, conversation_id)[len(ACTIVITY.prefix(OPEN)) :]


def _any_erased(found: list[Conversation]) -> bool:
    return any(conversation.title_erased for conversation in found)
