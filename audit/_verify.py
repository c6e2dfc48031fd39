"""`stepstream audit verify`: integrity and completeness of runs, from the topics alone.

Integrity: each run's records are exactly what its writer wrote (`verify_run`: the chain, the
order, the signatures), its answers (decisions, resolutions, marks) answer records of it and, against
a checkpoint, are those it saw (`compare_answers`), and the partitions hold nothing that is not a
record of ours. Completeness: nothing the checkpoint saw is missing (each partition's digest up to
the count it saw, each run's newest record then), and runs without an end are said to be open.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from stepstream.audit._answers import answers_of, compare_answers, covered
from stepstream.audit._chains import RunIntegrity, verify_run
from stepstream.audit._checkpoint import Checkpoint, PartitionState, RunHead
from stepstream.audit._read import Digest, PartitionRead, Unreadable, read_partitions
from stepstream.settings import Settings
from stepstream.signing import TrustedKeys

Completeness = Literal['complete', 'open', 'truncated', 'removed', 'trimmed', 'altered']
"""A run's completeness: `complete` (it ended, and holds what the checkpoint saw), `open` (no end
record yet), `truncated` (records the checkpoint saw at its end are gone), `removed` (the whole
run is gone), `trimmed` (gone with the start of its partition: retention or a deletion of the
partition's oldest records), `altered` (the record the checkpoint saw at its `seq` is another)."""
_FINE = ('complete', 'open')


@dataclass(slots=True)
class RunVerdict:
    """One run's two verdicts."""

    run_id: str
    integrity: RunIntegrity | None
    """None for a run the log no longer holds."""
    completeness: Completeness
    detail: str = ''

    def as_json(self) -> dict[str, Any]:
        """The run as `audit verify --json` prints it."""
        integrity = self.integrity
        first = integrity.first_break if integrity is not None else None
        return {
            'run_id': self.run_id,
            'integrity': {
                'ok': integrity is not None and integrity.ok,
                'chain': integrity.chain if integrity is not None else None,
                'records': integrity.records if integrity is not None else 0,
                'signed_through': integrity.signed_through if integrity is not None else None,
                'first_break': first.as_json() if first is not None else None,
                'breaks': len(integrity.breaks) if integrity is not None else 0,
                'answers': integrity.answers if integrity is not None else 0,
                'answer_breaks': [b.as_json() for b in integrity.answer_breaks]
                if integrity is not None
                else [],
            },
            'completeness': {
                'ok': self.completeness in _FINE,
                'verdict': self.completeness,
                'detail': self.detail,
            },
        }


@dataclass(slots=True)
class PartitionVerdict:
    """One topic partition against the checkpoint."""

    topic: str
    partition: int
    verdict: Literal['complete', 'truncated', 'diverged', 'trimmed', 'removed']
    detail: str

    def as_json(self) -> dict[str, Any]:
        """The partition as `audit verify --json` prints it."""
        return {
            'topic': self.topic,
            'partition': self.partition,
            'ok': self.verdict == 'complete',
            'verdict': self.verdict,
            'detail': self.detail,
        }


@dataclass(slots=True)
class AuditReport:
    """Everything `audit verify` found."""

    runs: list[RunVerdict] = field(default_factory=list)
    unreadable: list[Unreadable] = field(default_factory=list)
    partitions: list[PartitionVerdict] = field(default_factory=list)
    signatures_checked: bool = False
    checkpoint: str | None = None
    checkpoint_answers: bool | None = None
    """Whether the checkpoint lists answers (format 2): a format 1 one says nothing of them."""
    records: int = 0

    @property
    def integrity_ok(self) -> bool:
        """Every run's records are what its writer wrote, and nothing else is on the topics."""
        return not self.unreadable and all(r.integrity is None or r.integrity.ok for r in self.runs)

    @property
    def completeness_ok(self) -> bool:
        """Nothing the checkpoint saw is missing."""
        return all(p.verdict == 'complete' for p in self.partitions) and all(
            r.completeness in _FINE for r in self.runs
        )

    def as_json(self) -> dict[str, Any]:
        """`audit verify --json`: integrity and completeness as separate keys."""
        return {
            'ok': self.integrity_ok and self.completeness_ok,
            'records': self.records,
            'signatures_checked': self.signatures_checked,
            'checkpoint': self.checkpoint,
            'checkpoint_answers': self.checkpoint_answers,
            'integrity': {
                'ok': self.integrity_ok,
                'runs': sum(1 for r in self.runs if r.integrity is not None),
                'broken': [r.run_id for r in self.runs if r.integrity is not None and not r.integrity.ok],
                'unreadable': [
                    {'topic': u.topic, 'partition': u.partition, 'offset': u.offset, 'detail': u.detail}
                    for u in self.unreadable
                ],
            },
            'completeness': {
                'ok': self.completeness_ok,
                'open': [r.run_id for r in self.runs if r.completeness == 'open'],
                'missing': [r.run_id for r in self.runs if r.completeness not in _FINE],
                'partitions': [p.as_json() for p in self.partitions],
            },
            'runs': [r.as_json() for r in self.runs],
        }


async def audit_log(
    settings: Settings,
    *,
    keys: TrustedKeys | None = None,
    checkpoint: Checkpoint | None = None,
    run_id: str | None = None,
    conversation_id: str | None = None,
) -> AuditReport:
    """Verify the log at `settings`' topics: one run, one conversation's runs, or (neither) every run."""
    report = AuditReport(
        signatures_checked=keys is not None,
        checkpoint=checkpoint.taken_at if checkpoint else None,
        checkpoint_answers=None if checkpoint is None else checkpoint.answers is not None,
    )
    answers = checkpoint.answers if checkpoint is not None else None
    known = checkpoint.known() if checkpoint is not None and answers is not None else {}
    saw = {(p.topic, p.partition): p for p in checkpoint.partitions} if checkpoint is not None else {}
    heads = checkpoint.runs if checkpoint is not None else {}
    if run_id is not None:
        heads = {run_id: heads[run_id]} if run_id in heads else {}
    elif conversation_id is not None:
        heads = {}
    read_numbers: set[int] = set()
    async for read in read_partitions(
        settings, expected=checkpoint.expected() if checkpoint is not None else None, only=run_id
    ):
        read_numbers.add(read.partition)
        report.records += sum(d.count for d in read.digests.values())
        report.unreadable.extend(read.unreadable)
        for (topic, number), state in saw.items():
            if number == read.partition and run_id is None and conversation_id is None:
                report.partitions.append(_partition_verdict(state, read.digests.get(topic)))
        if answers is not None:
            found = {t: d.found for t, d in read.digests.items() if d.found is not None}
            reach = covered(read.runs, {t: k for (t, n), k in known.items() if n == read.partition}, found)
            starts = {t: d.start for t, d in read.digests.items()}
        for rid in _selected(read, run_id, conversation_id):
            integrity = verify_run(rid, read.runs[rid], keys)
            if answers is not None:
                theirs = [a for a in answers.get(rid, ()) if a.partition == read.partition]
                extra = compare_answers(theirs, answers_of(read.runs[rid]), starts, reach)
                integrity.breaks.extend(extra)
                if extra and integrity.chain == 'intact':
                    integrity.chain = 'broken'
            report.runs.append(_run_verdict(rid, integrity, heads.get(rid), read))
        for rid, head in heads.items():
            if rid not in read.runs and head.partition == read.partition:
                report.runs.append(_run_verdict(rid, None, head, read))
    if run_id is None and conversation_id is None:
        for topic, number in saw:
            if number not in read_numbers:
                report.partitions.append(
                    PartitionVerdict(topic, number, 'removed', 'the log has no such partition')
                )
    if run_id is not None and not report.runs:
        report.runs.append(RunVerdict(run_id, None, 'removed', 'the log holds no record of the run'))
    report.runs = _one_per_run(report.runs)
    return report


def _one_per_run(verdicts: list[RunVerdict]) -> list[RunVerdict]:
    """One verdict per run: its records found in another partition join its verdict as breaks."""
    merged: dict[str, RunVerdict] = {}
    for verdict in verdicts:
        kept = merged.setdefault(verdict.run_id, verdict)
        if kept is verdict:
            continue
        main, extra = sorted((kept, verdict), key=lambda v: -(v.integrity.records if v.integrity else -1))
        if main.integrity is not None and extra.integrity is not None:
            main.integrity.breaks.extend(extra.integrity.breaks)
            if extra.integrity.breaks:
                main.integrity.chain = 'broken'
        merged[verdict.run_id] = main
    return sorted(merged.values(), key=lambda r: r.run_id)


def _selected(read: PartitionRead, run_id: str | None, conversation_id: str | None) -> list[str]:
    if run_id is not None:
        return [run_id] if run_id in read.runs else []
    if conversation_id is not None:
        return [r for r in read.runs if read.conversations.get(r) == conversation_id]
    return list(read.runs)


def _run_verdict(
    run_id: str, integrity: RunIntegrity | None, head: RunHead | None, read: PartitionRead
) -> RunVerdict:
    """A run's completeness: its end, and what the checkpoint saw of it."""
    if head is not None:
        digest = read.digests.get(head.topic)
        trimmed = digest is not None and digest.start is not None and digest.start > head.offset
        held = integrity.digests.get(head.seq) if integrity is not None else None
        if held is None:
            if trimmed:
                return RunVerdict(
                    run_id,
                    integrity,
                    'trimmed',
                    f'the checkpoint saw it up to seq {head.seq} at {head.topic}/{head.partition} offset '
                    f'{head.offset}, and the partition now starts at offset '
                    f'{digest.start if digest else "?"}',
                )
            if integrity is None:
                return RunVerdict(
                    run_id,
                    None,
                    'removed',
                    f'the checkpoint saw its records up to seq {head.seq}; the log holds none of them',
                )
            top = integrity.head[0] if integrity.head is not None else -1
            return RunVerdict(
                run_id,
                integrity,
                'truncated',
                f'the checkpoint saw its records up to seq {head.seq}; the log holds them up to seq {top}',
            )
        if held != head.digest:
            return RunVerdict(
                run_id,
                integrity,
                'altered',
                f'its record at seq {head.seq} is not the one the checkpoint saw',
            )
    assert integrity is not None
    if integrity.ended:
        return RunVerdict(run_id, integrity, 'complete')
    return RunVerdict(
        run_id, integrity, 'open', 'the log holds no end record for it (it runs, or its writer died)'
    )


def _partition_verdict(state: PartitionState, digest: Digest | None) -> PartitionVerdict:
    """A topic partition against what the checkpoint saw of it."""
    where = (state.topic, state.partition)
    if digest is None:
        return PartitionVerdict(*where, 'removed', 'the log has no such partition')
    if state.count == 0:
        return PartitionVerdict(*where, 'complete', 'the checkpoint saw it empty')
    trimmed = digest.start is not None and digest.start > state.start
    if trimmed and digest.at_stop is None and digest.count < state.count:
        return PartitionVerdict(
            *where,
            'trimmed',
            f'it now starts at offset {digest.start}; the checkpoint saw it from offset {state.start}, '
            'and holds no mark of its digest the rest can be checked from',
        )
    if digest.at_stop is None:
        return PartitionVerdict(
            *where,
            'truncated',
            f'it holds {digest.count} records where the checkpoint saw {state.count} '
            f'(up to offset {state.end})',
        )
    if digest.at_stop[1] != state.digest:
        since = 0
        for count, end, mark in state.marks:
            if any(m[0] == count and m[2] == mark for m in digest.marks):
                since = end
        return PartitionVerdict(
            *where,
            'diverged',
            f'its first {state.count} records are not those the checkpoint saw: '
            f'they differ after offset {since}',
        )
    if trimmed:
        return PartitionVerdict(
            *where,
            'trimmed',
            f'the records before offset {digest.start} are gone (retention, or a deletion); '
            'the rest are those the checkpoint saw',
        )
    return PartitionVerdict(*where, 'complete', '')
