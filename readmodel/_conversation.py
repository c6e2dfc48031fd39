"""One conversation made from its shards' shares, wherever they were read (decision 0062).

A conversation's runs are spread over the shards, each keeping its share (`ConversationState`).
One reader of every shard (`Conversations`) reads each shard's share; a group's merge
(`GroupConversations`) asks each member for its own shards' (`ConversationHolding`). Both make the
`Conversation` here (`combined`, which opens a sealed title with the asking reader's keys, under
`with_keys`) and both place it in a listing here (`listed_at`), so they cannot disagree.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import Context, Decimal
from typing import TYPE_CHECKING, TypeVar

from stepstream.erasure import SEALED_TITLE, ErasureError, is_sealed_text
from stepstream.errors import BadCursor
from stepstream.readmodel._shards import ts
from stepstream.schemas import RunRecord, RunUsage
from stepstream.storage import ARCHIVED, OPEN, ConversationState
from stepstream.timestamps import micros

if TYPE_CHECKING:
    from stepstream.erasure import KeyRing

T = TypeVar('T')

ConversationCursor = tuple[datetime, str]
"""A place in the list of conversations: the last one seen's `last_activity` (or `placed`) and id."""

_NOWHERE = "after={!r:.80} is not a place in the list of conversations: give a page's `next_after`"
_SUMS = Context(prec=200)


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


@dataclass(frozen=True)
class ConversationHolding:
    """What some shards hold of one conversation: their shares, and what a merge needs besides.

    A group member's answer for its own shards (decision 0062): the readers' merge combines every
    member's holdings as it combines one reader's shards' shares. A sealed title stays sealed in
    it: the member asked opens it with its own keys (`combined`).
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


def combined(
    conversation_id: str, shares: list[ConversationState], latest_run: RunRecord, keys: KeyRing | None
) -> Conversation:
    """A conversation from its shares (not empty), wherever they were read; `latest_run` is `latest_of`'s.

    Sums the runs, usage and cost; the newest activity; the newest title mark, else the earliest
    first prompt; the newest archived mark. Every field is a sum or a max, so the shares' order is
    moot. A sealed title (erasure on) is opened with `keys`, the asking reader's (`open_title`).
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
    title: str | None = max(titles)[1] if titles else min(prompts)[2] if prompts else None
    erased = False
    if title is not None and is_sealed_text(title):
        title = open_title(conversation_id, title, keys)
        erased = title is None and keys is not None
    return Conversation(
        conversation_id=conversation_id,
        runs=sum(share.runs for share in shares),
        last_activity=when,
        latest_run=latest_run,
        usage=RunUsage(**usage, cost_usd=None if cost is None else format(cost, 'f')),
        title=title,
        archived=bool(flags) and max(flags)[1],
        title_erased=erased,
    )


def open_title(conversation_id: str, sealed: str, keys: KeyRing | None) -> str | None:
    """A sealed title's text; None when its key was destroyed, or there are no `keys`.

    A reader without keys reads no title, as it reads no first prompt under erasure.
    """
    if keys is None:
        return None
    key = keys.opening(sealed)
    if key is None:
        return None
    if key.conversation_id != conversation_id:
        raise ErasureError(f"a title of conversation {conversation_id!r} is sealed with another one's key")
    return key.open_text(sealed, SEALED_TITLE)


async def with_keys(keys: KeyRing | None, read: Callable[[], Awaitable[T]], erased: Callable[[T], bool]) -> T:
    """`read()`, its sealed titles opened with `keys` read up to date (None: erasure off).

    A key never seen (`erased(answer)` says some title read as erased) is looked for once more to
    the end of the key topic, and the read made again, as a snapshot's is (`Snapshots._materialize`).
    """
    if keys is not None:
        await keys.refresh()  # a key destroyed a moment ago is gone from here on
    answer = await read()
    if keys is not None and keys.missed and erased(answer):
        keys.missed.clear()
        await keys.refresh(thorough=True)
        answer = await read()
        keys.erased |= keys.missed  # read to the end twice: gone, not late
        keys.missed.clear()
    return answer


def any_erased(found: list[Conversation]) -> bool:
    """Whether a title among `found` reads as erased (`with_keys`)."""
    return any(conversation.title_erased for conversation in found)


def filed_as(archived: bool | None) -> list[str]:
    """The `ACTIVITY` ranges a listing filtered by `archived` walks (None: both)."""
    return [ARCHIVED, OPEN] if archived is None else [ARCHIVED if archived else OPEN]


def newest_filed(shares: list[ConversationState], archived: bool | None) -> int | None:
    """The newest activity of the shares that file the conversation as `archived` asks (None: any).

    A listing takes the conversation at the entry of that activity only; None: no share files it so.
    """
    ranges = filed_as(archived)
    agreeing = [share.active for share in shares if share.filed in ranges]
    return max(agreeing) if agreeing else None


def listed_at(
    conversation: Conversation, shares: list[ConversationState], active: int, archived: bool | None
) -> Conversation | None:
    """The conversation as a listing filtered by `archived` takes it at its entry of `active`; or None.

    None when that entry is not the newest of the shares that file it so (`newest_filed`), or when
    its flag (the newest mark of every share) disagrees. Taken at an older activity than its newest
    (a shard has not seen its newest mark), it is `placed` there, and its cursor follows.
    """
    if newest_filed(shares, archived) != active or archived not in (None, conversation.archived):
        return None
    if micros(conversation.last_activity) != active:
        return replace(conversation, placed=ts(active))
    return conversation


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
