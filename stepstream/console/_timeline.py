"""A run's timeline: its step events in seq order, and each resolution and decision at its time.

An operator's resolution of a call in doubt (`stepstream resolve`) and a decision on a deferred call
(`approve`, `deny`, `complete`) are records of the tool-effects topic that take no seq of the run
(decisions 0022, 0056): the call's ledger keeps them. The timeline puts each after the transition
it answers (its `resolves_seq`) and after the events written before it, by the writers' clocks.
`stepstream events RUN` and the explorer's run page both build it here, so they show the same; a
terminal's line says one as `stepstream effects`' ledger does (`_render.answer_text`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Literal, Protocol, TypeVar

from stepstream.schemas import DECISIONS


class Answered(Protocol):
    """A ledger entry: `EffectResolution`, or the API's model of it."""

    @property
    def resolution(self) -> str: ...
    @property
    def resolved_by(self) -> str: ...
    @property
    def resolved_at(self) -> datetime: ...
    @property
    def resolves_seq(self) -> int: ...
    @property
    def note(self) -> str: ...
    @property
    def args(self) -> str | None: ...
    @property
    def result(self) -> str | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def applied(self) -> bool: ...


class Timed(Protocol):
    """A step event: `StepEvent`, or the API's model of it."""

    @property
    def seq(self) -> int: ...
    @property
    def timestamp(self) -> datetime: ...


A = TypeVar('A', bound=Answered)
A_co = TypeVar('A_co', bound=Answered, covariant=True)
E = TypeVar('E', bound=Timed)


class Ledgered(Protocol[A_co]):
    """A call's effect with its ledger: `ToolEffectRecord`, or the API's model of it."""

    @property
    def tool_call_id(self) -> str: ...
    @property
    def tool_name(self) -> str: ...
    @property
    def resolutions(self) -> Sequence[A_co]: ...


@dataclass(frozen=True, slots=True)
class Answer(Generic[A]):
    """A resolution or a decision in a run's timeline: the call it answers, and the ledger's entry."""

    tool_call_id: str
    tool_name: str
    answer: A

    @property
    def kind(self) -> Literal['decision', 'resolution']:
        """`decision` (on a deferred call) or `resolution` (of a call in doubt)."""
        return 'decision' if self.answer.resolution in DECISIONS else 'resolution'

    @property
    def timestamp(self) -> datetime:
        """When it was written (its writer's clock)."""
        return self.answer.resolved_at


def other_topic_seqs(
    events: Iterable[Timed | Answer[Any]], last_seq: int, gaps: Iterable[tuple[int, int]] = ()
) -> list[int]:
    """The seqs up to `last_seq` that a timeline's step events skip: its tool calls' records.

    A run's seq counts its records on both topics; the tool-effects topic's transitions (a call
    started, ended) take numbers the step events then skip. Those that never arrived (`gaps`,
    the run's `RunRecord.gaps`) are not counted here. Resolutions and decisions take no seq.
    """
    shown = {e.seq for e in events if not isinstance(e, Answer)}
    lost = {seq for first, last in gaps for seq in range(first, last + 1)}
    return [seq for seq in range(last_seq + 1) if seq not in shown and seq not in lost]


def seq_note(skipped: Sequence[int], where: str) -> str:
    """The line under a timeline that skips `skipped`, pointing `where` they are shown ('' when none)."""
    if not skipped:
        return ''
    more = f' and {len(skipped) - 8} more' if len(skipped) > 8 else ''
    shown = ', '.join(str(seq) for seq in skipped[:8]) + more
    said = (
        f"the number not listed ({shown}) is a tool call's record"
        if len(skipped) == 1
        else f"the numbers not listed ({shown}) are its tool calls' records"
    )
    return f"seq counts the run's records on both topics: {said} on the tool-effects topic; {where}"


def timeline(events: Sequence[E], effects: Iterable[Ledgered[A]]) -> list[E | Answer[A]]:
    """`events` (in seq order) with every entry of `effects`' ledgers among them, at its time.

    An entry comes after the events up to the transition it answers, and after those that follow
    written no later than it; entries at one place are in the order they were written.
    """
    seqs = [e.seq for e in events]

    def place(answer: Answer[A]) -> int:
        at = bisect.bisect_right(seqs, answer.answer.resolves_seq)
        while at < len(events) and events[at].timestamp <= answer.timestamp:
            at += 1
        return at

    answers = [Answer(e.tool_call_id, e.tool_name, r) for e in effects for r in e.resolutions]
    placed = sorted(((place(a), a) for a in answers), key=lambda p: (p[0], p[1].timestamp))
    out: list[E | Answer[A]] = []
    waiting = iter(placed)
    following = next(waiting, None)
    for index in range(len(events) + 1):
        while following is not None and following[0] == index:
            out.append(following[1])
            following = next(waiting, None)
        if index < len(events):
            out.append(events[index])
    return out
