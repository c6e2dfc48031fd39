"""What the audit reads of a run's records (`Seen`), what it finds wrong (`Break`), how it names answers.

A run's trail is every record its writer appends with a `seq`. Beside it stand heartbeats, signed
heads, and answers (`ANSWER_KINDS`), which other processes write keyed by the run: a decision on a
deferred call or an operator's resolution (`resolved` transitions, whose `seq` names the `started`
or `deferred` transition they answer) and a resuming run's `run_resumed` mark
(docs/decisions/0061-answers-in-the-audit.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stepstream.schemas import DECISIONS, STEP_EVENTS, TOOL_EFFECTS

Problem = Literal['altered', 'missing', 'reordered', 'inserted', 'unsigned', 'unknown_key', 'bad_signature']
"""What is wrong with a record (docs/audit.md names each):

- `altered`: its bytes are not those the run's next record (or a signed head) links to; an
  answer not the one a checkpoint saw at its place;
- `missing`: records of the run's trail before it are not in the log; the record an answer
  answers is not, or an answer a checkpoint saw is not;
- `reordered`: it stands after a record of its run that its writer appended later;
- `inserted`: no writer of the run wrote it where it stands (a second record for one `seq`, a
  record keyed or placed as another run's, a link to nothing of this run, an answer to nothing
  of the run, or one a checkpoint did not see standing before records it saw);
- `unsigned`: no signed head of a trusted key covers it;
- `unknown_key`: the heads that cover it are signed by a key the verifier was not given;
- `bad_signature`: a signed head whose signature is not valid for what it states.
"""

TERMINAL_KINDS = frozenset({'run_completed', 'run_failed', 'run_cancelled', 'run_waiting'})
TOPIC_NAMES = ('step_events', 'tool_effects')
"""A topic's role as audits and checkpoints name it (not its name: a copy has another prefix)."""
NOT_THE_TRAIL = frozenset({'run_heartbeat', 'conversation_marked'})
"""Step event kinds keyed by a run that are neither its trail nor an answer, nor signed: a writer's
heartbeat, and a conversation's title or archived mark (decision 0062), which anyone may write."""
ANSWER_KINDS = frozenset({(TOOL_EFFECTS, 'resolved'), (STEP_EVENTS, 'run_resumed')})
"""(topic, kind) of the records another process writes beside a run's trail, keyed by the run:
decisions and resolutions, and resuming runs' marks."""


@dataclass(slots=True, frozen=True)
class Answer:
    """What a record beside the trail says, to name it: its decision or resolution, who, which call."""

    what: str | None
    """The `resolution` (a `Resolution` or a `Decision`); None for a `run_resumed` mark."""
    by: str | None
    """`resolved_by`: the operator or principal; for a `run_resumed` mark, the resuming run."""
    writer: str
    """The process that wrote it (`writer_id`)."""


@dataclass(slots=True, frozen=True)
class Seen:
    """One record of a run as the log holds it: where it stands and what the chain needs of it."""

    topic: int
    """`STEP_EVENTS` or `TOOL_EFFECTS`."""
    partition: int
    offset: int
    seq: int
    digest: str
    """`chain_hash` of the record as read."""
    prev_hash: str | None
    kind: str
    """The event kind, or the transition's status."""
    placed: bool = True
    """Keyed by its run id, in its run's partition."""
    signature: tuple[str, str] | None = None
    """A signed head's (key id, signature)."""
    linked: bool | None = None
    """Whether its schema version carries links (`schemas.is_linked`); None: unknown, read from the links."""
    call: str | None = None
    """A tool-effect transition's tool call id."""
    answer: Answer | None = None
    """An answer's (`ANSWER_KINDS`) content; its `seq` is the one it answers."""

    @property
    def answers(self) -> bool:
        """Written beside the trail by another process (`ANSWER_KINDS`)."""
        return (self.topic, self.kind) in ANSWER_KINDS


def describe(record: Seen) -> str:
    """An answer as a report names it: `the decision (approved by alice) answering seq 7 (call c-1)`."""
    answer = record.answer
    if answer is None or answer.what is None:
        by = f' of run {answer.by}' if answer is not None and answer.by else ''
        return f'the {record.kind} mark{by} written by {answer.writer if answer else "?"}'
    what = f'{answer_name(record)} ({answer.what} by {answer.by})'
    return f'the {what} answering seq {record.seq} (call {record.call})'


def answer_name(record: Seen) -> str:
    """`decision`, `resolution` or the mark's kind: what a break at an answer is about."""
    what = record.answer.what if record.answer is not None else None
    return record.kind if what is None else ('decision' if what in DECISIONS else 'resolution')


@dataclass(slots=True, frozen=True)
class Break:
    """One thing wrong with a run, at the record it is found at."""

    problem: Problem
    seq: int
    topic: str
    partition: int
    offset: int
    detail: str
    answer: str | None = None
    """For a break at an answer beside the trail: `decision`, `resolution` or the mark's kind."""

    def as_json(self) -> dict[str, object]:
        """The break as `audit verify --json` prints it."""
        return {
            'problem': self.problem,
            'seq': self.seq,
            'topic': self.topic,
            'partition': self.partition,
            'offset': self.offset,
            'detail': self.detail,
            'answer': self.answer,
        }


def break_at(record: Seen, problem: Problem, detail: str) -> Break:
    """A break at `record`; at an answer, its detail starts with what the answer is (`describe`)."""
    where = (record.seq, TOPIC_NAMES[record.topic], record.partition, record.offset)
    if record.answers:
        return Break(problem, *where, f'{describe(record)} {detail}', answer_name(record))
    return Break(problem, *where, detail)
