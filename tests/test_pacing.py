"""`TopicPacer`: tool effects are applied no earlier than the step events fetched beside them.

Unit tests on plain records (the fast tier); every projector test runs the pacer against a real
broker, and tests/test_apply_properties.py shows the projection does not depend on the order.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiokafka.structs import TopicPartition

from stepstream.projector._pacing import TopicPacer

EVENTS, EFFECTS = 'ev', 'fx'


@dataclass
class Rec:
    offset: int
    timestamp: int


def recs(first: int, *timestamps: int) -> list[Rec]:
    return [Rec(first + i, ts) for i, ts in enumerate(timestamps)]


def ev(p: int) -> TopicPartition:
    return TopicPartition(EVENTS, p)


def fx(p: int) -> TopicPartition:
    return TopicPartition(EFFECTS, p)


def behind(tp: TopicPartition) -> int | None:
    """The high watermark of a log far from caught up."""
    return 1_000_000


def offsets(batch: dict[TopicPartition, list[Rec]]) -> dict[TopicPartition, list[int]]:
    return {tp: [r.offset for r in records] for tp, records in batch.items()}


def test_effects_ahead_wait_for_the_step_events_and_come_after_them() -> None:
    pacer = TopicPacer(EVENTS, EFFECTS, patience_s=3600)
    out = pacer.pace({fx(0): recs(0, 10, 20, 30, 40), ev(0): recs(0, 5, 25)}, behind, lambda tp: 0)
    assert list(out) == [ev(0), fx(0)]  # step events first, whatever order they came in
    assert offsets(out) == {ev(0): [0, 1], fx(0): [0, 1]}  # a prefix: offsets stay contiguous
    assert pacer.holding == {fx(0)}
    out = pacer.pace({ev(0): recs(2, 35)}, behind, lambda tp: 0)
    assert offsets(out) == {ev(0): [2], fx(0): [2]}
    out = pacer.pace({ev(0): recs(3, 50), fx(0): recs(4, 45)}, behind, lambda tp: 0)
    assert offsets(out) == {ev(0): [3], fx(0): [3, 4]}  # the held one, then the new one, in order
    assert pacer.holding == set()


def test_nothing_waits_once_the_step_events_are_caught_up() -> None:
    pacer = TopicPacer(EVENTS, EFFECTS, patience_s=3600)
    ends = {ev(0): 2, ev(1): None}
    out = pacer.pace({ev(0): recs(0, 1, 2), fx(0): recs(0, 9, 10)}, ends.get, {ev(0): 2}.get)
    assert offsets(out) == {ev(0): [0, 1], fx(0): [0, 1]}
    # A partition with no step events fetched: caught up when the consumer stands at its end.
    out = pacer.pace({fx(2): recs(7, 3)}, {ev(2): 4}.get, {ev(2): 4}.get)
    assert offsets(out) == {fx(2): [7]}
    # Not caught up while the position is unknown.
    out = pacer.pace({fx(3): recs(0, 3)}, {ev(3): 4}.get, {}.get)
    assert offsets(out) == {}


def test_held_records_go_when_no_step_event_comes() -> None:
    pacer = TopicPacer(EVENTS, EFFECTS, patience_s=0)
    out = pacer.pace({ev(0): recs(0, 1), fx(0): recs(0, 1, 2)}, behind, lambda tp: 0)
    assert offsets(out) == {ev(0): [0], fx(0): [0]}
    out = pacer.pace({}, behind, lambda tp: 0)  # a round without a step event of partition 0
    assert offsets(out) == {fx(0): [1]}
    assert pacer.holding == set()


def test_dropped_records_are_forgotten() -> None:
    pacer = TopicPacer(EVENTS, EFFECTS, patience_s=3600)
    pacer.pace(
        {ev(0): recs(0, 1), fx(0): recs(0, 5), ev(1): recs(0, 1), fx(1): recs(0, 5)}, behind, lambda tp: 0
    )
    assert pacer.holding == {fx(0), fx(1)}
    pacer.drop([0])
    assert pacer.holding == {fx(1)}
    pacer.drop()
    assert pacer.holding == set()
    # After a drop the step events' progress is forgotten too: nothing fetched of them, nothing released.
    out = pacer.pace({fx(1): recs(0, 5)}, behind, lambda tp: 0)
    assert offsets(out) == {}
