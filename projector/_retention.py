"""Retention of the read model: runs that ended long enough ago (in log time) leave the projection.

A projection built with a policy (`settings.projection.retain_ended_days`, kept in the shard identity as
`retain_ended_us`) drops every run that ended more than that long before its partition's clock,
with its events, transitions, snapshots, effects, resolutions, records kept apart and index
entries. A run that has not ended (running, stale, crashed with its effects unknown) is kept,
however old. The decisions behind this are in docs/decisions/0032-retention.md; in short:

- The clock is the log's, never the wall clock: the newest `timestamp` of a step event of the
  partition that passed the record-level checks (`CLOCK`). It is a max over a set of records,
  so batch boundaries, restarts and rebuilds reach the same value.
- Expiry is staged in the batch that moved the clock (or ended the run), in the same
  transaction as its records and offsets: exactly once under crashes and member failover.
- The per-record cost is a comparison: a run's end puts one `ENDED` entry (partition, ended_at,
  run_id) and its twin `ENDS` (run_id, ended_at), and each batch reads only the entries below
  the cut-off.
- Whether a run expires is monotone in the log: it expires once any of its end events is older
  than the cut-off, and more records can only add end events and move the clock on. So a run
  dropped at the end of one batch would also be dropped had the batch been cut elsewhere, and
  what a later record of it would have added is dropped with it either way. (A rule such as
  "keep ended runs with an unresolved effect" is not monotone, since a late `started`
  transition would bring a dropped run back, so it is not one; see the decision.)
- An expired run leaves a small `EXPIRED` marker. A record of it that comes later (a late
  transition, a retried write, an operator's resolution) is dropped, not parked, and a reader
  can say that a child's parent expired instead of failing to find it.
- Each kept snapshot record's media is indexed (`MEDIA`: sha256, run_id, and its twin
  `RUN_MEDIA`), from what the record says it needs (`snapshot_media`: the writer's own list
  since schema v4, never a scan of its text); expiry removes the run's. `sweep_media` deletes
  bucket objects that no run of any shard references and that are older than a grace period
  (mark and sweep, see the decision). A shard's identity says which version of the index it
  holds (`MEDIA_INDEX_VERSION`); a sweep refuses an older one (decision 0041).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from stepstream.media import MEDIA_URI_SCHEME
from stepstream.projector._listing import unlist_run
from stepstream.projector._tool_effects import effect_index, reindex
from stepstream.storage import (
    APART,
    CLOCK,
    CONFLICT,
    CONFLICTING_COUNT,
    EFFECT,
    ENDED,
    ENDS,
    EVENT,
    EXPIRED,
    MEDIA,
    RESOLUTION,
    RUN,
    RUN_MEDIA,
    SNAPSHOT,
    SNAPSHOT_KEY,
    TALLY,
    TRANSITION,
    EffectState,
    RunState,
    Transaction,
    dumps,
    stored_clock,
)


class Retention:
    """The apply-side hooks of a retention policy; one per `Applier`, reset per batch.

    The applier calls `begin` when it starts staging a batch, `saw` with the newest step event
    of each key that passed the record checks, `is_expired` before it parks or registers a
    record of an unknown run, `ended` for every end event it applies, `referenced` for a stored
    record that holds a media URI, `tally` for a registered run's record it dead-letters by a
    state rule, and `expire` once the batch's records and dead-letter counts are staged.
    """

    __slots__ = ('_clocks', 'retain_us')

    def __init__(self, retain_us: int) -> None:
        """`retain_us`: how long (log time, micros) an ended run is kept after it ended."""
        if retain_us <= 0:
            raise ValueError(f'a retention period must be positive, got {retain_us} us')
        self.retain_us = retain_us
        self._clocks: dict[int, int] = {}
        """Partition -> the newest step-event timestamp seen in this batch."""

    def begin(self) -> None:
        """Forget the last batch (a batch staged again after a poisoned record starts here too)."""
        self._clocks = {}

    def saw(self, partition: int, timestamp: int) -> None:
        """A step event of `partition` passed the record checks: the clock may move."""
        if timestamp > self._clocks.get(partition, -1):
            self._clocks[partition] = timestamp

    def is_expired(self, txn: Transaction, run_id: str) -> bool:
        """Whether the run was dropped by retention (its later records are dropped too)."""
        return txn.get(EXPIRED.key(run_id)) is not None

    def ended(self, txn: Transaction, partition: int, run_id: str, timestamp: int) -> None:
        """An end event of the run (any of them, whichever seq) applied: index its time."""
        txn.put(ENDED.key(partition, timestamp, run_id), b'')
        txn.put(ENDS.key(run_id, timestamp), b'')

    def tally(self, txn: Transaction, run_id: str, reason: str) -> None:
        """A record of the registered run went to the DLQ: keep count, so its expiry takes it back.

        Whether a late record of a run is dead-lettered (by a state rule) or dropped (the run
        expired before it came) depends on where batches were cut; the shard's DLQ counts must
        not, so an expired run's state-rule dead letters leave the counts with it.
        """
        k = TALLY.key(run_id)
        raw = txn.get(k)
        counts: dict[str, int] = json.loads(raw) if raw is not None else {}
        counts[reason] = counts.get(reason, 0) + 1
        txn.put(k, dumps(counts))

    def referenced(self, txn: Transaction, run_id: str, uris: Iterable[str]) -> None:
        """Index the media a stored snapshot record of the run needs (`snapshot_media`'s URIs)."""
        for uri in uris:
            digest = uri[len(MEDIA_URI_SCHEME) :]
            txn.put(MEDIA.key(digest, run_id), b'')
            txn.put(RUN_MEDIA.key(run_id, digest), b'')

    def expire(self, txn: Transaction, partitions: Iterable[int]) -> list[str]:
        """Move each partition's clock and drop the runs that ended before its cut-off.

        Returns the run ids dropped, in (partition, ended_at, run_id) order.
        """
        dropped: list[str] = []
        for partition in sorted(partitions):
            clock = stored_clock(txn, partition)
            seen = self._clocks.get(partition, -1)
            if seen > clock:
                clock = seen
                txn.put(CLOCK.key(partition), str(clock).encode())
            if clock < 0:
                continue
            cutoff = clock - self.retain_us
            for k, _ in txn.scan_until(ENDED.prefix(partition), ENDED.prefix(partition, cutoff)):
                run_id = ENDED.last_str(k)
                if txn.get(k) is None:
                    continue  # another end of a run dropped a moment ago
                drop_run(txn, partition, run_id)
                dropped.append(run_id)
        return dropped


def drop_run(txn: Transaction, partition: int, run_id: str) -> None:
    """Delete every key of a run (indexes included) and leave its `EXPIRED` marker.

    The marker holds only what the run's registration fixed (`started_at`): what its later
    records said (status, end) depends on how many of them were applied before it expired.
    """
    run = txn.get_state(RUN.key(run_id), RunState)
    assert run is not None, f'an ENDED entry names run {run_id!r}, which is not registered'
    for k, _ in list(txn.scan(ENDS.prefix(run_id))):
        ended_at = ENDS.parse(k)[1]
        assert isinstance(ended_at, int)
        txn.delete(ENDED.key(partition, ended_at, run_id))
        txn.delete(k)
    for _, value in list(txn.scan(EFFECT.prefix(run_id))):  # its calls in doubt or waiting
        reindex(txn, effect_index(EffectState.decode(value), run), ())
    txn.delete(RUN.key(run_id))
    unlist_run(txn, run)
    if run.conflicting_writers:
        txn.add_count(CONFLICTING_COUNT, -1)
    for k, _ in list(txn.scan(RUN_MEDIA.prefix(run_id))):
        txn.delete(MEDIA.key(RUN_MEDIA.last_str(k), run_id))
        txn.delete(k)
    # The run's own children stay indexed under it: those entries describe the children.
    for space in (EVENT, TRANSITION, SNAPSHOT, SNAPSHOT_KEY, EFFECT, RESOLUTION, APART, CONFLICT):
        for k, _ in list(txn.scan(space.prefix(run_id))):
            txn.delete(k)
    tally = txn.get(TALLY.key(run_id))
    if tally is not None:
        txn.uncount_dead_letters(json.loads(tally))
        txn.delete(TALLY.key(run_id))
    txn.put(EXPIRED.key(run_id), dumps({'started_at': run.started_at}))
