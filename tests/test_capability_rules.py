"""The capability's rules against `InMemoryLog`: no broker, milliseconds per test.

The same rules are proven end to end on the real stack (test_capability.py, test_producer.py,
test_media_e2e.py); here they are checked directly on the records the capability appends.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter

from stepstream import Settings, StepStreamUnavailable
from stepstream.media import DiskMediaStore, restore_media
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.schemas import StepEvent, ToolEffectTransition, apply_patch

from agents import calls_then_answers

pytestmark = [pytest.mark.fast, pytest.mark.once]


def snapshots(log: InMemoryLog, run_id: str) -> list[StepEvent]:
    return [
        r.record
        for r in log.records
        if isinstance(r.record, StepEvent) and r.record.run_id == run_id and r.record.snapshot is not None
    ]


async def histories(
    log: InMemoryLog, run_id: str, store: DiskMediaStore | None = None
) -> list[list[ModelMessage]]:
    """Every snapshot's full history, rebuilt from the deltas as the reader does."""
    history: list[ModelMessage] = []
    out = []
    for event in snapshots(log, run_id):
        delta = event.snapshot
        assert delta is not None
        if delta.patch is not None:
            apply_patch(history, delta.patch)
        del history[delta.prefix_len :]
        tail = ModelMessagesTypeAdapter.validate_json(delta.messages)
        history.extend(await restore_media(tail, store) if store is not None else tail)
        out.append(list(history))
    return out


def round_trip(messages: list[ModelMessage]) -> list[ModelMessage]:
    return ModelMessagesTypeAdapter.validate_json(ModelMessagesTypeAdapter.dump_json(messages))


@pytest.fixture
def store(tmp_path: Path) -> DiskMediaStore:
    return DiskMediaStore(tmp_path / 'media')


async def test_a_run_appends_its_trail_in_seq_order_on_one_partition(store: DiskMediaStore) -> None:
    log = InMemoryLog(Settings(partitions=3))
    agent = Agent(
        calls_then_answers('lookup', calls=2),
        capabilities=[StepPersistence(log=log, run_id='r1', media_store=store)],
    )

    @agent.tool_plain
    def lookup() -> str:
        return 'found'

    await agent.run('go')
    await log.flush()
    records = [r for r in log.records if r.record.run_id == 'r1']
    assert [r.record.seq for r in records] == list(range(len(records)))
    assert len({r.partition for r in records}) == 1
    assert {r.topic for r in records} == {
        log.settings.topics.step_events_topic,
        log.settings.topics.tool_effects_topic,
    }
    kinds = [r.record.kind if isinstance(r.record, StepEvent) else r.record.status for r in records]
    assert kinds[0] == 'run_started' and kinds[-1] == 'run_completed'
    assert kinds.index('started') < kinds.index('tool_call_started') < kinds.index('completed')


async def test_started_is_acknowledged_before_the_tool_body_runs(store: DiskMediaStore) -> None:
    log = InMemoryLog()
    ran = asyncio.Event()
    agent = Agent(
        calls_then_answers('act'), capabilities=[StepPersistence(log=log, run_id='w', media_store=store)]
    )

    @agent.tool_plain
    def act() -> str:
        ran.set()
        return 'done'

    run = asyncio.create_task(agent.run('go'))
    await log.wait_for_record(lambda r: r.run_id == 'w')  # run_started is stored...
    log.hold_acks()  # ...and from now on the "broker" stores but does not acknowledge
    started = await log.wait_for_record(
        lambda r: isinstance(r, ToolEffectTransition) and r.status == 'started'
    )
    await asyncio.sleep(0)  # give a wrongly scheduled tool body every chance to run
    assert not ran.is_set() and not run.done()
    log.release_acks()
    await run
    assert ran.is_set() and started.record.tool_name == 'act'


async def test_a_log_that_does_not_acknowledge_fails_the_run_before_the_tool(store: DiskMediaStore) -> None:
    log = InMemoryLog(Settings(ack_timeout_s=0.2))
    ran = asyncio.Event()
    agent = Agent(
        calls_then_answers('act'), capabilities=[StepPersistence(log=log, run_id='u', media_store=store)]
    )

    @agent.tool_plain
    def act() -> str:
        ran.set()
        return 'done'

    log.hold_acks()
    with pytest.raises(StepStreamUnavailable, match='did not acknowledge'):
        await agent.run('go')
    assert not ran.is_set()


def _event(run_id: str, seq: int) -> StepEvent:
    return StepEvent(run_id=run_id, seq=seq, writer_id='w', timestamp=datetime.now(UTC), kind='run_started')


async def test_in_memory_acknowledgements_come_after_storing_in_order_and_only_when_not_held() -> None:
    log = InMemoryLog(Settings(ack_timeout_s=0.1))
    first = [await log.append(_event('m', seq)) for seq in range(3)]
    assert not any(ack.done() for ack in first)  # stored, acknowledged on the next loop turn
    assert [r.offset for r in log.records] == [0, 1, 2]
    await log.wait_acked(first)
    assert [ack.result().offset for ack in first] == [0, 1, 2]

    stored_before_hold = [await log.append(_event('m', seq)) for seq in range(3, 5)]
    log.hold_acks()  # records stored before the hold are still acknowledged with their turn
    held = await log.append(_event('m', 5))
    await log.wait_acked(stored_before_hold)
    assert all(ack.done() for ack in stored_before_hold) and not held.done()
    with pytest.raises(StepStreamUnavailable, match='did not acknowledge 1 record'):
        await log.wait_acked([*stored_before_hold, held])
    log.release_acks()
    await log.wait_acked([held])
    assert held.result().offset == 5

    cancelled = await log.append(_event('m', 6))
    cancelled.cancel()
    with pytest.raises(StepStreamUnavailable, match='cancelled'):
        await log.wait_acked([cancelled])


async def test_each_message_is_sent_once_and_stamps_travel_as_patches(store: DiskMediaStore) -> None:
    log = InMemoryLog()
    agent = Agent(
        calls_then_answers('lookup', calls=5),
        instructions='be brief',
        capabilities=[StepPersistence(log=log, run_id='p', media_store=store)],
    )

    @agent.tool_plain
    def lookup() -> str:
        return 'r' * 500

    result = await agent.run('go', conversation_id='conv-p')
    saved = await histories(log, 'p')
    assert saved[-1] == round_trip(result.all_messages())
    sent = sum(
        len(ModelMessagesTypeAdapter.validate_json(e.snapshot.messages))
        for e in snapshots(log, 'p')
        if e.snapshot
    )
    assert sent == len(result.all_messages())  # not one message re-sent for its stamps
    assert sum(1 for e in snapshots(log, 'p') if e.snapshot and e.snapshot.patch) >= 4


async def test_large_values_go_to_the_media_store_before_the_record(store: DiskMediaStore) -> None:
    log = InMemoryLog()
    agent = Agent(
        calls_then_answers('export', args={'query': 'q' * 100_000}),
        capabilities=[StepPersistence(log=log, run_id='m', media_store=store, media_threshold_bytes=4096)],
    )

    @agent.tool_plain
    def export(query: str) -> dict[str, object]:
        return {'rows': [{'id': i, 'text': 't' * 200} for i in range(200)], 'blob': 'b' * 10_000}

    result = await agent.run('x' * 20_000)
    assert max(len(r.value) for r in log.records) < 4096
    assert (await histories(log, 'm', store))[-1] == round_trip(result.all_messages())


def test_the_threshold_must_stay_below_the_record_limit() -> None:
    with pytest.raises(ValueError, match='must stay below the record limit'):
        StepPersistence(log=InMemoryLog(max_record_bytes=1000), media_threshold_bytes=1000)
