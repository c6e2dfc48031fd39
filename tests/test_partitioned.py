"""The partitioned projection: shards per partition, group members, checkpoints, reads across
shards and parallel rebuilds, each checked against a clean single-process rebuild."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import obstore
import pytest
from test_cli import cli, orchestrate

from stepstream import ProjectionMismatch, Settings, UsageError
from stepstream.producer import EventLog
from stepstream.projector import GroupMember, Projector, Rebuilding, rebuild, verify_paths
from stepstream.readmodel import ProjectionReader, ShardUnavailable
from stepstream.storage import Checkpoints
from stepstream.topics import Position, murmur2_partition

from brokers import BROKER, kafka_only
from waits import until

pytestmark = pytest.mark.broker


async def write_runs(log: EventLog, prefix: str, count: int) -> None:
    for i in range(count):
        await orchestrate(log, f'{prefix}-{i}')


async def test_two_members_share_a_directory_and_hand_shards_over(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    shared = tmp_path / 'shared'
    await write_runs(event_log, 'before', 4)
    end = await event_log.flush()
    group = f'{settings.topics.topic_prefix}.members'
    a = Projector(settings, db_path=shared, member=GroupMember(group=group, session_timeout_ms=6000))
    b = Projector(settings, db_path=shared, member=GroupMember(group=group, session_timeout_ms=6000))
    async with a, b:
        await until(
            lambda: sorted(a.partitions + b.partitions) == [0, 1, 2] and bool(a.partitions and b.partitions),
            'the group to split three partitions between two members',
        )
        assert not set(a.partitions) & set(b.partitions)
        await until(lambda: _both(a, b, end), 'both members to catch up')

        reader = ProjectionReader.open(shared)  # every shard, whichever member writes it
        try:
            runs = await reader.list_runs()
            assert len(runs) == 8 and {r.status for r in runs} == {'completed'}
            [boss] = await reader.list_runs(conversation_id='before-0')
            assert [r.agent_name for r in await reader.run_tree(boss.run_id)] == ['boss', 'worker']
            # A member's own reader sees only its shards, and says which one it lacks.
            for other in [r for r in runs if murmur2_partition(r.run_id.encode(), 3) in b.partitions][:1]:
                with pytest.raises(ShardUnavailable, match=r'partition\(s\) \['):
                    await ProjectionReader.of(a).get_run(other.run_id)
            with pytest.raises(ShardUnavailable):
                await ProjectionReader.of(a).list_runs()
        finally:
            reader.close()

        await b.stop()  # b leaves the group: a is assigned its shards, in the same directory
        b.close()
        await until(lambda: a.partitions == [0, 1, 2], 'the remaining member to own every partition')
        await write_runs(event_log, 'after', 3)
        end = await event_log.flush()
        await a.wait_for(end)
    await rebuild(settings, tmp_path / 'clean')
    assert verify_paths(shared, tmp_path / 'clean')[1] is None


def _both(a: Projector, b: Projector, end: dict) -> bool:
    return all(
        (a.applied.get(tp, 0) >= offset) or (b.applied.get(tp, 0) >= offset) for tp, offset in end.items()
    )


async def test_a_late_member_restores_shards_from_checkpoints(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    group = f'{settings.topics.topic_prefix}.restore'
    checkpoints = Checkpoints.from_settings(settings, group=group, interval_s=3600)
    await write_runs(event_log, 'early', 4)
    end = await event_log.flush()
    async with Projector(
        settings, db_path=tmp_path / 'first', member=GroupMember(group=group, checkpoints=checkpoints)
    ) as first:
        await until(lambda: first.partitions == [0, 1, 2], 'the only member to own every partition')
        await first.wait_for(end)
        uploaded = await checkpoints.upload_all(first.shards)
        nonempty = sorted({tp.partition for tp, offset in first.applied.items() if offset > 0})
        assert sorted(int(c.key.split('/')[-2]) for c in uploaded) == nonempty  # an empty shard has none
        # A later checkpoint uploads only the files the earlier ones lack.
        await write_runs(event_log, 'middle', 2)
        end = await event_log.flush()
        await first.wait_for(end)
        first.shards.flush()  # the new records become SST files of their own
        again = await checkpoints.upload_all(first.shards)
        assert again and all(
            later.uploaded_bytes < earlier.uploaded_bytes
            for later in again
            for earlier in uploaded
            if later.key.split('/')[-2] == earlier.key.split('/')[-2]
        )
    held = {int(c.key.split('/')[-2]): c.records for c in again}
    held.update(
        {int(c.key.split('/')[-2]): c.records for c in uploaded if int(c.key.split('/')[-2]) not in held}
    )

    # The newest checkpoint of a partition is corrupt: the member falls back to the older one. (A
    # partition the runs' random ids left empty has no checkpoint, so the first one that has.)
    good = (await checkpoints.list(min(held)))[-1]
    corrupt_key = good.key.rsplit('/', 1)[0] + f'/{good.records + 1:020d}-{good.sha256}.json'
    await obstore.put_async(checkpoints.store.object_store, corrupt_key, b'{"not": "a manifest"}')

    await write_runs(event_log, 'late', 2)
    end = await event_log.flush()
    restorer = Checkpoints.from_settings(settings, group=group, interval_s=3600)
    async with Projector(
        settings, db_path=tmp_path / 'second', member=GroupMember(group=group, checkpoints=restorer)
    ) as second:
        await until(lambda: second.partitions == [0, 1, 2], 'the new member to own every partition')
        assert second.restored_from_checkpoint == held  # restored, not replayed from offset zero
        await second.wait_for(end)
    await rebuild(settings, tmp_path / 'clean')
    assert verify_paths(tmp_path / 'second', tmp_path / 'clean')[1] is None


class RestoreAfterAStaleFetch(Checkpoints):
    """Restores a shard only once the member's consumer has handed out records past the group's
    committed offsets: aiokafka installs an assignment and fetches from those offsets before the
    assignment callback (which restores, then seeks) has run, so that batch reaches the member.
    """

    member: Projector
    committed: dict
    stale: list | None = None

    async def restore(self, root: Path, partition: int, partitions: int) -> int | None:
        consumer = self.member._consumer
        assert consumer is not None
        deadline = asyncio.get_running_loop().time() + 60
        while self.stale is None:  # once: the member's loop then waits for the restores with that batch
            stale = [tp for tp in self.committed if await consumer.position(tp) > self.committed[tp]]
            if stale:
                self.stale = stale
            elif asyncio.get_running_loop().time() > deadline:
                raise AssertionError('the consumer handed out nothing before the assignment callback')
            else:
                await asyncio.sleep(0.05)
        return await super().restore(root, partition, partitions)


async def test_a_batch_fetched_before_the_assignment_seek_is_fetched_again(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    group = f'{settings.topics.topic_prefix}.refetch'
    await write_runs(event_log, 'early', 3)
    early = await event_log.flush()
    checkpoints = Checkpoints.from_settings(settings, group=group, interval_s=3600)
    async with Projector(
        settings, db_path=tmp_path / 'first', member=GroupMember(group=group, checkpoints=checkpoints)
    ) as first:
        await until(lambda: first.partitions == [0, 1, 2], 'the only member to own every partition')
        await first.wait_for(early)
        assert await checkpoints.upload_all(first.shards)  # the checkpoints hold the early runs only
        await write_runs(event_log, 'middle', 3)
        middle = await event_log.flush()
        await first.wait_for(middle)
    # Stopping, the member committed its position to the group: past the checkpoints.
    await write_runs(event_log, 'late', 3)
    end = await event_log.flush()

    restorer = RestoreAfterAStaleFetch.from_settings(settings, group=group, interval_s=3600)
    second = Projector(
        settings, db_path=tmp_path / 'second', member=GroupMember(group=group, checkpoints=restorer)
    )
    restorer.member, restorer.committed = second, {tp: o for tp, o in middle.items() if early.get(tp, 0) < o}
    async with second:
        await until(lambda: second.partitions == [0, 1, 2], 'the new member to own every partition')
        assert second.restored_from_checkpoint  # restored from the early checkpoints, not offset zero
        assert restorer.stale  # a batch from past the checkpoints was in the member's hands
        await second.wait_for(end)
        for conversation in ('middle-0', 'middle-1', 'middle-2'):  # the runs between the offsets
            [boss] = await ProjectionReader.of(second).list_runs(conversation_id=conversation)
            tree = await ProjectionReader.of(second).run_tree(boss.run_id)
            assert [(r.agent_name, r.status) for r in tree] == [
                ('boss', 'completed'),
                ('worker', 'completed'),
            ]
    await rebuild(settings, tmp_path / 'clean')
    assert verify_paths(tmp_path / 'second', tmp_path / 'clean')[1] is None


async def test_a_member_joins_its_group_in_one_generation(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One JoinGroup per join: aiokafka sends one per configured assignor, and each after the
    first changes the member's protocols and starts another rebalance. Members that join together
    then rebalance over and over (the chaos test waited minutes for a first assignment)."""
    caplog.set_level(logging.INFO, logger='aiokafka.consumer.group_coordinator')
    group = f'{settings.topics.topic_prefix}.one-join'
    async with Projector(settings, db_path=tmp_path / 'alone', member=GroupMember(group=group)) as alone:
        await until(lambda: alone.partitions == [0, 1, 2], 'the only member to own every partition')
    joins = [r.getMessage() for r in caplog.records if r.getMessage().startswith('Joined group')]
    first = 0 if BROKER == 'tansu' else 1  # Tansu numbers a group's generations from 0, Kafka from 1
    assert len(joins) == 1 and f'(generation {first})' in joins[0], joins


async def test_parallel_rebuild_equals_one_process_and_partial_reads_refuse(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    await write_runs(event_log, 'jobs', 5)
    await event_log.flush()
    code, _, err = await cli(
        settings, tmp_path / 'unused', 'rebuild', '--into', str(tmp_path / 'two'), '--jobs', '2'
    )
    assert code == 0, err
    await rebuild(settings, tmp_path / 'one')
    assert verify_paths(tmp_path / 'one', tmp_path / 'two')[1] is None
    code, out, _ = await cli(
        settings, tmp_path / 'two', 'verify', str(tmp_path / 'one'), str(tmp_path / 'two')
    )
    assert code == 0 and 'identical' in out

    # A directory with only some shards answers for their runs and names what it lacks.
    await rebuild(settings, tmp_path / 'part', partitions=[0])
    _, difference = verify_paths(tmp_path / 'one', tmp_path / 'part')
    assert difference is not None and difference.key == 'shard 1' and difference.right == 'missing'
    reader = ProjectionReader.open(tmp_path / 'part')
    full = ProjectionReader.open(tmp_path / 'one')
    try:
        runs = await full.list_runs()
        for run in runs:
            if murmur2_partition(run.run_id.encode(), 3) == 0:
                assert await reader.get_run(run.run_id) == run
            else:
                with pytest.raises(ShardUnavailable, match=r'partition\(s\) \[[12]\]'):
                    await reader.get_run(run.run_id)
        with pytest.raises(ShardUnavailable, match=r'partition\(s\) \[1, 2\]'):
            await reader.list_unresolved_tool_effects()
        status = await reader.status()
        assert status.shards == [0] and status.missing_shards == [1, 2] and status.state == 'rebuilding'
    finally:
        reader.close()
        full.close()


# -- members killed at random ------------------------------------------------------------------

KILLS = int(os.environ.get('STEPSTREAM_SOAK_KILLS', '10'))
"""How many times the chaos test SIGKILLs a member (raise it for a soak run)."""


class Member:
    """A `stepstream projector --group` process, in a directory of its own (a host of its own)."""

    def __init__(self, settings: Settings, group: str, db_path: Path) -> None:
        self.settings, self.group, self.db_path = settings, group, db_path
        self.process: asyncio.subprocess.Process | None = None
        self.owned: list[int] = []
        self.lines: list[str] = []
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        env = {**os.environ, **self.settings.replace(db_path=str(self.db_path)).to_env()}
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            '-m',
            'stepstream.cli',
            'projector',
            '--group',
            self.group,
            '--checkpoint-interval',
            '0.5',
            '--session-timeout',
            '6',
            '--max-batch-records',
            '50',
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors='replace').rstrip()
            self.lines.append(line)
            print(f'[{self.db_path.name}] {line}', flush=True)
            if line.startswith('projector: owns partitions '):
                self.owned = [int(p) for p in line.split('[', 1)[1].rstrip(']').split(',') if p.strip()]

    async def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        await self.process.wait()
        if self._reader is not None:
            await self._reader
        self.owned = []

    async def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(self.process.wait(), 60)
        except TimeoutError:
            self.process.send_signal(signal.SIGKILL)
            await self.process.wait()
            raise AssertionError(
                f'{self.db_path.name} did not stop on SIGTERM:\n' + '\n'.join(self.lines[-30:])
            ) from None
        if self._reader is not None:
            await self._reader
        return code


@kafka_only(
    'the chaos run (about 100 s) runs once, on the broker production uses; the two-member '
    'handoff and the checkpoint restore above run on both brokers'
)
@pytest.mark.soak
@pytest.mark.timeout(600)
async def test_members_killed_at_random_lose_nothing_and_restore_from_checkpoints(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    group = f'{settings.topics.topic_prefix}.chaos'
    rng = random.Random(12)
    generation = 0

    def fresh_dir() -> Path:
        nonlocal generation
        generation += 1
        return tmp_path / f'host-{generation}'

    members = [Member(settings, group, fresh_dir()) for _ in range(3)]
    try:
        end = await _chaos(settings, event_log, group, members, fresh_dir, rng)
    finally:  # a failed wait leaves members running: they must not outlive the test
        for member in members:
            if member.process is not None and member.process.returncode is None:
                await member.kill()
    restores = sum('restored shard' in line for m in members for line in m.lines)

    # A last member on an empty disk takes every shard from the checkpoints the chaos left behind
    # and catches up: the result equals a clean rebuild, so nothing was lost or applied twice.
    async with Projector(
        settings,
        db_path=tmp_path / 'last',
        member=GroupMember(
            group=group, checkpoints=Checkpoints.from_settings(settings, group=group, interval_s=3600)
        ),
    ) as last:
        await until(lambda: last.partitions == [0, 1, 2], 'the last member to own every partition', 90)
        assert len(last.restored_from_checkpoint) == 3
        await last.wait_for(end, timeout=120)
        reader = ProjectionReader.of(last)
        runs = await reader.list_runs()
        assert runs
        for run in runs:  # every genuine run reads whole: its completed runs resume from a snapshot
            if run.status == 'completed':
                assert await reader.latest_snapshot(run.run_id) is not None
    await rebuild(settings, tmp_path / 'clean')
    assert verify_paths(tmp_path / 'last', tmp_path / 'clean')[1] is None
    print(f'{KILLS} kills on {BROKER}; {restores} restores logged by the chaos members')


async def _chaos(
    settings: Settings,
    event_log: EventLog,
    group: str,
    members: list[Member],
    fresh_dir: Callable[[], Path],
    rng: random.Random,
) -> Position:
    """Kill members at random while runs are written, replacing each; then stop them all.

    Returns the log's position after the last write.
    """
    for member in members:
        await member.start()
    writing = asyncio.create_task(write_runs(event_log, 'chaos', 10_000))
    try:
        await until(
            lambda: sorted(p for m in members for p in m.owned) == [0, 1, 2], 'a first assignment', 90
        )
        for _ in range(KILLS):
            victim = rng.randrange(len(members))
            if rng.random() < 0.5:  # sometimes right after it was assigned (mid-restore), else later
                await until(lambda v=victim: bool(members[v].owned), 'the victim to own a shard', 90)
            print(f'kill member {victim}; owned: {[m.owned for m in members]}', flush=True)
            await members[victim].kill()
            members[victim] = Member(settings, group, fresh_dir())  # a replacement host: empty disk
            await members[victim].start()
            await until(  # three members, three partitions: settled when each holds one
                lambda: all(len(m.owned) == 1 for m in members), 'the group to settle', 90
            )
    finally:
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
    end = await event_log.flush()
    for member in members:
        assert await member.stop() == 0, '\n'.join(member.lines[-20:])
        assert not any('in use by another projector' in line for line in member.lines)
        assert not any('lost Kafka' in line for line in member.lines)  # rebalances are not a lost broker
    return end


async def test_a_member_that_cannot_open_its_shards_stops_with_the_reason(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    await write_runs(event_log, 'kept', 1)
    await event_log.flush()
    await rebuild(settings, tmp_path / 'proj', max_snapshots_per_run=2)
    member = Projector(
        settings,
        db_path=tmp_path / 'proj',
        member=GroupMember(group=f'{settings.topics.topic_prefix}.strict'),
        max_snapshots_per_run=5,
    )
    with pytest.raises(ProjectionMismatch, match='max_snapshots_per_run=2, not 5'):
        async with member:
            await member.join()  # never consumes partitions it has nowhere to apply


def test_a_member_is_not_also_given_partitions(settings: Settings, tmp_path: Path) -> None:
    member = GroupMember(group=f'{settings.topics.topic_prefix}.both')
    with pytest.raises(UsageError, match='give member or partitions'):
        Projector(settings, db_path=tmp_path / 'p', member=member, rebuilding=Rebuilding(partitions=[0]))
