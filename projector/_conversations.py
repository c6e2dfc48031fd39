"""A conversation's share in each shard: its runs here summed, and its place by newest activity.

Runs are keyed by run id, so one conversation's runs are spread over the shards. Each shard keeps
its share of every conversation that has runs in it (`CONVERSATION_STATE`: how many, their usage
and cost summed, the newest activity, the latest-started run) and lists the conversations by
that newest activity (`ACTIVITY`), the ones its newest archived mark archived apart (`filed`);
the reader combines the shares (decision 0062).

A share changes where the run's listing does: at the end of the batch, from what the run
contributed before the batch and what it contributes now (`refile_conversation`, called by
`_listing.relist_run`), and when retention drops a run (`unfile_conversation`). Every field is a
sum or a max over the shard's runs of the conversation, so the share is a function of those runs'
states, whatever the batch cuts (tests/test_conversations.py).
"""

from __future__ import annotations

import json
from decimal import Context, Decimal
from typing import Any

from stepstream.erasure import is_sealed_text
from stepstream.projector._batch import Rejected
from stepstream.schemas import ARCHIVED_KEY, TITLE_KEY, Fields
from stepstream.storage import (
    ACTIVITY,
    CONVERSATION,
    CONVERSATION_STATE,
    MAX_PROMPT_CHARS,
    MAX_RUN_WORDS,
    RUN,
    WORD,
    ConversationState,
    RunState,
    Transaction,
    words_of,
)

Share = tuple[int, dict[str, int], str | None, str | None, dict[str, list[Any]], tuple[str, ...]]
"""What one run adds to its conversation's share: its newest record's time, its usage, its cost,
its first prompt, the marks keyed by it and the words of its prompts."""

MARKED = ('title', 'archived')
"""What a `conversation_marked` record sets (`RunState.marks`, `ConversationState`'s fields)."""

_SUMS = Context(prec=200)
"""Exact for every sum of checked costs (`_usage._SUMS`)."""


def _words(share: Share) -> set[str]:
    """The words a run files its conversation under: of its user prompts and of its title mark.

    A sealed title (erasure on) files it under none: its words would be plaintext `forget` cannot erase.
    """
    title = (share[4].get('title') or [0, None])[1]
    return {*share[5], *([] if is_sealed_text(title) else words_of(title))}


def _refile_words(txn: Transaction, run: RunState, old: set[str], new: set[str]) -> None:
    conversation_id = run.conversation_id
    assert conversation_id is not None
    for word in old - new:
        txn.delete(WORD.key(word, conversation_id, run.run_id))
    for word in new - old:
        txn.put(WORD.key(word, conversation_id, run.run_id), b'')


def share_of(run: RunState) -> Share:
    """What the run adds to its conversation's share now (its usage copied: the run changes)."""
    return (
        max(run.started_at, run.last_record_at),
        dict(run.usage),
        run.cost_usd,
        run.first_prompt,
        dict(run.marks),
        tuple(run.prompt_words),
    )


def note_prompts(run: RunState, snapshot_seq: int, messages: str) -> None:
    """Keep what a snapshot's user prompts give its run: its first prompt (snapshot 0), their words.

    The words join `RunState.prompt_words` (each once, up to `MAX_RUN_WORDS` for the run), in the
    order the run's snapshots are applied: its partition's order, the same in every pass. A tail
    without a user prompt (most after the first) is not parsed.
    """
    if '"user-prompt"' not in messages:
        return
    prompts = user_prompts(messages)
    if snapshot_seq == 0 and prompts:
        run.first_prompt = prompts[0][:MAX_PROMPT_CHARS]
    if len(run.prompt_words) >= MAX_RUN_WORDS:
        return
    words = dict.fromkeys(run.prompt_words)
    for prompt in prompts:
        for word in words_of(prompt, MAX_RUN_WORDS):
            words.setdefault(word)
    # A new list: the share taken before the batch keeps its own.
    run.prompt_words = list(words)[:MAX_RUN_WORDS]


def first_prompt(messages: str) -> str | None:
    """The text of the first user prompt among a snapshot's messages (JSON, as the log holds them).

    Cut to `MAX_PROMPT_CHARS`, its whitespace folded; None when there is none, or when the messages
    do not read as plain messages (sealed content, with erasure on, reads as none).
    """
    prompts = user_prompts(messages)
    return prompts[0][:MAX_PROMPT_CHARS] if prompts else None


def user_prompts(messages: str) -> list[str]:
    """The text of every user prompt among a snapshot's messages, in order, whitespace folded.

    None of them when the messages do not read as plain messages (sealed content reads as none).
    """
    found: list[str] = []
    try:
        loaded = json.loads(messages)
    except ValueError:
        return found
    for message in loaded if isinstance(loaded, list) else ():
        if not isinstance(message, dict) or message.get('kind') != 'request':
            continue
        for part in message.get('parts') or ():
            if isinstance(part, dict) and part.get('part_kind') == 'user-prompt':
                content = part.get('content')
                items = (
                    [content] if isinstance(content, str) else content if isinstance(content, list) else []
                )
                text = ' '.join(' '.join(item for item in items if isinstance(item, str)).split())
                if text:
                    found.append(text)
    return found


def refile_conversation(txn: Transaction, run: RunState, was: Share | None) -> None:
    """Bring the run's conversation's share up to date with the run.

    `was` is the run's share before the batch (None: registered in this batch).
    """
    conversation_id = run.conversation_id
    assert conversation_id is not None
    now = share_of(run)
    if now == was:
        return
    if was is None or (was[4].get('title'), was[5]) != (now[4].get('title'), now[5]):
        _refile_words(txn, run, set() if was is None else _words(was), _words(now))
    key = CONVERSATION_STATE.key(conversation_id)
    state = txn.get_state(key, ConversationState) or ConversationState(conversation_id)
    before = (state.filed, state.active) if state.runs else None
    place = [run.started_at, run.run_id]
    if was is None:
        state.runs += 1
        if not state.latest or place > state.latest:
            state.latest = place
    else:
        _add(state, was, -1)
    if run.first_prompt is not None and (not state.prompt or place < state.prompt[:2]):
        state.prompt = [*place, run.first_prompt]
    _add(state, now, 1)
    state.active = max(state.active, now[0])
    for name in MARKED:  # a run's marks only grow newer: the share's is the newest of its runs'
        mark = run.marks.get(name)
        if mark is not None and mark > (getattr(state, name) or [-1]):
            setattr(state, name, mark)
    _refile_activity(txn, state, before)
    txn.put_state(key, state)


def apply_marked(run: RunState, mark: Fields) -> bool:
    """A `conversation_marked` record keyed by `run`: its title and archived flag join the run's marks.

    The newest of each by the record's time stands, the greater value on a tie, so the order
    marks arrive in is moot; False when the run holds the same already (the mark again, or an
    older one). The share takes them at the batch's end (`refile_conversation`), and gives them
    up when the run is dropped, as the run's other records. `Rejected` (`invalid`) for a mark of
    another conversation than the run's.
    """
    if mark['conversation_id'] != run.conversation_id:
        raise Rejected(
            'invalid',
            f'a mark of conversation {mark["conversation_id"]!r} keyed by run {run.run_id!r}, '
            f'which is of conversation {run.conversation_id!r}',
        )
    at, metadata, changed = mark['timestamp'], mark['metadata'], False
    given = {'title': metadata.get(TITLE_KEY), 'archived': metadata.get(ARCHIVED_KEY)}
    for name, value in given.items():
        if value is None:
            continue
        new = [at, value == 'true' if name == 'archived' else value]
        if new > run.marks.get(name, [-1]):
            run.marks = {**run.marks, name: new}  # a new dict: the share taken before the batch keeps its own
            changed = True
    return changed


def unfile_conversation(txn: Transaction, run: RunState) -> None:
    """Take a dropped run out of its conversation's share (after its `CONVERSATION` entry is gone)."""
    conversation_id = run.conversation_id
    assert conversation_id is not None
    _refile_words(txn, run, _words(share_of(run)), set())
    key = CONVERSATION_STATE.key(conversation_id)
    state = txn.get_state(key, ConversationState)
    assert state is not None, f'run {run.run_id!r} has no share in conversation {conversation_id!r}'
    before = (state.filed, state.active)
    state.runs -= 1
    if not state.runs:
        txn.delete(ACTIVITY.key(*before, conversation_id))
        txn.delete(key)
        return
    dropped = share_of(run)
    _add(state, dropped, -1)
    place = [run.started_at, run.run_id]
    marked = any(run.marks.get(name) == getattr(state, name) for name in MARKED if getattr(state, name))
    if marked or dropped[0] >= state.active or place in (state.latest, state.prompt[:2]):
        # The newest, latest, first prompted or marked run left: the next is found among the runs
        # that stay (rare: a dropped run ended long ago).
        state.active, state.latest, state.prompt, state.title, state.archived = 0, [], [], [], []
        for k, _ in txn.scan(CONVERSATION.prefix(conversation_id)):
            _, started, run_id = CONVERSATION.parse(k)
            other = txn.get_state(RUN.key(str(run_id)), RunState)
            assert other is not None
            state.active = max(state.active, share_of(other)[0])
            state.latest = [started, run_id]
            if other.first_prompt is not None and not state.prompt:
                state.prompt = [started, run_id, other.first_prompt]
            for name in MARKED:
                mark = other.marks.get(name)
                if mark is not None and mark > (getattr(state, name) or [-1]):
                    setattr(state, name, mark)
    _refile_activity(txn, state, before)
    txn.put_state(key, state)


def _refile_activity(txn: Transaction, state: ConversationState, before: tuple[str, int] | None) -> None:
    """Move the conversation's `ACTIVITY` entry to where the share files it now.

    `before` is where it was filed ((filed, newest activity); None: it had no entry).
    """
    now = (state.filed, state.active)
    if before == now:
        return
    if before is not None:
        txn.delete(ACTIVITY.key(*before, state.conversation_id))
    txn.put(ACTIVITY.key(*now, state.conversation_id), b'')


def _add(state: ConversationState, share: Share, sign: int) -> None:
    """Add (`sign` 1) or take out (-1) a run's usage and cost; zero sums leave no entry."""
    _, usage, cost, _, _, _ = share
    sums = state.usage
    for name, value in usage.items():
        total = sums.get(name, 0) + sign * value
        if total:
            sums[name] = total
        else:
            sums.pop(name, None)
    if cost is None:
        return
    state.priced += sign
    if not state.priced:
        state.cost_usd = None
        return
    summed = _SUMS.add(Decimal(state.cost_usd or 0), _SUMS.multiply(Decimal(sign), Decimal(cost)))
    state.cost_usd = format(_SUMS.normalize(summed), 'f')
