"""Answers in the audit: decisions, operators' resolutions and resuming runs' marks (audit/_answers.py).

Pure, over `Seen` lists as tests/test_audit_chains.py: a run that paused (a call in doubt, a call
waiting for an approval, `run_waiting`) and its answers, written by other processes beside its
trail. Proved here, with no broker:

- untouched answers verify, a resent one counts once; each answer that answers nothing of its run
  is named `inserted` (a seq that is an event, another call's transition, a decision answering a
  `started` transition or a resolution a `deferred` one, a seq beyond an ended run, a mark on a
  run that did not end waiting), one placed as another run's too; one whose record is not in the
  log is `missing`;
- against a checkpoint: a dropped answer is `missing` (unless trimmed away), a forged one before
  what the checkpoint saw `inserted`, a changed one `altered`, each named as a decision, a
  resolution or a mark; answers written after the checkpoint are not breaks, and a copy with
  shifted offsets verifies (a property over any drops and shifts);
- a checkpoint of format 2 round-trips its answers through its signed file; one of format 1 still
  loads, and lists none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepstream.audit import Checkpoint, Seen, verify_run
from stepstream.audit._answers import SawAnswer, answers_of, compare_answers, covered
from stepstream.audit._checkpoint import PartitionState, RunHead
from stepstream.audit._records import Answer, Break
from stepstream.signing import Signer, TrustedKeys

pytestmark = pytest.mark.fast

RUN = 'run-paused'


def digest_of(*parts: object) -> str:
    return hashlib.sha256('/'.join(map(str, parts)).encode()).hexdigest()


def trail(end: str = 'run_waiting') -> list[Seen]:
    """seq 0 run_started, 1 started (call c-1, in doubt), 2 deferred (call c-2), 3 its end; chained."""
    shape = [(0, 'run_started', None), (1, 'started', 'c-1'), (1, 'deferred', 'c-2'), (0, end, None)]
    records: list[Seen] = []
    previous = None
    for seq, (topic, kind, call) in enumerate(shape):
        digest = digest_of(RUN, seq)
        records.append(Seen(topic, 0, 10 + seq, seq, digest, previous, kind, call=call))
        previous = digest
    return records


def decision(
    seq: int = 2, *, what: str = 'approved', by: str = 'alice', call: str = 'c-2', offset: int = 20
) -> Seen:
    answer = Answer(what, by, 'stepstream-cli@host:1')
    return Seen(
        1,
        0,
        offset,
        seq,
        digest_of('answer', what, by, seq, call),
        None,
        'resolved',
        call=call,
        answer=answer,
    )


def resolution(seq: int = 1, *, what: str = 'happened', by: str = 'bob', offset: int = 21) -> Seen:
    return decision(seq, what=what, by=by, call='c-1', offset=offset)


def mark(offset: int = 22, writer: str = 'worker-2') -> Seen:
    return Seen(
        0, 0, offset, 0, digest_of('mark', writer), None, 'run_resumed', answer=Answer(None, None, writer)
    )


def answer_breaks(seen: list[Seen]) -> list[tuple[str, str | None, str]]:
    result = verify_run(RUN, seen, None)
    assert all(b.answer is not None for b in result.breaks), result.breaks
    return [(b.problem, b.answer, b.detail) for b in result.breaks]


# 1. Without a checkpoint: each answer answers a record of its run.


def test_answers_that_answer_their_run_verify_and_a_resent_one_counts_once() -> None:
    seen = [*trail(), decision(), resolution(), mark(), dataclasses.replace(decision(), offset=30)]
    result = verify_run(RUN, seen, None)
    assert result.breaks == [] and result.chain == 'intact'
    assert result.answers == 3 and result.records == 4  # answers are not of the trail
    assert result.head == (3, digest_of(RUN, 3))


@pytest.mark.parametrize(
    ('answer', 'named', 'detail'),
    [
        (
            decision(0),
            'decision',
            'answering seq 0 (call c-2) answers nothing of the run: seq 0 is a run_started event',
        ),
        (decision(call='c-1'), 'decision', 'seq 2 is a deferred transition of call c-2'),
        (
            decision(1, call='c-1'),
            'decision',
            'seq 1 is a started transition of call c-1',
        ),  # a decision, in doubt
        (resolution(2), 'resolution', 'seq 2 is a deferred transition of call c-2'),  # a resolution, waiting
        (decision(9), 'decision', 'answers nothing of the run: it ended at seq 3'),
    ],
    ids=['an-event', 'another-call', 'decision-for-started', 'resolution-for-deferred', 'after-the-end'],
)
def test_an_answer_to_nothing_of_its_run_is_inserted(answer: Seen, named: str, detail: str) -> None:
    [(problem, kind, text)] = answer_breaks([*trail(), answer])
    assert (problem, kind) == ('inserted', named)
    assert text.startswith(f'the {named} (') and detail in text, text


def test_an_answer_placed_as_another_runs_is_inserted_and_named() -> None:
    [(problem, kind, text)] = answer_breaks([*trail(), dataclasses.replace(decision(), placed=False)])
    assert (problem, kind) == ('inserted', 'decision')
    assert (
        text == "the decision (approved by alice) answering seq 2 (call c-2) keyed or placed as another run's"
    )


def test_a_mark_on_a_run_that_did_not_end_waiting_is_inserted() -> None:
    [(problem, kind, text)] = answer_breaks([*trail('run_completed'), mark()])
    assert (problem, kind) == ('inserted', 'run_resumed')
    assert (
        text == 'the run_resumed mark written by worker-2 marks a run that ended run_completed, not waiting'
    )
    assert answer_breaks([*trail(), mark()]) == []


def test_an_answer_whose_record_is_not_in_the_log_is_missing() -> None:
    whole = trail()
    gap = verify_run(RUN, [whole[0], whole[1], whole[3], decision()], None)
    assert ('missing', 'decision') in {(b.problem, b.answer) for b in gap.breaks}  # and the gap itself
    open_run = answer_breaks([*whole[:2], decision()])  # not ended: its tail may be cut
    assert open_run == [
        (
            'missing',
            'decision',
            'the decision (approved by alice) answering seq 2 (call c-2) '
            'answers seq 2, which is not in the log',
        )
    ]
    assert [p for p, *_ in answer_breaks([resolution()])] == ['missing']  # no record of the run at all


# 2. Against a checkpoint: what it saw is still there, by content.

HELD = [resolution(offset=21), decision(offset=25), mark(offset=26)]
SAW = [SawAnswer.of(s) for s in HELD]
STARTS = {'step_events': 0, 'tool_effects': 0}
REACH = {'step_events': 40, 'tool_effects': 40}


def compared(
    held: list[Seen], reach: dict[str, int] = REACH, starts: dict[str, int | None] = STARTS
) -> list[Break]:
    return compare_answers(SAW, answers_of(held), starts, reach)


def test_answers_the_checkpoint_saw_verify_and_later_ones_are_not_breaks() -> None:
    assert compared(HELD) == []
    later = decision(what='denied', by='carol', offset=41)  # a late decision, written after the checkpoint
    assert compared([*HELD, later]) == []


def test_a_dropped_answer_is_missing_unless_trimmed_away() -> None:
    [found] = compared([HELD[0], HELD[2]])
    assert (found.problem, found.answer, found.seq, found.offset) == ('missing', 'decision', 2, 25)
    assert found.detail == (
        'the decision (approved by alice) answering seq 2 (call c-2), which the checkpoint saw at offset 25, '
        'is not in the log'
    )
    assert compared([HELD[2]], starts={'step_events': 0, 'tool_effects': 30}) == []  # retention took them
    [dropped_mark] = compared(HELD[:2])
    assert (dropped_mark.problem, dropped_mark.answer) == ('missing', 'run_resumed')


def test_a_forged_answer_before_what_the_checkpoint_saw_is_inserted() -> None:
    forged = decision(1, what='approved', by='mallory', call='c-1', offset=23)
    [found] = compared([*HELD, forged])
    assert (found.problem, found.answer, found.offset) == ('inserted', 'decision', 23)
    assert found.detail.startswith(
        'the decision (approved by mallory) answering seq 1 (call c-1) is not among'
    )


def test_a_changed_answer_is_altered_and_names_both() -> None:
    changed = decision(what='denied', by='mallory', offset=25)
    [found] = compared([HELD[0], changed, HELD[2]])
    assert (found.problem, found.answer, found.seq) == ('altered', 'decision', 2)
    assert found.detail == (
        'the decision (denied by mallory) answering seq 2 (call c-2) is not the one the checkpoint saw: '
        'the decision (approved by alice) answering seq 2 (call c-2)'
    )


def test_how_far_a_checkpoint_reaches_is_found_by_content() -> None:
    heads = {'step_events': {digest_of(RUN, 3)}, 'tool_effects': {HELD[1].digest}}
    shifted = [dataclasses.replace(s, offset=s.offset - 5) for s in [*trail(), *HELD]]
    assert covered({RUN: shifted}, heads, {}) == {'step_events': 8, 'tool_effects': 20}
    assert covered({RUN: shifted}, heads, {'tool_effects': 33}) == {'step_events': 8, 'tool_effects': 33}


EXAMPLES = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@EXAMPLES
@given(
    n=st.integers(1, 12),
    data=st.data(),
    shift=st.integers(-20, 20),
)
def test_a_copy_with_any_answers_dropped_names_exactly_those(n: int, data: st.DataObject, shift: int) -> None:
    """Offsets shifted (a copy), some answers dropped: those and only those are `missing`."""
    held = [decision(i + 100, by=f'op-{i}', call=f'c-{i}', offset=50 + 2 * i) for i in range(n)]
    saw = [SawAnswer.of(s) for s in held]
    dropped = data.draw(st.sets(st.integers(0, n - 1)))
    copy = [dataclasses.replace(s, offset=s.offset + shift) for i, s in enumerate(held) if i not in dropped]
    found = compare_answers(saw, answers_of(copy), {'tool_effects': 0}, {'tool_effects': 1_000})
    assert sorted((b.problem, b.seq) for b in found) == sorted(('missing', i + 100) for i in dropped)


# 3. The checkpoint file.


def signer() -> tuple[Signer, TrustedKeys]:
    private = Ed25519PrivateKey.generate()
    made = Signer.from_pem(private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    return made, TrustedKeys({made.key_id: private.public_key()})


def checkpoint(answers: dict[str, tuple[SawAnswer, ...]] | None) -> Checkpoint:
    last = None if answers is None else (120, digest_of('last'))
    partitions = (PartitionState('tool_effects', 0, 0, 30, 30, digest_of('p'), (), last),)
    heads = {RUN: RunHead(3, digest_of(RUN, 3), 'step_events', 0, 13)}
    return Checkpoint('2026-12-05T00:00:00+00:00', partitions, heads, '', '', answers)


def test_a_checkpoint_keeps_its_answers_and_one_of_format_1_still_loads(tmp_path: Path) -> None:
    made, keys = signer()
    current = checkpoint({RUN: tuple(SAW)}).signed(made)
    path = tmp_path / 'now.json'
    path.write_text(current.to_json())
    loaded = Checkpoint.load(path, keys)
    assert loaded == current and loaded.format == 2 and loaded.answers == {RUN: tuple(SAW)}
    assert loaded.expected()[('tool_effects', 0)].last == (120, digest_of('last'))
    assert loaded.known()[('tool_effects', 0)] == {SAW[0].digest, SAW[1].digest}

    old = checkpoint(None).signed(made)
    body = json.loads(old.to_json())
    assert (
        body['stepstream_checkpoint'] == 1 and 'answers' not in body and 'last' not in body['partitions'][0]
    )
    path = tmp_path / 'old.json'
    path.write_text(old.to_json())
    loaded = Checkpoint.load(path, keys)
    assert loaded.format == 1 and loaded.answers is None

    tampered = json.loads(current.to_json())
    tampered['answers'][RUN].pop()
    path.write_text(json.dumps(tampered))
    with pytest.raises(ValueError, match='signature is not valid'):
        Checkpoint.load(path, keys)


def test_a_conversation_mark_is_not_the_runs_record_nor_an_answer() -> None:
    """Anyone may title or archive a conversation (decision 0062): its mark, keyed by a run at seq 0,
    is neither a second record at seq 0 nor counted as the run's."""
    marked = Seen(0, 0, 40, 0, digest_of('conversation', 'title'), None, 'conversation_marked')
    result = verify_run(RUN, [*trail(), marked], None)
    assert result.breaks == [] and result.chain == 'intact'
    assert (result.records, result.answers) == (4, 0)
