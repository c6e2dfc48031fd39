"""`ProjectorObserver`: a projector's `/metrics` (what an operator is paged for), `/healthz` and `/readyz`.

The counters and histograms a batch updates live in `ApplyMetrics.registry`; what a scrape reads
(lag, shards, runs by status, tool calls in doubt or waiting, checkpoint age) is gathered here, on the
projector's event loop, when Prometheus asks: `collect` runs in the scrape's thread and waits
for that loop, so a scrape never reads a projector mid-batch and never blocks it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.registry import Collector

from stepstream.metrics import PROBE_TIMEOUT_S, Verdict, counter_family, gauge, process_registry

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric as Family

    from stepstream.projector._projector import Projector

log = logging.getLogger('stepstream.projector')

DEFAULT_MAX_LAG = 10_000
"""Records a projector may be behind the log's end and still be ready (`--max-lag`)."""


class ProjectionFigures(Protocol):
    """What a scrape asks of the projection (a `ProjectionReader` over the projector's shards)."""

    async def status(self) -> Any:
        """Parked records and runs by status (`ProjectionStatus`)."""
        ...

    async def unresolved_summary(self) -> Any:
        """The tool calls not ended (`UnresolvedSummary`)."""
        ...

    async def list_waiting(self, *, limit: int | None = None) -> list[Any]:
        """The deferred calls waiting for a decision, the longest waiting first (`WaitingCall`s)."""
        ...


class ProjectorObserver(Collector):
    """A projector's registry for `/metrics` and its answers to `/healthz` and `/readyz`.

    Made on the projector's event loop, with a reader over its shards:

    ```python
    observer = ProjectorObserver(projector, ProjectionReader.of(projector))
    ```

    `registry` holds the projector's instruments, the scrape's gauges and the process collectors.
    """

    def __init__(
        self, projector: Projector, projection: ProjectionFigures, *, max_lag: int = DEFAULT_MAX_LAG
    ) -> None:
        """Observe `projector` and, through `projection`, its shards.

        Ready while it is within `max_lag` records of the log's end.
        """
        self.projector = projector
        self.projection = projection
        self.max_lag = max_lag
        self.loop = asyncio.get_running_loop()
        self.registry = process_registry()
        self.registry.register(self)
        self._owned_since: dict[int, float] = {}

    def describe(self) -> Iterable[Family]:
        """Nothing up front: the families depend on what the projector holds at the scrape."""
        return []

    def collect(self) -> Iterable[Family]:
        """The projector's instruments and a scrape's gauges (called from a thread, not the loop)."""
        yield from self.projector.metrics.registry.collect()
        if _running_loop() is self.loop:  # it would wait on itself
            raise RuntimeError('collect from another thread: asyncio.to_thread(generate_latest, registry)')
        future = asyncio.run_coroutine_threadsafe(self.gauges(), self.loop)
        try:
            yield from future.result(PROBE_TIMEOUT_S * 2)
        except Exception as exc:  # the instruments still go out; the gauges say nothing this time
            future.cancel()
            log.warning('metrics: the projector gauges could not be read: %r', exc)

    # -- probes -----------------------------------------------------------------------------------

    def healthy(self) -> Verdict:
        """Alive unless the projector stopped on an error (it never recovers from one in-process)."""
        failure = self.projector._position.failure
        if failure is not None:
            return Verdict(False, {'error': f'the projector stopped on an error: {failure!r}'})
        return Verdict(True, {})

    async def ready(self) -> Verdict:
        """Consuming, holding a shard for every assigned partition, and within `max_lag` records."""
        return self._verdict(self._view())

    def _verdict(self, view: dict[str, Any]) -> Verdict:
        if view['error'] is not None:
            return Verdict(False, {'error': view['error']})
        detail: dict[str, Any] = {
            'assigned': sorted(view['assigned']),
            'owned': sorted(view['owned']),
            'lag': view['lag_total'],
            'max_lag': self.max_lag,
        }
        if view['assigned'] - view['owned']:
            return Verdict(False, {**detail, 'error': 'assigned partitions whose shards are not open yet'})
        if view['unknown']:
            return Verdict(False, {**detail, 'error': f'end offsets not known yet for {view["unknown"]}'})
        if view['lag_total'] > self.max_lag:
            behind = f'{view["lag_total"]} records behind (> {self.max_lag})'
            return Verdict(False, {**detail, 'error': behind})
        return Verdict(True, detail)

    # -- what a scrape reads ----------------------------------------------------------------------

    def _view(self) -> dict[str, Any]:
        """Assignment, shards and lag as the consumer sees them now (on the loop, between batches)."""
        p = self.projector
        consumer, now = p._consumer, time.monotonic()
        view: dict[str, Any] = {'error': None, 'assigned': set(), 'owned': set(p.shards.partitions)}
        view.update(lag_records={}, lag_seconds={}, lag_total=0, unknown=[])
        if consumer is None or p._task is None or p._task.done():
            view['error'] = 'not consuming'
            return view
        if p.group is not None and not p._assignment.joined:
            view['error'] = f'not in the group {p.group!r} yet'
            return view
        assignment = consumer.assignment()
        view['assigned'] = {tp.partition for tp in assignment}
        for tp in sorted(assignment):
            shard = p.shards.get(tp.partition)
            high = consumer.highwater(tp)
            if shard is None or high is None:
                view['unknown'].append(f'{tp.topic}[{tp.partition}]')
                continue
            applied = shard.offsets().get(tp, 0)
            clock = p.metrics.clock(tp)
            clock.seen(high, now)
            key = (tp.topic, str(tp.partition))
            view['lag_records'][key] = behind = max(high - applied, 0)
            view['lag_seconds'][key] = clock.seconds_behind(applied, now) if behind else 0.0
            view['lag_total'] += behind
        return view

    async def gauges(self) -> list[Family]:
        """The scrape's gauges, read on the projector's loop (the reads themselves in a thread)."""
        p, now = self.projector, time.monotonic()
        view = self._view()
        ready = self._verdict(view)
        owned = view['owned']
        families: list[Family] = [
            gauge('stepstream_projector_lag_records', view['lag_records']),
            gauge('stepstream_projector_lag_seconds', view['lag_seconds']),
            gauge('stepstream_projector_partitions', p._layout.partitions if p._layout is not None else 0),
            gauge('stepstream_projector_partitions_assigned', len(view['assigned'])),
            gauge('stepstream_projector_shards_owned', len(owned)),
            gauge('stepstream_projector_shards_missing', len(view['assigned'] - owned)),
            gauge('stepstream_projector_ready', 1 if ready.ok else 0),
        ]
        for partition in owned:
            self._owned_since.setdefault(partition, now)
        for partition in set(self._owned_since) - owned:
            del self._owned_since[partition]
        checkpoints = p.checkpoints
        if checkpoints is not None:
            families.append(
                counter_family(
                    'stepstream_projector_checkpoints',
                    {(outcome,): float(n) for outcome, n in checkpoints.outcomes.items()},
                )
            )
            ages = [now - checkpoints.current_at.get(q, since) for q, since in self._owned_since.items()]
            families.append(gauge('stepstream_projector_checkpoint_age_seconds', max(ages, default=0.0)))
        if owned:
            families.extend(await self._projection_gauges())
        return families

    async def _projection_gauges(self) -> list[Family]:
        """Parked records, runs by status, the tool calls not ended and those waiting, from the shards."""
        reader = self.projection
        status = await reader.status()
        families: list[Family] = [gauge('stepstream_projector_parked_records', status.parked_records)]
        if status.runs is None:  # a shard is missing, or predates the counts
            return families
        families.append(gauge('stepstream_runs', {(s,): n for s, n in status.runs.by_status.items()}))
        calls = await reader.unresolved_summary()
        states: dict[tuple[str, ...], float] = {
            ('in_flight',): calls.in_flight,
            ('unknown_after_crash',): calls.in_doubt,
        }
        families.append(gauge('stepstream_effects_unresolved', states))
        oldest = calls.oldest_in_doubt
        age = (datetime.now(UTC) - oldest).total_seconds() if oldest is not None else 0.0
        families.append(gauge('stepstream_effects_in_doubt_oldest_age_seconds', max(age, 0.0)))
        waiting = status.runs.waiting_calls
        families.append(gauge('stepstream_deferred_calls', {(kind,): n for kind, n in waiting.items()}))
        longest = await reader.list_waiting(limit=1)
        since = (datetime.now(UTC) - longest[0].waiting_since).total_seconds() if longest else 0.0
        families.append(gauge('stepstream_deferred_oldest_age_seconds', max(since, 0.0)))
        return families


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


__all__ = ['DEFAULT_MAX_LAG', 'ProjectorObserver']
