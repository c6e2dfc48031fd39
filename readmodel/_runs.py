"""The runs view: one run, the run lists and their pages, conflicts, expiry, and stale/live judgement.

A `running` run reads as `stale` when its newest record is too old (or too far ahead of this
reader's clock): judged here, at read time, never stored, so a rebuild agrees with the live
projection (docs/decisions/0014 and 0026).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from stepstream.errors import BadCursor, NotFound
from stepstream.ids import is_run_id
from stepstream.readmodel._shards import Shards, ShardUnavailable, carry
from stepstream.schemas import DEFERRALS, RUN_STATUSES, RunRecord, RunUsage
from stepstream.storage import (
    AGENT,
    BROKEN,
    CHILDREN,
    CONFLICT,
    CONVERSATION,
    COUNT,
    LATEST,
    RUN,
    RUN_INDEX_VERSION,
    RUNS,
    STATUS,
    Keyspace,
    RunState,
    expired_started_at,
)
from stepstream.timestamps import EPOCH, from_micros, micros

_STORED = {'stale': 'running'}
"""A status as `STATUS` files it: `stale` is judged at read time, of a run stored as `running`."""

STORED_STATUSES = tuple(s for s in RUN_STATUSES if s not in _STORED)
"""The statuses a run is stored (and filed) with."""

DEFAULT_STALE_AFTER_S = 20.0
"""A `running` run with no record for this long reads as `stale`: four of its writer's default
heartbeat intervals (docs/decisions/0014 and 0026)."""


@dataclass(frozen=True)
class RunCounts:
    """How many runs read each status and belong to each agent, and how many calls are in doubt."""

    by_status: dict[str, int]
    """Every status (`RUN_STATUSES`), 0 included: `running` and `stale` judged now."""
    by_agent: dict[str, int]
    """Agent name -> its runs (runs without a name are not counted here)."""
    unresolved_effects: int
    """Calls whose effect is not known (`in_flight` or `unknown_after_crash`), in every run."""
    broken_chains: int = 0
    """Runs whose hash chain is broken (`chain` `broken`): a record does not link to the one before it."""
    waiting_calls: dict[str, int] = field(default_factory=dict)
    """Deferred calls that wait for a decision, per kind (`approval`, `question`, `external`), 0 included."""


class Runs:
    """Runs as `RunRecord`s: the `RUN` states, the `RUNS`/`CONVERSATION`/`CHILDREN` indexes."""

    def __init__(self, shards: Shards, stale_after: timedelta) -> None:
        self._shards = shards
        self.stale_after = stale_after

    # -- in the reader's thread ------------------------------------------------------------------

    def run(self, run_id: str) -> RunRecord | None:
        """The run's record, its status judged now, or None."""
        state = self._shards.db(run_id).get_state(RUN.key(run_id), RunState)
        if state is None:
            return None
        last_record_at = from_micros(max(state.started_at, state.last_record_at))
        status, parent = state.status, state.parent_run_id
        if status == 'running' and not self.alive(last_record_at):
            status = 'stale'
        return carry(
            state,
            RunRecord,
            registration_id=state.owner,
            status=status,
            last_record_at=last_record_at,
            event_count=state.record_count,
            gaps=state.gaps(),
            usage=RunUsage(**state.usage, cost_usd=state.cost_usd),
            parent_expired=parent is not None and self.expired_at(parent) is not None,
        )

    def expired_at(self, run_id: str) -> datetime | None:
        """`expired`, in the reader's thread; None too when the run's shard is not here."""
        if not is_run_id(run_id):
            return None
        try:
            started = expired_started_at(self._shards.db(run_id), run_id)
        except ShardUnavailable:
            return None
        return None if started is None else from_micros(started)

    def alive(self, last_record_at: datetime) -> bool:
        """Whether a `running` run's newest record is recent.

        Neither older than the threshold, nor further ahead of this reader's clock than it: a
        writer clock in the future cannot keep a dead run alive.
        """
        quiet = datetime.now(UTC) - last_record_at
        return -self.stale_after <= quiet <= self.stale_after

    def live(self, run_id: str) -> bool:
        """Whether the run reads `running` (not stale, not ended): its unended calls are in flight."""
        run = self.run(run_id)
        return run is not None and run.status == 'running'

    # -- queries ---------------------------------------------------------------------------------

    async def get_run(self, run_id: str) -> RunRecord | None:
        """`ProjectionReader.get_run`."""
        return await self._shards.point(lambda: self.run(run_id))

    async def require_run(self, run_id: str) -> RunRecord:
        """`ProjectionReader.require_run`."""
        run = await self.get_run(run_id)
        if run is not None:
            return run
        root = self._shards.root
        where = f'the projection at {root}' if root is not None else 'the projection'
        started = await self.expired(run_id)
        if started is not None:
            raise NotFound(
                f'run {run_id!r} (started {started.isoformat()}) ended long ago and was dropped by the '
                f'retention policy of {where} (STEPSTREAM_RETAIN_ENDED_DAYS, `stepstream retention`); '
                'the log may still hold it'
            )
        raise NotFound(f'no run {run_id!r} in {where}')

    async def expired(self, run_id: str) -> datetime | None:
        """`ProjectionReader.expired`."""
        return await self._shards.query(lambda: self.expired_at(run_id))

    async def list_runs(
        self,
        conversation_id: str | None,
        parent_run_id: str | None,
        status: str | None,
        agent_name: str | None,
        *,
        newest_first: bool,
        after: str | None,
        after_started: datetime | None,
        limit: int | None,
        chain: str | None = None,
    ) -> list[RunRecord]:
        """`ProjectionReader.list_runs`: walks an index, decodes only the runs it looks at."""

        def query() -> list[RunRecord]:
            runs: list[RunRecord] = []
            ids = self._ids(
                conversation_id, parent_run_id, status, agent_name, newest_first, after, after_started, chain
            )
            for run_id in ids:
                if limit is not None and len(runs) >= limit:
                    break
                run = self.run(run_id)
                if run is None:
                    continue
                if parent_run_id is not None and run.parent_run_id != parent_run_id:
                    continue
                if status is not None and run.status != status:
                    continue
                if agent_name is not None and run.agent_name != agent_name:
                    continue
                if chain is not None and run.chain != chain:
                    continue
                runs.append(run)
            return runs

        return await self._shards.query(query)

    def _ids(
        self,
        conversation_id: str | None,
        parent_run_id: str | None,
        status: str | None,
        agent_name: str | None,
        newest_first: bool,
        after: str | None,
        after_started: datetime | None,
        chain: str | None = None,
    ) -> Iterator[str]:
        """The run ids of a listing's index, in its order, from where its page starts.

        A bounded walk: each shard's index is read from the page's start (its end, newest first;
        the `after` run's place, found by a seek) and only as far as the caller takes ids. The
        listing is a conversation's, a parent's, or every run; within every run, an agent's or a
        status's runs are their own index (`AGENT`, filed by status too, and `STATUS`) where the
        shards have them. A `running` or `stale` run is filed under `running`: which of the two
        is judged as it is read. `stale` walks the runs not ended and skips the few live ones;
        `running` reads the live ones from `LATEST` (the runs whose newest record is recent).
        The runs whose chain is broken are their own index (`BROKEN`), the other filters applied
        as they are read.
        """
        parts: tuple[str, ...] = ()
        if conversation_id is not None:
            index, parts = CONVERSATION, (conversation_id,)
        elif parent_run_id is not None:
            index, parts = CHILDREN, (parent_run_id,)
        else:
            index = RUNS
        at = 0
        if after is not None:
            at = micros(after_started) if after_started is not None else self._started(after, index, parts)
        prefixes = [index.prefix(*parts)]
        version = self.index_version() if index is RUNS and (agent_name or status or chain) is not None else 0
        if chain == 'broken' and version >= 4:
            prefixes = [BROKEN.prefix()]
        elif version >= 2 and (agent_name or status) is not None:
            stored = [_STORED.get(status, status)] if status is not None else list(STORED_STATUSES)
            if status == 'running' and agent_name is None and version >= 3:
                return self._live(newest_first, after, at)
            if agent_name is not None and version >= 3:
                prefixes = [AGENT.prefix(agent_name, s) for s in stored]
            elif agent_name is not None:
                prefixes = [AGENT.prefix(agent_name)]
            else:
                prefixes = [STATUS.prefix(*stored)]
        cursor = b'' if after is None else RUNS.key(at, after)[len(RUNS.prefix()) :]
        places = self._shards.walk(prefixes, cursor, reverse=newest_first)
        return (RUNS.last_str(RUNS.prefix() + place) for place in places if place != cursor)

    def _live(self, newest_first: bool, after: str | None, at: int) -> Iterator[str]:
        """The runs that read `running` now, in the listing's order from the cursor.

        `LATEST`'s recent range: a few entries however many runs have ended or gone stale.
        """
        states = (self._shards.db(run_id).get_state(RUN.key(run_id), RunState) for run_id in self.live_ids())
        runs = [(state.started_at, state.run_id) for state in states if state is not None]
        runs.sort(reverse=newest_first)
        if after is not None:
            runs = [r for r in runs if (r < (at, after)) == newest_first and r != (at, after)]
        return (run_id for _, run_id in runs)

    def live_ids(self) -> list[str]:
        """The run ids `LATEST` holds with a newest record within `stale_after` of now (either side)."""
        now = datetime.now(UTC)
        low, high = micros(now - self.stale_after), micros(now + self.stale_after)
        found = []
        for k, _ in self._shards.scan(LATEST.prefix(), start=LATEST.prefix(low)):
            when, run_id = LATEST.parse(k)
            assert isinstance(when, int) and isinstance(run_id, str)
            if when > high:
                break
            found.append(run_id)
        return found

    def counts(self) -> RunCounts | None:
        """Runs per status (`stale` apart from `running`) and per agent, the calls in doubt and waiting.

        From the shards' `COUNT`s; None where a shard in scope is missing, or predates them (rebuild
        it to count).
        """
        try:
            return self._counts()
        except ShardUnavailable:
            return None

    def _counts(self) -> RunCounts | None:
        if self.index_version() < 3:
            return None
        by_status = dict.fromkeys(RUN_STATUSES, 0)
        by_agent: dict[str, int] = {}
        unresolved = broken = 0
        waiting = dict.fromkeys(sorted(DEFERRALS), 0)
        for shard in self._shards.all():
            for k, v in shard.scan(COUNT.prefix()):
                kind, name = COUNT.parse(k)
                assert isinstance(name, str)
                if kind == 'status':
                    by_status[name] = by_status.get(name, 0) + int(v)
                elif kind == 'agent':
                    by_agent[name] = by_agent.get(name, 0) + int(v)
                elif (kind, name) == ('effects', 'unresolved'):
                    unresolved += int(v)
                elif (kind, name) == ('chain', 'broken'):
                    broken += int(v)
                elif kind == 'waiting':
                    waiting[name] = waiting.get(name, 0) + int(v)
        live = len(self.live_ids())
        by_status['stale'] = by_status['running'] - live
        by_status['running'] = live
        return RunCounts(
            by_status=by_status,
            by_agent=dict(sorted(by_agent.items())),
            unresolved_effects=unresolved,
            broken_chains=broken,
            waiting_calls=waiting,
        )

    def index_version(self) -> int:
        """The oldest version of the run indexes among the shards (`RUN_INDEX_VERSION`).

        A shard without an identity (not made by a projector) counts as current.
        """
        versions = [s.identity() for s in self._shards.all()]
        return min((i.run_index for i in versions if i is not None), default=RUN_INDEX_VERSION)

    def _started(self, run_id: str, index: Keyspace, parts: tuple[str, ...]) -> int:
        """When `run_id` started, as its place in `index` says; `BadCursor` if it has none there."""
        state = None
        if is_run_id(run_id):
            with contextlib.suppress(ShardUnavailable):
                state = self._shards.db(run_id).get_state(RUN.key(run_id), RunState)
        if state is None or self._shards.db(run_id).get(index.key(*parts, state.started_at, run_id)) is None:
            raise BadCursor(f'after={run_id!r} is not a run of this listing')
        return state.started_at

    async def list_conflicts(self) -> list[RunRecord]:
        """`ProjectionReader.list_conflicts`."""

        def query() -> list[RunRecord]:
            run_ids = {CONFLICT.parse(k)[0] for k, _ in self._shards.scan(CONFLICT.prefix())}
            runs = [r for r in (self.run(str(run_id)) for run_id in run_ids) if r is not None]
            return sorted(runs, key=lambda r: (r.started_at or EPOCH, r.run_id))

        return await self._shards.query(query)
