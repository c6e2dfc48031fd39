"""The tool effects view: each call's merged ledger record, and the calls that have not ended.

An unended call reads `in_flight` while its run is live (it may still finish) and
`unknown_after_crash` once the run is stale, failed or cancelled: judged at read time, from the
runs view's judgement of its run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar

from stepstream.readmodel._conversation import with_keys
from stepstream.readmodel._runs import Runs
from stepstream.readmodel._sealed_calls import any_content_erased, open_effect
from stepstream.readmodel._shards import Shards, carry, ts
from stepstream.schemas import EffectResolution, ToolEffectRecord
from stepstream.storage import EFFECT, UNRESOLVED, UNRESOLVED_RUN, EffectState
from stepstream.timestamps import EPOCH, from_micros, micros

if TYPE_CHECKING:
    from stepstream.erasure import KeyRing

T = TypeVar('T')

UnresolvedCursor = tuple[datetime, str, str]
"""A place in the sweep of every unresolved call: the last call seen's started_at, run and call id."""


@dataclass(frozen=True)
class UnresolvedSummary:
    """The calls that have not ended, counted: what `/metrics` shows without reading each one."""

    in_flight: int
    """Unended calls of live runs (they may still finish)."""
    in_doubt: int
    """Unended calls of runs that are not live: `unknown_after_crash`."""
    oldest_in_doubt: datetime | None
    """When the oldest call in doubt started (None: there is none)."""


class Effects:
    """The `EFFECT` states and the `UNRESOLVED`/`UNRESOLVED_RUN` indexes, as `ToolEffectRecord`s."""

    def __init__(self, shards: Shards, runs: Runs, keys: KeyRing | None = None) -> None:
        self._shards = shards
        self._runs = runs
        self.keys = keys
        """The conversation keys a call's sealed content opens with (erasure on), or None."""

    async def read(self, query: Callable[[], T]) -> T:
        """`query()` in the reader's thread, with the keys read up to date (`with_keys`)."""
        return await with_keys(self.keys, lambda: self._shards.query(query), any_content_erased)

    async def get_tool_effect(self, run_id: str, tool_call_id: str) -> ToolEffectRecord | None:
        """`ProjectionReader.get_tool_effect`."""
        return await self.read(lambda: self.effect(run_id, tool_call_id))

    async def list_tool_effects(self, run_id: str) -> list[ToolEffectRecord]:
        """`ProjectionReader.list_tool_effects`: the run's liveness judged once for all its calls."""

        def query() -> list[ToolEffectRecord]:
            db = self._shards.db(run_id)
            calls = [EFFECT.last_str(k) for k, _ in db.scan(EFFECT.prefix(run_id))]
            live = self._runs.live(run_id)
            effects = [e for e in (self.effect(run_id, c, live=live) for c in calls) if e is not None]
            effects.sort(key=lambda e: (e.started_at or EPOCH, e.tool_call_id))
            return effects

        return await self.read(query)

    async def list_unresolved_tool_effects(
        self, run_id: str | None, *, limit: int | None = None, after: UnresolvedCursor | None = None
    ) -> list[ToolEffectRecord]:
        """`ProjectionReader.list_unresolved_tool_effects`: one run's index, or a walk of every shard's.

        Across every run, a walk of `UNRESOLVED` (started_at, run, call) from `after` (a seek) for
        at most `limit` calls: a page reads about its own keys, however many calls are in doubt.
        """

        def query() -> list[ToolEffectRecord]:
            if run_id is not None:
                ids = [
                    (run_id, UNRESOLVED_RUN.last_str(k))
                    for k, _ in self._shards.db(run_id).scan(UNRESOLVED_RUN.prefix(run_id))
                ]
            else:
                start = None if after is None else UNRESOLVED.key(micros(after[0]), after[1], after[2])
                keys = (k for k, _ in self._shards.scan(UNRESOLVED.prefix(), start=start) if k != start)
                parsed = (UNRESOLVED.parse(k) for k in itertools.islice(keys, limit))
                ids = [(str(run), str(call)) for _, run, call in parsed]
            live: dict[str, bool] = {}
            found: list[ToolEffectRecord] = []
            for run, call in ids:
                if run not in live:
                    live[run] = self._runs.live(run)
                effect = self.effect(run, call, live=live[run])
                if effect is not None:
                    found.append(effect)
            found.sort(key=lambda e: (e.started_at or EPOCH, e.run_id, e.tool_call_id))
            return found

        return await self._shards.query(query)  # a call in doubt holds no sealed content

    async def unresolved_summary(self) -> UnresolvedSummary:
        """`ProjectionReader.unresolved_summary`: the index's keys and the live runs, no call read."""

        def query() -> UnresolvedSummary:
            live = set(self._runs.live_ids())  # the runs that read `running`, as `Runs.live` judges
            in_flight = in_doubt = 0
            oldest: int | None = None
            for k, _ in self._shards.scan(UNRESOLVED.prefix()):
                started, run, _call = UNRESOLVED.parse(k)
                assert isinstance(started, int)
                if run in live:
                    in_flight += 1
                else:
                    in_doubt += 1
                    oldest = started if oldest is None else min(oldest, started)
            return UnresolvedSummary(in_flight, in_doubt, None if oldest is None else from_micros(oldest))

        return await self._shards.query(query)

    def effect(self, run_id: str, tool_call_id: str, *, live: bool | None = None) -> ToolEffectRecord | None:
        """The merged effect; `live` is whether its run reads `running` (looked up when not given).

        Its sealed content is opened with the keys as they are (`open_effect`): read it through `read`.
        """
        state = self._shards.db(run_id).get_state(EFFECT.key(run_id, tool_call_id), EffectState)
        if state is None:
            return None
        resolutions = [
            EffectResolution(
                resolution=r['resolution'],
                resolved_by=r['resolved_by'],
                writer_id=r['writer_id'],
                resolved_at=from_micros(r['at']),
                note=r['note'] or '',
                resolves_seq=r['seq'],
                args=r.get('args'),
                result=r.get('result'),
                error=r.get('error'),
                applied=r['offset'] == state.resolved_offset,
            )
            for r in state.resolutions
        ]
        resolution = next((r for r in resolutions if r.applied), None)
        merged = carry(
            state,
            ToolEffectRecord,
            status='resolved' if resolution is not None else state.status,
            ended_at=resolution.resolved_at if resolution is not None else ts(state.ended_at),
            resolution=resolution,
            resolutions=resolutions,
            in_flight=resolution is None
            and state.status == 'started'
            and (self._runs.live(run_id) if live is None else live),
        )
        return open_effect(merged, self.keys)
