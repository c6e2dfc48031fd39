"""The runs view: one run, the run lists and their pages, conflicts, expiry, and stale/live judgement.

A `running` run reads as `stale` when its newest record is too old (or too far ahead of this
reader's clock): judged here, at read time, never stored, so a rebuild agrees with the live
projection (docs/decisions/0014 and 0026).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from stepstream.errors import NotFound
from stepstream.ids import is_run_id
from stepstream.projector.storage import (
    CHILDREN,
    CONFLICT,
    CONVERSATION,
    RUN,
    RUNS,
    RunState,
    expired_started_at,
)
from stepstream.readmodel._shards import Shards, ShardUnavailable, carry
from stepstream.schemas import RunRecord, RunUsage
from stepstream.timestamps import EPOCH, from_micros, micros

DEFAULT_STALE_AFTER_S = 20.0
"""A `running` run with no record for this long reads as `stale`: four of its writer's default
heartbeat intervals (docs/decisions/0014 and 0026)."""


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
    ) -> list[RunRecord]:
        """`ProjectionReader.list_runs`: walks an index, decodes only the runs it looks at."""

        def query() -> list[RunRecord]:
            runs: list[RunRecord] = []
            for run_id in self._ids(conversation_id, parent_run_id, newest_first, after, after_started):
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
                runs.append(run)
            return runs

        return await self._shards.query(query)

    def _ids(
        self,
        conversation_id: str | None,
        parent_run_id: str | None,
        newest_first: bool,
        after: str | None,
        after_started: datetime | None,
    ) -> Iterator[str]:
        """The run ids of a listing's index, in its order, from where its page starts."""
        if conversation_id is not None:
            index, prefix = CONVERSATION, CONVERSATION.prefix(conversation_id)
        elif parent_run_id is not None:
            index, prefix = CHILDREN, CHILDREN.prefix(parent_run_id)
        else:
            index, prefix = RUNS, RUNS.prefix()
        run_ids: Iterator[str] = (index.last_str(k) for k, _ in self._shards.scan(prefix))
        if after is not None and after_started is not None:
            cut = (micros(after_started), after)
            places = (index.parse(k)[-2:] for k, _ in self._shards.scan(prefix))
            if newest_first:
                run_ids = (str(r) for s, r in reversed(list(places)) if (s, r) < cut)
            else:
                run_ids = (str(r) for s, r in places if (s, r) > cut)
        elif newest_first:
            run_ids = reversed(list(run_ids))
        if after is not None and after_started is None:
            run_ids = itertools.dropwhile(lambda run_id: run_id != after, run_ids)
            if next(run_ids, None) is None:
                raise LookupError(f'after={after!r} is not a run of this listing')
        return run_ids

    async def list_conflicts(self) -> list[RunRecord]:
        """`ProjectionReader.list_conflicts`."""

        def query() -> list[RunRecord]:
            run_ids = {CONFLICT.parse(k)[0] for k, _ in self._shards.scan(CONFLICT.prefix())}
            runs = [r for r in (self.run(str(run_id)) for run_id in run_ids) if r is not None]
            return sorted(runs, key=lambda r: (r.started_at or EPOCH, r.run_id))

        return await self._shards.query(query)
