"""A run's hash chain, checked as its records apply (issue 37, item 5; decisions 0048 and 0049).

The projection holds one record per seq of a run (a step event before a transition, the first of
differing records; another writer's are kept apart). The check walks those records in seq order
from the end of the checked prefix (`RunState.chain_through`): each must link (`prev_hash`) to
the `chain_hash` of the record before it. The first that does not marks the run broken there
(seq, topic, partition), and the check stops; the record itself applies or not by the other
rules: a broken chain never stops the projector. A run whose seq 0 was written by a writer
before the chain is `unchained`, never broken.

The verdict is a function of the records the projection holds, not of their arrival order or
batch cuts: a record ahead of the prefix waits until the prefix reaches it (read back from the
shard if its batch is over), and a step event that displaces a transition the prefix already
passed rewinds the prefix to before it (`rewind_chain`). So live equals rebuild.

Only hashes are checked here; signatures need trusted keys, which `stepstream audit verify` has.
"""

from __future__ import annotations

from stepstream.projector._batch import RunKeys
from stepstream.schemas import chain_hash, is_linked, read_record
from stepstream.storage import RunState, Transaction

Link = tuple[str, str | None, bool, int, int]
"""A record's part in the chain: its hash, its `prev_hash`, whether its schema links, topic, partition."""

EVENTS, EFFECTS = 0, 1


def link_of(value: bytes, prev_hash: str | None, topic: int, partition: int) -> Link:
    """The chain's view of a record just applied."""
    return (chain_hash(value), prev_hash, is_linked(value), topic, partition)


def advance_chain(txn: Transaction, keys: RunKeys, run: RunState, links: dict[int, Link]) -> None:
    """Extend the run's checked prefix over the records it holds next; mark the first that does not link.

    `links` are the records of the run applied in this batch, by seq; the others are read from the shard.
    """
    while run.chain_break is None and run.chained is not False:
        seq = run.chain_through + 1
        if not run.holds(seq):
            return
        link = links.get(seq) or _stored_link(txn, keys, seq)
        if link is None:
            return
        digest, prev_hash, linked, topic, partition = link
        if seq == 0:
            run.chained = linked
            if linked and prev_hash is not None:  # a first record that links to something before it
                run.chain_break = [seq, topic, partition]
                return
        elif prev_hash != run.chain_head:
            run.chain_break = [seq, topic, partition]
            return
        run.chain_through, run.chain_head = seq, digest


def rewind_chain(txn: Transaction, keys: RunKeys, run: RunState, seq: int) -> None:
    """The record at `seq` was displaced: check the chain again from it (at the end of the batch)."""
    if seq > run.chain_through + 1:
        return  # the prefix has not reached it: nothing checked depends on it
    run.chain_break = None
    run.chain_through = seq - 1
    if seq == 0:
        run.chained = run.chain_head = None
        return
    before = _stored_link(txn, keys, seq - 1)
    run.chain_head = before[0] if before is not None else None


def _stored_link(txn: Transaction, keys: RunKeys, seq: int) -> Link | None:
    """The link of the record the shard holds at `seq`: the step event, else the transition."""
    value = txn.get(keys.event(seq))
    topic = EVENTS
    if value is None:
        stored = txn.transition(keys.transition(seq))
        if stored is None:
            return None
        value, topic = stored[1], EFFECTS
    return link_of(value, read_record(value)[1]['prev_hash'], topic, keys.home)
