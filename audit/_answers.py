"""Answers: decisions, resolutions and marks answer records of their run, and are those a checkpoint saw.

An answer (`ANSWER_KINDS`: a decision or an operator's resolution, a resuming run's mark) is not
in its run's chain: any process writes it, keyed by the run. Without a checkpoint, `check_answers`
(called by `verify_run`) says whether each answers a record of its run, as the projector reads
them. A checkpoint lists each run's answers as it saw them (`SawAnswer`), and `compare_answers`
compares the log with that list by content (the record's hash), never by offset alone, so that a
copy of the topics with offsets shifted verifies against the same checkpoint
(docs/decisions/0061-answers-in-the-audit.md):

- an answer the checkpoint saw that the log no longer holds is `missing`, unless its partition was
  trimmed past it (retention: the partition's verdict says `trimmed`);
- an answer the checkpoint did not see, standing before a record the checkpoint saw (the partition's
  last one, a run's newest record or an answer, all found by content), is `inserted`;
- such an answer to the same `seq` as a missing one is that one `altered`.

Answers written after the checkpoint stand after everything it saw, and are not breaks.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from stepstream.audit._records import (
    TERMINAL_KINDS,
    TOPIC_NAMES,
    Break,
    Seen,
    answer_name,
    break_at,
    describe,
)
from stepstream.schemas import STEP_EVENTS, TOOL_EFFECTS
from stepstream.storage import ANSWERS


@dataclass(frozen=True, slots=True)
class SawAnswer:
    """An answer as a checkpoint saw it: what it answers, its hash, where it stood, what it said."""

    topic: str
    partition: int
    seq: int
    """The `seq` it answers (a mark's own)."""
    offset: int
    digest: str
    """`chain_hash` of the record."""
    kind: str
    name: str
    """`decision`, `resolution` or the mark's kind (`answer_name`)."""
    label: str
    """The answer as reports name it (`describe`): what a dropped one was."""

    @staticmethod
    def of(record: Seen) -> SawAnswer:
        """The checkpoint's entry for an answer the log holds."""
        return SawAnswer(
            TOPIC_NAMES[record.topic],
            record.partition,
            record.seq,
            record.offset,
            record.digest,
            record.kind,
            answer_name(record),
            describe(record),
        )

    def as_list(self) -> list[object]:
        """Its entry in the checkpoint file."""
        return [
            self.topic,
            self.partition,
            self.seq,
            self.offset,
            self.digest,
            self.kind,
            self.name,
            self.label,
        ]


def answers_of(seen: Iterable[Seen]) -> list[Seen]:
    """A run's answers that stand as its run's, once each (a resent one is one), in log order."""
    kept: dict[str, Seen] = {}
    for record in sorted((s for s in seen if s.answers and s.placed), key=lambda s: (s.topic, s.offset)):
        kept.setdefault(record.digest, record)
    return list(kept.values())


def covered(
    runs: Mapping[str, list[Seen]], known: Mapping[str, Collection[str]], found: Mapping[str, int]
) -> dict[str, int]:
    """Per topic role, the offset up to which one partition holds what the checkpoint saw.

    The offset of the last record of it the log still holds, found by content: a run's newest
    record or an answer the checkpoint names (`known`, their hashes), or the partition's last
    record then (`found`, `Digest.found`).
    """
    reach = dict(found)
    for seen in runs.values():
        for record in seen:
            role = TOPIC_NAMES[record.topic]
            if record.offset > reach.get(role, -1) and record.digest in known.get(role, ()):
                reach[role] = record.offset
    return reach


def compare_answers(
    saw: Sequence[SawAnswer], held: Sequence[Seen], starts: Mapping[str, int | None], reach: Mapping[str, int]
) -> list[Break]:
    """The breaks between a run's answers the checkpoint saw (`saw`) and those the log holds (`held`).

    `starts` is where each topic's partition now starts (a trimmed one after the checkpoint's
    answers), `reach` what `covered` says of it.
    """
    held_digests = {h.digest for h in held}
    saw_digests = {s.digest for s in saw}
    dropped = [s for s in saw if s.digest not in held_digests and not _trimmed(s, starts)]
    breaks: list[Break] = []
    for record in held:
        if record.digest in saw_digests or record.offset > reach.get(TOPIC_NAMES[record.topic], -1):
            continue  # the checkpoint saw it, or it was written after the checkpoint
        place = (TOPIC_NAMES[record.topic], record.kind, record.seq)
        pair = next((s for s in dropped if (s.topic, s.kind, s.seq) == place), None)
        if pair is not None:
            dropped.remove(pair)
            breaks.append(break_at(record, 'altered', f'is not the one the checkpoint saw: {pair.label}'))
        else:
            breaks.append(
                break_at(
                    record,
                    'inserted',
                    'is not among those the checkpoint saw, and stands before records it saw',
                )
            )
    for s in dropped:
        breaks.append(
            Break(
                'missing',
                s.seq,
                s.topic,
                s.partition,
                s.offset,
                f'{s.label}, which the checkpoint saw at offset {s.offset}, is not in the log',
                s.name,
            )
        )
    return breaks


def _trimmed(answer: SawAnswer, starts: Mapping[str, int | None]) -> bool:
    start = starts.get(answer.topic)
    return start is not None and start > answer.offset


def check_answers(answers: Iterable[Seen], by_seq: dict[int, list[Seen]], breaks: list[Break]) -> None:
    """Each answer answers a record of its run, as the projector's `EffectState.settle` reads them.

    A decision answers a `deferred` transition of its call, a resolution a `started` one (by
    `seq`); a `run_resumed` mark a run that ended waiting. An answer to a `seq` the trail lacks
    is `missing` where the trail has a gap there (or holds nothing) or has not ended, `inserted`
    beyond the end of an ended run.
    """
    top = max(by_seq, default=None)
    ends = [
        r for same in by_seq.values() for r in same if r.topic == STEP_EVENTS and r.kind in TERMINAL_KINDS
    ]
    for answer in answers:
        if answer.topic == STEP_EVENTS:
            if ends and all(r.kind != 'run_waiting' for r in ends):
                breaks.append(
                    break_at(answer, 'inserted', f'marks a run that ended {ends[0].kind}, not waiting')
                )
            continue
        answered = by_seq.get(answer.seq)
        if answered is None:
            if top is None or answer.seq < top or not ends:
                breaks.append(
                    break_at(answer, 'missing', f'answers seq {answer.seq}, which is not in the log')
                )
            else:
                breaks.append(
                    break_at(answer, 'inserted', f'answers nothing of the run: it ended at seq {top}')
                )
            continue
        what = answer.answer.what if answer.answer is not None else None
        if not any(
            r.topic == TOOL_EFFECTS and r.call == answer.call and what in ANSWERS.get(r.kind, ())
            for r in answered
        ):
            record = answered[0]
            held = (
                f'a {record.kind} transition of call {record.call}'
                if record.topic
                else f'a {record.kind} event'
            )
            breaks.append(
                break_at(answer, 'inserted', f'answers nothing of the run: seq {answer.seq} is {held}')
            )
