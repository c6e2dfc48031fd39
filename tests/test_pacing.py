"""`TopicPacer`: tool effects are applied no earlier than the step events fetched beside them.

Unit tests on plain records (the fast tier), and one end to end: a log whose tool effects are
all stamped a day after their step events, so that the pacer holds every one of them back while
step events remain, gives the projection the same log with its own stamps gives (the step events
are restamped a day earlier: brokers refuse timestamps far in the future). Every other
projector test runs the pacer against a real broker too, and tests/test_apply_properties.py
shows the projection does not depend on the order of the two topics.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka.structs import TopicPartition
from pydantic_ai import Agent

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.projector._pacing import TopicPacer
from stepstream.storage import Shard, shard_paths
from stepstream.topics import Position

from agents import calls_then_answers
from log_copy import copy_log

DAY_MS = 86_400_000

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


@pytest.mark.fast
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


@pytest.mark.fast
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


@pytest.mark.fast
def test_held_records_go_when_no_step_event_comes() -> None:
    pacer = TopicPacer(EVENTS, EFFECTS, patience_s=0)
    out = pacer.pace({ev(0): recs(0, 1), fx(0): recs(0, 1, 2)}, behind, lambda tp: 0)
    assert offsets(out) == {ev(0): [0], fx(0): [0]}
    out = pacer.pace({}, behind, lambda tp: 0)  # a round without a step event of partition 0
    assert offsets(out) == {fx(0): [1]}
    assert pacer.holding == set()


@pytest.mark.fast
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


async def restamped(settings: Settings, copy: Settings, end: Position) -> Position:
    """The log up to `end` again in `copy`'s topics, each record in its partition and order, the
    step events stamped a day earlier than they were (so every tool effect is a day ahead)."""
    written = await copy_log(
        settings,
        copy,
        end,
        stamp=lambda tp, m: (
            m.timestamp if tp.topic == settings.topics.tool_effects_topic else m.timestamp - DAY_MS
        ),
    )
    assert written == {
        TopicPartition(
            copy.topics.tool_effects_topic
            if tp.topic == settings.topics.tool_effects_topic
            else copy.topics.step_events_topic,
            tp.partition,
        ): offset
        for tp, offset in end.items()
    }
    return written


def logical(root: Path) -> dict[int, list[tuple[bytes, bytes]]]:
    """Every shard's logical content (offsets, progress and identity left out), by partition."""
    found = {}
    with tempfile.TemporaryDirectory() as scratch:
        for partition, path in shard_paths(root).items():
            shard = Shard.open_read_only(path, Path(scratch) / str(partition))
            try:
                found[partition] = list(shard.logical_items())
            finally:
                shard.close()
    return found


@pytest.mark.broker
async def test_effects_stamped_after_every_step_event_are_held_then_applied_the_same(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    for n in range(8):
        run_id = f'paced-{n:08x}'
        agent: Agent[Any, str] = Agent(
            calls_then_answers('work', 3), capabilities=[StepPersistence(log=event_log, run_id=run_id)]
        )

        @agent.tool_plain
        def work() -> str:
            return 'done'

        await agent.run(f'task {n}')
    end = await event_log.flush()
    copy = settings.replace(topic_prefix=f'{settings.topics.topic_prefix}-late')
    late_end = await restamped(settings, copy, end)
    assert sum(o for tp, o in late_end.items() if tp.topic == copy.topics.tool_effects_topic) > 0

    # A few records a round, so step events remain behind while the late effects are fetched.
    async with Projector(settings, db_path=tmp_path / 'own', max_batch_records=7) as own:
        await own.wait_for(end, timeout=60)
    async with Projector(copy, db_path=tmp_path / 'late', max_batch_records=7) as late:
        await late.wait_for(late_end, timeout=60)
        assert (late.dead_lettered, late.duplicates_ignored) == (0, 0)
        assert late.records_applied == sum(late_end.values())
    expected = logical(tmp_path / 'own')
    assert sum(len(items) for items in expected.values()) > 0
    assert logical(tmp_path / 'late') == expected
