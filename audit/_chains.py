"""One run's integrity, from the records the log holds for it: the chain, its order, its signatures.

Pure: `verify_run` is given what was read (`Seen`) and the trusted keys, and says whether the
run's trail is exactly what its writer wrote (docs/audit.md). The trail is every record the run's
writer appends with a `seq` (step events and tool-effect transitions); heartbeats are beside it,
and signed heads (`chain_signed`) are statements about it. Answers (decisions, operators'
resolutions, resuming runs' marks: `ANSWER_KINDS`) are beside it too, written by other processes:
not chained, each must stand as its run's and answer a record of it (`check_answers`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from stepstream.audit._answers import check_answers
from stepstream.audit._records import NOT_THE_TRAIL, TERMINAL_KINDS, Break, Problem, Seen, break_at
from stepstream.schemas import STEP_EVENTS
from stepstream.signing import SIGNED_KIND, TrustedKeys, statement

__all__ = ['TERMINAL_KINDS', 'Break', 'Chain', 'Problem', 'RunIntegrity', 'Seen', 'verify_run']

Chain = Literal['intact', 'broken', 'unchained']
"""A run's integrity verdict: `unchained` for records written before the chain (no links at all)."""


@dataclass(slots=True)
class RunIntegrity:
    """A run's integrity verdict: its chain, how far trusted signatures cover it, the first break."""

    run_id: str
    chain: Chain
    records: int
    """Records of the run's trail in the log (duplicates once)."""
    ended: bool
    signed_through: int | None
    """How many of its first records a valid signature by a trusted key covers; None when not checked."""
    head: tuple[int, str] | None
    """The highest `seq` of its trail and that record's hash, as the log holds them."""
    digests: dict[int, str] = field(default_factory=dict)
    """The hash of the record the trail holds at each `seq`."""
    breaks: list[Break] = field(default_factory=list)
    answers: int = 0
    """Answers beside the trail the log holds for it, as its run's (duplicates once)."""

    @property
    def answer_breaks(self) -> list[Break]:
        """The breaks at answers (decisions, resolutions, marks), in log order."""
        return sorted((b for b in self.breaks if b.answer is not None), key=lambda b: (b.topic, b.offset))

    @property
    def ok(self) -> bool:
        """Nothing is wrong with the run's records."""
        return not self.breaks

    @property
    def first_break(self) -> Break | None:
        """The break at the lowest `seq` (the first place the log differs from what was written)."""
        return min(self.breaks, key=lambda b: (b.seq, b.offset)) if self.breaks else None


def _position(record: Seen) -> tuple[int, int, int]:
    return (record.offset, record.topic, record.seq)


def verify_run(run_id: str, seen: Iterable[Seen], keys: TrustedKeys | None) -> RunIntegrity:
    """The integrity of run `run_id` from its records in the log (any order), checked against `keys`.

    Without `keys`, signatures are not checked (`signed_through` is None). With them, every
    record of the trail must be covered by a valid head signed by one of them.
    """
    trail: list[Seen] = []
    heads: list[Seen] = []
    answers: dict[str, Seen] = {}
    breaks: list[Break] = []
    ordered = sorted(seen, key=_position)  # the verdict never depends on the order records are given in
    for record in ordered:
        if not record.placed:
            whose = "keyed or placed as another run's"
            breaks.append(
                break_at(
                    record, 'inserted', whose if record.answers else f'a record of run {run_id!r} {whose}'
                )
            )
        elif record.topic == STEP_EVENTS and record.kind == SIGNED_KIND:
            heads.append(record)
        elif record.answers:
            answers.setdefault(record.digest, record)  # a resent duplicate is one record
        elif record.kind not in NOT_THE_TRAIL:
            trail.append(record)
    by_seq: dict[int, list[Seen]] = {}
    for record in trail:
        same = by_seq.setdefault(record.seq, [])
        if all(other.digest != record.digest for other in same):  # a resent duplicate is one record
            same.append(record)
    # A run is chained if its writer links: its first record's schema says so, as the projection
    # reads it (`projector/_chain.py`); without that, any link says so.
    first = min(trail, key=lambda r: (r.seq, r.offset), default=None)
    if first is not None and first.linked is not None:
        chained = first.linked
    else:
        chained = any(r.prev_hash is not None for r in ordered)
    digests: dict[int, str] = {}
    if chained:
        _check_links(run_id, by_seq, digests, breaks)
    else:
        digests = {seq: same[0].digest for seq, same in by_seq.items()}
    _check_order(trail, breaks)
    check_answers(answers.values(), by_seq, breaks)
    signed_through = None if keys is None else _check_signatures(run_id, heads, trail, digests, keys, breaks)
    top = max(by_seq, default=None)
    return RunIntegrity(
        run_id=run_id,
        chain='unchained' if not chained else ('broken' if breaks else 'intact'),
        records=sum(len(same) for same in by_seq.values()),
        ended=any(r.kind in TERMINAL_KINDS for r in trail if r.topic == STEP_EVENTS),
        signed_through=signed_through,
        head=None if top is None else (top, digests.get(top, by_seq[top][0].digest)),
        digests=digests,
        breaks=breaks,
        answers=len(answers),
    )


def _check_links(
    run_id: str, by_seq: dict[int, list[Seen]], digests: dict[int, str], breaks: list[Break]
) -> None:
    """Walk the trail by `seq`: each record links to the one before; `digests` gets the chain's records."""
    previous: Seen | None = None
    for seq in sorted(by_seq):
        candidates = by_seq[seq]
        following = by_seq.get(seq + 1, [])
        expected = previous.digest if previous is not None else None
        if previous is not None and seq != previous.seq + 1:
            expected = None  # nothing to link to: the gap is the break
        chosen = _choose(candidates, expected, following)
        if previous is None and seq != 0:
            breaks.append(
                break_at(chosen, 'missing', f'records 0 to {seq - 1} of the run are not in the log')
            )
        elif previous is not None and seq != previous.seq + 1:
            gap = f'records {previous.seq + 1} to {seq - 1}'
            breaks.append(break_at(chosen, 'missing', f'{gap} of the run are not in the log'))
        for other in candidates:
            if other is not chosen:
                breaks.append(break_at(other, 'inserted', f'a second record for seq {seq} of run {run_id!r}'))
        if seq == 0 and chosen.prev_hash is not None:
            breaks.append(
                break_at(chosen, 'inserted', 'the first record of the run links to a record before it')
            )
        elif expected is not None and chosen.prev_hash != expected:
            assert previous is not None
            if chosen.prev_hash is None:
                breaks.append(break_at(chosen, 'inserted', 'a record without a link in a chained run'))
            elif any(f.prev_hash == chosen.digest for f in following) or not following:
                breaks.append(
                    break_at(
                        previous,
                        'altered',
                        f'its hash {previous.digest[:16]}... is not the link {chosen.prev_hash[:16]}... '
                        f'that seq {seq} carries',
                    )
                )
            else:
                breaks.append(
                    break_at(chosen, 'inserted', 'it links to neither the record before nor the one after')
                )
        digests[seq] = chosen.digest
        previous = chosen


def _choose(candidates: list[Seen], expected: str | None, following: list[Seen]) -> Seen:
    """The record the chain holds at a `seq` several records claim: the one linked on both sides."""
    if len(candidates) == 1:
        return candidates[0]

    def fit(record: Seen) -> tuple[bool, bool, int, int]:
        after = any(f.prev_hash == record.digest for f in following)
        return (after, record.prev_hash == expected, -record.offset, -record.topic)

    return max(candidates, key=fit)


def _check_order(trail: list[Seen], breaks: list[Break]) -> None:
    """On each topic, a run's records stand in the order its writer appended them (`seq`)."""
    for topic in (0, 1):
        highest: Seen | None = None
        seen_digests: set[str] = set()
        for record in sorted((r for r in trail if r.topic == topic), key=lambda r: r.offset):
            if record.digest in seen_digests:
                continue  # a resent duplicate stands where its resend put it
            seen_digests.add(record.digest)
            if highest is not None and record.seq < highest.seq:
                breaks.append(
                    break_at(
                        record,
                        'reordered',
                        f'it stands after seq {highest.seq} (offset {highest.offset}), '
                        'which its writer appended later',
                    )
                )
                continue
            highest = record


def _check_signatures(
    run_id: str,
    heads: list[Seen],
    trail: list[Seen],
    digests: dict[int, str],
    keys: TrustedKeys,
    breaks: list[Break],
) -> int:
    """How many first records of the trail a valid trusted head covers; a break for each record beyond.

    Heads are taken highest first. A head that states a prefix of the chain the log holds, below
    one already found valid, is not verified: the valid one covers every record it would, and an
    Ed25519 verification (tens of microseconds) per durability point would dominate the audit.
    """
    covered = 0
    unknown = 0
    for head in sorted(heads, key=lambda h: (-h.seq, h.offset)):
        if head.signature is None or head.prev_hash is None:
            breaks.append(break_at(head, 'bad_signature', 'a signed head without a signature or a head'))
            continue
        if head.seq <= covered and digests.get(head.seq - 1) == head.prev_hash:
            continue  # implied by the valid head above it
        key, signature = head.signature
        valid = keys.verify(key, signature, statement(run_id, head.seq, head.prev_hash))
        if valid is None:
            unknown = max(unknown, head.seq)
        elif not valid:
            breaks.append(
                break_at(head, 'bad_signature', f'the signature by {key} is not valid for the head it states')
            )
        elif head.seq - 1 not in digests:
            continue  # the record it covers is missing from the chain: that break is named there
        elif digests[head.seq - 1] != head.prev_hash:
            breaks.append(
                break_at(
                    head,
                    'altered',
                    f'the head signed by {key} for the first {head.seq} records '
                    'is not the chain the log holds',
                )
            )
        else:
            covered = max(covered, head.seq)
    beyond = [r for r in trail if r.seq >= covered]
    if beyond:
        first = min(beyond, key=lambda r: (r.seq, r.offset))
        if unknown > first.seq:
            breaks.append(
                break_at(first, 'unknown_key', 'the heads that cover it are signed by keys not trusted')
            )
        else:
            covered_text = f'the first {covered}' if covered else 'none of its'
            breaks.append(
                break_at(
                    first,
                    'unsigned',
                    f'no trusted signature covers it (signed heads cover {covered_text} records)',
                )
            )
    return covered
