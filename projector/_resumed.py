"""A run that ended waiting, resumed by another run: the `run_resumed` mark (decision 0057).

The resuming run's writer appends the mark keyed by the waiting run, so it lands in the waiting
run's partition after its `run_waiting`, and the projector links the two in that run's shard
alone: no shard reads another. The first mark in the log resumes the run; a later one names a
second resumption of one waiting run, which the DLQ keeps with the run that stands.
"""

from __future__ import annotations

from stepstream.projector._batch import Rejected
from stepstream.projector._retention import Retention
from stepstream.schemas import RESUMED_BY_KEY, Fields
from stepstream.storage import RunState, Transaction


def apply_resumed(
    txn: Transaction, home: int, run: RunState, mark: Fields, retention: Retention | None
) -> bool:
    """Mark `run` resumed by the run the `run_resumed` mark names: False for the same mark again.

    `Rejected` (`not_resumable`) when the run did not end waiting, or another run resumed it first.
    The run then ends for the retention policy (a waiting run is kept while it waits).
    """
    resumer = mark['metadata'][RESUMED_BY_KEY]
    if run.resumed_by == resumer:
        return False
    if run.resumed_by is not None:
        raise Rejected(
            'not_resumable',
            f'run {run.run_id!r} was resumed by run {run.resumed_by!r} first; '
            f'run {resumer!r} resumed it again',
        )
    if run.status != 'waiting':
        raise Rejected(
            'not_resumable',
            f'run {resumer!r} resumes run {run.run_id!r}, which is {run.status}: only a run that ended '
            'waiting is resumed',
        )
    run.status, run.resumed_by, run.resumed_at = (
        'resumed',
        resumer,
        mark['timestamp'],
    )  # relisted at the batch's end
    if retention is not None:
        retention.ended(txn, home, run.run_id, mark['timestamp'])
    return True
