"""Hostile records mixed into genuine agent traffic, end to end: the projector never stops.

Genuine runs are written by real agents while a few hundred hostile records of every class go
to the same topics and the projector service is SIGKILLed and restarted. At the end it is
alive, every genuine run is exactly what a log without the hostile records gives, every record
that cannot apply is in the DLQ with its reason, and the live projection equals a clean rebuild.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition
from pydantic_ai import Agent

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import rebuild, verify_paths
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import ModelUsage, StepEvent, ToolEffectTransition, encode
from stepstream.topics import Position, murmur2_partition

from agents import calls_then_answers
from log_copy import copy_log
from waits import wait_applied

pytestmark = pytest.mark.broker

NOW = datetime(2026, 11, 30, tzinfo=UTC)
Coordinates = tuple[str, int, int]
WRONG_PARTITION = -1


async def genuine_run(log: EventLog, run_id: str, calls: int) -> None:
    agent = Agent(calls_then_answers('work', calls), capabilities=[StepPersistence(log=log, run_id=run_id)])

    @agent.tool_plain
    def work() -> str:
        return f'worked for {run_id}'

    await agent.run(f'task of {run_id}', conversation_id=f'conv-{run_id}')


async def owners(settings: Settings, run_ids: set[str]) -> dict[str, str]:
    """The writer id of each run's `run_started`, read back from the log as an attacker could."""
    from stepstream.schemas import decode

    consumer = AIOKafkaConsumer(
        settings.topics.step_events_topic,
        bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset='earliest',
    )
    await consumer.start()
    found: dict[str, str] = {}
    try:
        while set(found) != run_ids:
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                for message in batch:
                    record = decode(message.value)
                    if isinstance(record, StepEvent) and record.kind == 'run_started':
                        found.setdefault(record.run_id, record.writer_id)
    finally:
        await consumer.stop()
    return found


class Attacker:
    """Writes hostile records with a plain Kafka producer and remembers where each landed."""

    def __init__(self, settings: Settings, owners: dict[str, str]) -> None:
        self.settings = settings
        self.owners = owners
        self.rng = random.Random(5)
        self.refused: set[Coordinates] = set()
        """Records that cannot apply: each must reach the DLQ."""
        self.accepted: set[Coordinates] = set()
        """Hostile records that apply (kept apart, parked, or a hostile run of its own)."""
        self.position: Position = {}

    def plan(self) -> list[tuple[str, str, bytes | None, bytes | None, int | None]]:
        """(expectation, topic, key, value, partition) of every hostile record, shuffled."""
        s, rng = self.settings, self.rng
        events, effects = s.topics.step_events_topic, s.topics.tool_effects_topic
        genuine = sorted(self.owners)
        plan: list[tuple[str, str, bytes | None, bytes | None, int | None]] = []

        def ev(
            run_id: str, seq: int, writer: str, kind: str = 'model_request_started', **kw: object
        ) -> bytes:
            return encode(StepEvent(run_id=run_id, seq=seq, writer_id=writer, timestamp=NOW, kind=kind, **kw))  # type: ignore[arg-type]

        def fx(run_id: str, seq: int, writer: str, status: str = 'started', call: str = 'c1') -> bytes:
            return encode(
                ToolEffectTransition(
                    run_id=run_id,
                    seq=seq,
                    writer_id=writer,
                    timestamp=NOW,
                    tool_call_id=call,
                    tool_name='evil',
                    status=status,  # type: ignore[arg-type]
                )
            )

        for i in range(20):
            run = rng.choice(genuine)
            owner = self.owners[run]
            plan += [
                ('refused', events, run.encode(), b'not avro at all %d' % i, None),
                ('refused', events, run.encode(), b'\xc3\x01' + rng.randbytes(8) + b'body', None),
                ('refused', effects, run.encode(), None, None),  # tombstone
                ('refused', events, None, ev(f'h-nokey-{i}', 0, 'w', 'run_started'), 0),
                ('refused', events, b'someone-else', ev(run, 900 + i, owner), None),
                ('refused', events, run.encode(), ev(run, 900 + i, owner), WRONG_PARTITION),
                (
                    'refused',
                    effects,
                    run.encode(),
                    ev(run, 950 + i, owner),
                    None,
                ),  # a step event on tool-effects
                ('refused', events, run.encode(), ev(run, 960 + i, owner, 'from_the_future'), None),
                ('refused', events, b'a/b', ev('a/b', 0, 'w', 'run_started'), None),
                ('refused', effects, run.encode(), fx(run, 970 + i, owner, call='c' * 5000), None),
                ('refused', events, run.encode(), ev(run, -1 - i, owner), None),
                ('refused', events, run.encode(), ev(run, rng.choice([10**9, 2**62]) + i, owner), None),
                (
                    'refused',
                    events,
                    run.encode(),
                    ev(run, 1 + i % 2, owner, 'run_failed', error='forged'),
                    None,
                ),
                (
                    'refused',
                    effects,
                    run.encode(),
                    fx(run, 0, owner, 'completed', f'c{i}'),
                    None,
                ),  # seq 0 is run_started
                # Schema v3 fields with garbage: usage on the wrong kind or out of range, a bad trace id.
                ('refused', events, run.encode(), ev(run, 2000 + i, owner, usage=ModelUsage()), None),
                (
                    'refused',
                    events,
                    run.encode(),
                    ev(
                        run, 2100 + i, owner, 'model_request_completed', usage=ModelUsage(input_tokens=-i - 1)
                    ),
                    None,
                ),
                (
                    'refused',
                    events,
                    run.encode(),
                    ev(run, 2200 + i, owner, 'model_request_completed', usage=ModelUsage(cost_usd='NaN')),
                    None,
                ),
                (
                    'refused',
                    events,
                    run.encode(),
                    ev(run, 2300 + i, owner, 'tool_call_failed', duration_us=-1),
                    None,
                ),
                ('refused', events, run.encode(), ev(run, 2400 + i, owner, trace_id='../../etc'), None),
                ('accepted', events, run.encode(), ev(run, i, f'intruder\x00{i % 3}', 'run_completed'), None),
                ('accepted', effects, run.encode(), fx(run, i, 'intruder', 'completed'), None),
                ('accepted', effects, f'h-parked-{i}'.encode(), fx(f'h-parked-{i}', 1, f'w\x00{i}'), None),
                (
                    'accepted',
                    events,
                    f'h-child-{i}'.encode(),
                    ev(f'h-child-{i}', 1, 'w\x00', 'run_completed'),
                    None,
                ),
                (
                    'accepted',
                    events,
                    f'h-child-{i}'.encode(),
                    ev(
                        f'h-child-{i}', 0, 'w\x00', 'run_started', parent_run_id=run, conversation_id='c\x00x'
                    ),
                    None,
                ),
            ]
        for i in range(2):  # about 1 MiB: too large to forward as it is
            plan.append(('refused', events, genuine[i].encode(), b'\x00' * (1024 * 1024 + 100), None))
        plan.append(
            ('accepted', events, b'h-big', ev('h-big', 0, 'w', 'run_started', error='x' * 900_000), None)
        )
        rng.shuffle(plan)
        return plan

    async def attack(self, stop: asyncio.Event) -> None:
        """Write every planned record, pausing now and then so genuine traffic interleaves."""
        producer = AIOKafkaProducer(
            bootstrap_servers=self.settings.kafka.bootstrap_servers, max_request_size=4 * 1024 * 1024
        )
        await producer.start()
        try:
            for n, (expectation, topic, key, value, partition) in enumerate(self.plan()):
                home = murmur2_partition(key, self.settings.topics.partitions) if key else 0
                if partition == WRONG_PARTITION:
                    partition = (home + 1) % self.settings.topics.partitions
                elif partition is None:
                    partition = home
                meta = await producer.send_and_wait(topic, value, key=key, partition=partition)
                where = (topic, meta.partition, meta.offset)
                (self.refused if expectation == 'refused' else self.accepted).add(where)
                tp = TopicPartition(topic, meta.partition)
                self.position[tp] = max(self.position.get(tp, 0), meta.offset + 1)
                if n % 25 == 0:
                    await asyncio.sleep(0.05)
        finally:
            await producer.stop()
            stop.set()


async def start_projector(settings: Settings, db_path: Path) -> asyncio.subprocess.Process:
    env = {**os.environ, **settings.replace(db_path=str(db_path)).to_env()}
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        '-m',
        'stepstream.cli',
        'projector',
        '--max-batch-records',
        '50',
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdout is not None
    assert b'projector:' in await asyncio.wait_for(child.stdout.readline(), 60)
    return child


async def dead_letters(settings: Settings, expected: int) -> dict[Coordinates, bytes]:
    """Source coordinates -> reason of every DLQ entry (repeats after a crash collapse)."""
    consumer = AIOKafkaConsumer(
        settings.topics.dlq_topic,
        bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset='earliest',
    )
    await consumer.start()
    found: dict[Coordinates, bytes] = {}
    try:
        for _ in range(60):
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                for m in batch:
                    h = dict(m.headers)
                    where = (
                        h['stepstream-source-topic'].decode(),
                        int(h['stepstream-source-partition']),
                        int(h['stepstream-source-offset']),
                    )
                    found[where] = h['stepstream-dlq-reason']
                    if h.get('stepstream-dlq-envelope') == b'1':
                        envelope = json.loads(m.value)
                        assert envelope['value_bytes'] > 1024 * 1024 and len(m.value) < 8192
            if len(found) >= expected:
                break
    finally:
        await consumer.stop()
    return found


async def copy_genuine(
    settings: Settings, clean: Settings, hostile: set[Coordinates], end: Position
) -> Position:
    """The same log without the hostile records: every other record, in order, in its partition."""
    return await copy_log(
        settings, clean, end, keep=lambda tp, m: (tp.topic, tp.partition, m.offset) not in hostile
    )


async def test_hostile_records_cannot_stop_split_or_change_the_projection(
    settings: Settings, tmp_path: Path
) -> None:
    db_path = tmp_path / 'live'
    async with EventLog(settings) as log:
        for i in range(6):
            await genuine_run(log, f'genuine-{i}', calls=1 + i % 3)
        attacker = Attacker(settings, await owners(settings, {f'genuine-{i}' for i in range(6)}))

        done = asyncio.Event()
        attack = asyncio.create_task(attacker.attack(done))

        async def more_genuine() -> None:
            for i in range(6, 12):
                await genuine_run(log, f'genuine-{i}', calls=1 + i % 3)

        writers = asyncio.create_task(more_genuine())
        rng = random.Random(3)
        kills = 0
        while kills < 3 or not done.is_set():
            child = await start_projector(settings, db_path)
            await asyncio.sleep(rng.uniform(0.3, 1.2))  # let it apply some batches, then kill it
            assert child.returncode is None, 'the projector exited by itself'
            child.send_signal(signal.SIGKILL)
            await child.wait()
            kills += 1
        await attack
        await writers
        genuine_end = await log.flush()

    end = {**genuine_end}
    for tp, offset in attacker.position.items():
        end[tp] = max(end.get(tp, 0), offset)
    child = await start_projector(settings, db_path)
    try:
        await wait_applied(db_path, end)
        assert child.returncode is None, 'the projector exited by itself'
    finally:
        child.send_signal(signal.SIGTERM)
        assert await child.wait() == 0

    # Every record that cannot apply is in the DLQ, with a reason.
    dlq = await dead_letters(settings, len(attacker.refused))
    assert attacker.refused <= set(dlq), sorted(attacker.refused - set(dlq))[:5]
    assert not attacker.accepted & set(dlq)
    reader = ProjectionReader.open(db_path)
    try:
        status = await reader.status()
        assert status.dead_lettered >= len(attacker.refused)
        assert status.parked_records == 20  # h-parked-*: a transition each, no run_started ever
        for reason in ('not_a_record', 'unknown_version', 'tombstone', 'no_key', 'wrong_key'):
            assert status.dead_lettered_by_reason.get(reason), reason
        for reason in (
            'wrong_partition',
            'wrong_topic',
            'invalid_id',
            'invalid',
            'seq_jump',
            'duplicate_seq',
        ):
            assert status.dead_lettered_by_reason.get(reason), reason
        live_runs = {r.run_id: r for r in await reader.list_runs()}
    finally:
        reader.close()

    # Live equals a clean rebuild of the same hostile log.
    await rebuild(settings, tmp_path / 'rebuilt')
    _, difference = verify_paths(db_path, tmp_path / 'rebuilt')
    assert difference is None, str(difference)

    # Every genuine run is what a log without the hostile records gives.
    clean = settings.replace(topic_prefix=settings.topics.topic_prefix + '-clean')
    hostile = attacker.refused | attacker.accepted
    await copy_genuine(
        settings, clean, hostile, {tp: o for tp, o in end.items() if tp.topic != settings.topics.dlq_topic}
    )
    await rebuild(clean, tmp_path / 'clean')
    live, reference = ProjectionReader.open(db_path), ProjectionReader.open(tmp_path / 'clean')
    try:
        for i in range(12):
            run_id = f'genuine-{i}'
            mine, theirs = await live.get_run(run_id), await reference.get_run(run_id)
            assert mine is not None and theirs is not None
            assert mine.status == 'completed' and mine.gaps == [] and mine.event_count == mine.last_seq + 1
            mine.conflicting_writers = theirs.conflicting_writers
            mine.rejected = theirs.rejected
            assert mine == theirs
            assert await live.list_events(run_id) == await reference.list_events(run_id)
            assert await live.list_tool_effects(run_id) == await reference.list_tool_effects(run_id)
            assert [s.messages for s in await live.list_snapshots(run_id)] == [
                s.messages for s in await reference.list_snapshots(run_id)
            ]
        assert await live.list_unresolved_tool_effects() == []
        assert {r.run_id for r in await live.list_conflicts()} <= {f'genuine-{i}' for i in range(6)}
        assert 'h-big' in live_runs and all(f'h-parked-{i}' not in live_runs for i in range(20))
    finally:
        live.close()
        reference.close()
