"""The waiting view: every deferred call that waits for a decision, across runs.

A deferred call (`requires_approval`, `ApprovalRequired`, `CallDeferred`) waits until someone
decides it: a decision on the log (`stepstream approve`, `deny`, `complete`, or the API) answers its
`deferred` transition, and the first one decides (decision 0056). The projector keeps the calls that
wait in the `WAITING` index (waiting since, run, call), in every shard, and by kind, by agent and by
conversation (each filed by kind too): a page of any listing, filtered or not, reads about its own
keys, however many calls wait and however few match (decision 0056).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
from dataclasses import dataclass
from datetime import datetime
from typing import TypedDict

from stepstream.errors import BadCursor
from stepstream.readmodel._effects import Effects
from stepstream.readmodel._runs import Runs
from stepstream.readmodel._shards import Shards
from stepstream.schemas import DEFERRALS, Deferral, ToolEffectRecord
from stepstream.storage import WAITING, WAITING_AGENT, WAITING_CONVERSATION, WAITING_KIND
from stepstream.timestamps import micros

WaitingCursor = tuple[datetime, str, str]
"""A place in the list of waiting calls: the last call seen's `waiting_since`, run and call id."""

_NOWHERE = "after={!r:.80} is not a place in the list of waiting calls: give a page's `next_after`"


def encode_waiting_cursor(cursor: WaitingCursor) -> str:
    """A `WaitingCursor` as the opaque text the API, the explorer and the CLI page with (URL-safe)."""
    since, run_id, call = cursor
    raw = json.dumps([since.isoformat(), run_id, call], separators=(',', ':')).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip('=')


def decode_waiting_cursor(text: str) -> WaitingCursor:
    """The `WaitingCursor` a text of `encode_waiting_cursor` names; `BadCursor` (a `NotFound`) for others.

    Not found, as a run a runs page's `after` names that does not exist.
    """
    try:
        since, run_id, call = json.loads(base64.urlsafe_b64decode(text + '=' * (-len(text) % 4)))
        when = datetime.fromisoformat(since)
    except (ValueError, TypeError, binascii.Error):
        raise BadCursor(_NOWHERE.format(text)) from None
    if when.tzinfo is None or not isinstance(run_id, str) or not isinstance(call, str):
        raise BadCursor(_NOWHERE.format(text))
    return (when, run_id, call)


class WaitingQuery(TypedDict, total=False):
    """What `list_waiting` takes: the order, a page, and filters."""

    newest_first: bool
    limit: int | None
    after: WaitingCursor | None
    agent_name: str | None
    conversation_id: str | None
    deferral: Deferral | None


@dataclass(frozen=True)
class WaitingCall:
    """A deferred call that waits for a decision, with what a person deciding it needs to know."""

    effect: ToolEffectRecord
    """The call: tool, `args` (redacted as stored), `deferral` (what it waits for), its metadata."""
    agent_name: str | None
    conversation_id: str | None
    waiting_since: datetime
    """When the call was deferred (its `deferred` transition's time)."""

    @property
    def cursor(self) -> WaitingCursor:
        """Where the next page starts (`after`)."""
        return (self.waiting_since, self.effect.run_id, self.effect.tool_call_id)

    @property
    def cursor_text(self) -> str:
        """`cursor` as the text a page's `next_after` (or `stepstream deferred --after`) gives."""
        return encode_waiting_cursor(self.cursor)


class Waiting:
    """The `WAITING` index as `WaitingCall`s."""

    def __init__(self, shards: Shards, effects: Effects, runs: Runs) -> None:
        self._shards = shards
        self._effects = effects
        self._runs = runs

    async def list_waiting(
        self,
        *,
        newest_first: bool = False,
        limit: int | None = None,
        after: WaitingCursor | None = None,
        agent_name: str | None = None,
        conversation_id: str | None = None,
        deferral: Deferral | None = None,
    ) -> list[WaitingCall]:
        """`ProjectionReader.list_waiting`."""

        def query() -> list[WaitingCall]:
            cursor = b'' if after is None else WAITING.key(micros(after[0]), after[1], after[2])[1:]
            prefixes = self._ranges(agent_name, conversation_id, deferral)
            places = self._shards.walk(prefixes, cursor, reverse=newest_first)
            keys = (WAITING.tag + place for place in places if place != cursor)
            found = (self._call(k, agent_name, conversation_id, deferral) for k in keys)
            return list(itertools.islice((c for c in found if c is not None), limit))

        return await self._effects.read(query)

    def _ranges(
        self, agent_name: str | None, conversation_id: str | None, deferral: str | None
    ) -> list[bytes]:
        """The index ranges a listing walks, merged by their common (since, run, call) ending.

        A conversation's calls (one range per kind, or the kind's), else an agent's, else a kind's,
        else every call: each call read is checked against every filter, so with both a
        conversation and an agent the walk is bounded by the conversation's waiting calls. Shards
        made before these indexes (`RUN_INDEX_VERSION` below 5) are walked whole and filtered.
        """
        if (agent_name, conversation_id, deferral) == (None, None, None) or self._runs.index_version() < 5:
            return [WAITING.prefix()]
        kinds = sorted(DEFERRALS) if deferral is None else [deferral]
        if conversation_id is not None:
            return [WAITING_CONVERSATION.prefix(conversation_id, kind) for kind in kinds]
        if agent_name is not None:
            return [WAITING_AGENT.prefix(agent_name, kind) for kind in kinds]
        return [WAITING_KIND.prefix(*kinds)]

    def _call(
        self, key: bytes, agent_name: str | None, conversation_id: str | None, deferral: str | None
    ) -> WaitingCall | None:
        since, run_id, call = WAITING.parse(key)
        assert isinstance(since, int) and isinstance(run_id, str) and isinstance(call, str)
        effect = self._effects.effect(run_id, call, live=False)
        if effect is None or (deferral is not None and effect.deferral != deferral):
            return None
        run = self._runs.run(run_id)
        if run is None or agent_name not in (None, run.agent_name):
            return None
        if conversation_id not in (None, run.conversation_id):
            return None
        assert effect.ended_at is not None
        return WaitingCall(effect, run.agent_name, run.conversation_id, effect.ended_at)
