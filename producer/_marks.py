"""A conversation's title or archived flag: a `conversation_marked` record on the log (decision 0062).

Like a resumption mark (decision 0057) it is beside a run's trail: keyed by a run of the
conversation (its latest, as `stepstream conversation` picks it), it takes no `seq` and is not
chained, and any writer may append it. The projector keeps the newest title and the newest flag by
the record's time in that run's shard's share of the conversation; the reader takes the newest of
every shard. With erasure on, `mark_conversation` seals the title with the conversation's key, as
a snapshot's content is (decision 0033): `stepstream forget` makes it unreadable.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from stepstream.erasure import SEALED_TITLE
from stepstream.producer._protocol import StepLog
from stepstream.producer._redaction import Redaction
from stepstream.producer._resolution import resolver_id
from stepstream.schemas import ARCHIVED_KEY, MAX_TITLE_CHARS, TITLE_KEY, StepEvent

if TYPE_CHECKING:
    from stepstream.erasure import ConversationKey


def conversation_mark(
    *,
    run_id: str,
    conversation_id: str,
    title: str | None = None,
    archived: bool | None = None,
    writer_id: str | None = None,
    redaction: Redaction | None = None,
    key: ConversationKey | None = None,
) -> StepEvent:
    """The record that titles or archives `conversation_id`, keyed by `run_id`, one of its runs.

    The title is redacted with `redaction` (the default policy when None) before it reaches the log,
    as a resolution's note is, then sealed with `key` (one of the conversation's, erasure on).
    `ValueError` without a title or a flag, or for a title that is empty or longer than
    `MAX_TITLE_CHARS` characters (the projector would refuse it).
    """
    if title is None and archived is None:
        raise ValueError('give a title, an archived flag, or both')
    metadata = {}
    if title is not None:
        title = ' '.join(str((redaction if redaction is not None else Redaction()).text(title)).split())
        if not 0 < len(title) <= MAX_TITLE_CHARS:
            raise ValueError(f'a title has 1 to {MAX_TITLE_CHARS} characters, got {len(title)}')
        if key is not None:
            if key.conversation_id != conversation_id:
                raise ValueError(f'a key of conversation {key.conversation_id!r}, not {conversation_id!r}')
            title = key.seal_text(title, SEALED_TITLE)
        metadata[TITLE_KEY] = title
    if archived is not None:
        metadata[ARCHIVED_KEY] = 'true' if archived else 'false'
    return StepEvent(
        run_id=run_id,
        seq=0,
        writer_id=writer_id or resolver_id('conversations'),
        timestamp=datetime.now(UTC),
        kind='conversation_marked',
        agent_name=None,
        conversation_id=conversation_id,
        metadata=metadata,
    )


async def mark_conversation(log: StepLog, **mark: str | bool | None) -> StepEvent:
    """Append `conversation_mark(**mark)` and wait for the broker's acknowledgement; return it.

    With erasure on (the log has a sealer), the title is sealed with the conversation's key, made
    and acknowledged on the key topic first if this process has none.
    """
    key = None
    if log.sealer is not None and mark.get('title') is not None:
        key = await log.sealer.key_for(str(mark['conversation_id']))
    record = conversation_mark(**mark, key=key)  # type: ignore[arg-type]
    await log.wait_acked([await log.append(record)])
    return record
