"""A run's place in the listings: its index entries and the counts, kept in the run's transaction.

Every registered run is listed in `RUNS`, `STATUS` (by its stored status), `AGENT` (by agent
name, then status), `CONVERSATION` (with its share of the conversation, `_conversations.py`)
and `CHILDREN`, and counted in `COUNT` (runs per stored status
and per agent). A run stored as `running` is also in `LATEST`, by the time of its newest record:
whether a running run reads `stale` depends only on that time, so the runs that read `running`
are one bounded range of `LATEST` (the last few seconds) and a count of the stale ones is the
running count minus that range (docs/decisions/0046-counts.md).

Registration lists a run where its listing never changes; the end of each batch files the rest
as the batch leaves the run (`relist_run`, once per run and batch, however many records it had:
a run that starts and ends in one batch is never filed as running); a retention drop unlists it.
Each happens in the transaction that changes the run's state, so no index or count can disagree
with the `RUN` states (tests/test_apply_properties.py holds every generated log to it). The
unresolved calls, the parked records and the conflicting runs are counted where their entries
change (`_tool_effects`, `_apply`, `_retention`).
"""

from __future__ import annotations

from stepstream.projector._conversations import Share, refile_conversation, share_of, unfile_conversation
from stepstream.storage import (
    AGENT,
    BROKEN,
    BROKEN_COUNT,
    CHILDREN,
    CONVERSATION,
    LATEST,
    RUNS,
    STATUS,
    RunState,
    Transaction,
    agent_count,
    status_count,
)

Listed = tuple[str, int, bool, Share | None]
"""Where a run is filed: its stored status, its newest record's time, whether its chain is broken,
and what it adds to its conversation's share (None: it has no conversation)."""


def listed(run: RunState) -> Listed:
    """Where the run's state files it now (what `relist_run` compares with at the batch's end)."""
    share = None if run.conversation_id is None else share_of(run)
    return (run.status, latest(run), run.chain_break is not None, share)


def latest(run: RunState) -> int:
    """When the run's newest record was written (micros): what `stale` is judged by."""
    return max(run.started_at, run.last_record_at)


def list_run(txn: Transaction, run: RunState) -> None:
    """List a run just registered where its listing never changes; the rest waits for `relist_run`.

    The entries that follow its status and newest record are made at the end of the batch, from
    the state the batch leaves: a run that starts and ends within one batch never writes a
    `running` entry only to delete it (a deleted key lingers as a tombstone every walk steps over).
    """
    run_id, started = run.run_id, run.started_at
    txn.put(RUNS.key(started, run_id), b'')
    if run.conversation_id is not None:
        txn.put(CONVERSATION.key(run.conversation_id, started, run_id), b'')
    if run.parent_run_id is not None:
        txn.put(CHILDREN.key(run.parent_run_id, started, run_id), b'')
    if run.agent_name is not None:
        txn.add_count(agent_count(run.agent_name), 1)


def relist_run(txn: Transaction, run: RunState, was: Listed | None) -> None:
    """File the run's entries as the batch leaves it.

    `was` is where it was filed before the batch (`listed`; None: registered in this batch, not
    filed yet).
    """
    if run.conversation_id is not None:
        refile_conversation(txn, run, None if was is None else was[3])
    now = latest(run)
    broken = run.chain_break is not None
    if was is not None and was[:3] == (run.status, now, broken):
        return
    if broken != (was is not None and was[2]):
        _file_broken(txn, run, 1 if broken else -1)
    if was is None or was[0] != run.status:
        if was is not None:
            _file(txn, run, was[0], -1)
        _file(txn, run, run.status, 1)
    if was is not None and was[0] == 'running':
        txn.delete(LATEST.key(was[1], run.run_id))
    if run.status == 'running':
        txn.put(LATEST.key(now, run.run_id), b'')


def unlist_run(txn: Transaction, run: RunState) -> None:
    """Take a dropped run out of every listing and count (its children's entries stay: they are theirs)."""
    run_id, started = run.run_id, run.started_at
    txn.delete(RUNS.key(started, run_id))
    if run.conversation_id is not None:
        txn.delete(CONVERSATION.key(run.conversation_id, started, run_id))
        unfile_conversation(txn, run)
    if run.parent_run_id is not None:
        txn.delete(CHILDREN.key(run.parent_run_id, started, run_id))
    if run.agent_name is not None:
        txn.add_count(agent_count(run.agent_name), -1)
    _file(txn, run, run.status, -1)
    if run.status == 'running':
        txn.delete(LATEST.key(latest(run), run_id))
    if run.chain_break is not None:
        _file_broken(txn, run, -1)


def _file_broken(txn: Transaction, run: RunState, delta: int) -> None:
    """Add (1) or take out (-1) the run's `BROKEN` entry and count."""
    if delta > 0:
        txn.put(BROKEN.key(run.started_at, run.run_id), b'')
    else:
        txn.delete(BROKEN.key(run.started_at, run.run_id))
    txn.add_count(BROKEN_COUNT, delta)


def _file(txn: Transaction, run: RunState, status: str, delta: int) -> None:
    """Add (1) or take out (-1) the run's entries under `status`: `STATUS`, `AGENT`, the count."""
    keys = [STATUS.key(status, run.started_at, run.run_id)]
    if run.agent_name is not None:
        keys.append(AGENT.key(run.agent_name, status, run.started_at, run.run_id))
    for k in keys:
        if delta > 0:
            txn.put(k, b'')
        else:
            txn.delete(k)
    txn.add_count(status_count(status), delta)
