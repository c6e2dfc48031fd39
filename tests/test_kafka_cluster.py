"""Three Apache Kafka brokers, killed and restarted one at a time while agents write.

Topics have replication factor 3 and `min.insync.replicas=2`; the producer writes with acks=all.
With one broker down (the partition leader, then the controller) no run may fail
and no acknowledged record may be lost; with two down (fewer than two replicas in sync) runs fail
with `StepStreamUnavailable` and nothing else. The projector keeps up throughout and equals a
clean rebuild at the end, and every completed run's hash chain is intact (`audit verify`). The
figures are printed (run with -s) and recorded in docs/kafka-cluster.md.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from kafka_cluster import KafkaCluster
from pydantic_ai import Agent

from stepstream import Settings, StepStreamUnavailable
from stepstream.audit import audit_log
from stepstream.embedded import EmbeddedStack
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector, rebuild, verify_paths
from stepstream.readmodel import ProjectionReader

from agents import calls_then_answers
from brokers import kafka_only
from waits import until

pytestmark = pytest.mark.broker


class Traffic:
    """Agents writing runs back to back, and what became of each run."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.history: list[tuple[float, str]] = [(time.monotonic(), 'warm-up')]
        self.completed: list[tuple[str, float]] = []
        self.unavailable: list[tuple[str, set[str]]] = []
        """Failed runs, each with the phases it lived through."""
        self.other: list[tuple[str, str]] = []
        self._stop = asyncio.Event()
        self.changed = asyncio.Event()
        """Set whenever a run ends, completed or not: what a wait on the traffic wakes on."""

    @property
    def phase(self) -> str:
        return self.history[-1][1]

    @phase.setter
    def phase(self, name: str) -> None:
        self.history.append((time.monotonic(), name))

    def phases_between(self, start: float, end: float) -> set[str]:
        """The phases a run that lasted from `start` to `end` lived through."""
        bounds = [*self.history[1:], (float('inf'), '')]
        return {
            name
            for (since, name), (until, _) in zip(self.history, bounds, strict=True)
            if since <= end and until >= start
        }

    async def worker(self, number: int) -> None:
        index = 0
        while not self._stop.is_set():
            run_id = f'w{number}-{index:04d}'
            index += 1
            agent = Agent(
                calls_then_answers('work', 2), capabilities=[StepPersistence(log=self.log, run_id=run_id)]
            )

            @agent.tool_plain
            def work() -> str:
                return 'done'

            started = time.monotonic()
            try:
                await agent.run('go')
                self.completed.append((run_id, time.monotonic()))
            except StepStreamUnavailable:
                self.unavailable.append((run_id, self.phases_between(started, time.monotonic())))
            except Exception as exc:
                self.other.append((run_id, repr(exc)))
            self.changed.set()

    def summary(self) -> str:
        return f'in phase {self.phase}: {len(self.completed)} completed, {self.unavailable}'

    async def more_completed(self, count: int) -> float:
        """Wait for `count` more completed runs; returns when the first of them completed."""
        start = len(self.completed)
        await until(
            lambda: len(self.completed) >= start + count,
            f'{count} more completed runs',
            120,
            wake=self.changed,
            describe=self.summary,
        )
        return self.completed[start][1]

    def stop(self) -> None:
        self._stop.set()


async def in_sync(cluster: KafkaCluster, settings: Settings, timeout: float = 120) -> None:
    topics = [settings.topics.step_events_topic, settings.topics.tool_effects_topic]
    await until(lambda: cluster.fully_in_sync(topics), 'the restarted broker to catch up', timeout, every=0.5)


@kafka_only('runs as one broker here: the cluster test needs Apache Kafka')
async def test_three_brokers_killed_one_at_a_time_lose_no_acknowledged_record(
    stack: EmbeddedStack, tmp_path: Path
) -> None:
    cluster = KafkaCluster(tmp_path / 'cluster')
    await cluster.start()
    figures: dict[str, object] = {}
    try:
        settings = stack.settings.replace(
            bootstrap_servers=cluster.bootstrap_servers,
            topic_prefix='cluster',
            partitions=3,
            replication_factor=3,
            ack_timeout_s=15,
        )
        async with EventLog(settings) as log, Projector(settings, db_path=tmp_path / 'live') as projector:
            assert log.enable_idempotence
            traffic = Traffic(log)
            workers = [asyncio.create_task(traffic.worker(n)) for n in range(3)]
            await traffic.more_completed(3)

            recovery: dict[str, float] = {}
            for name in ('leader', 'controller'):
                if name == 'leader':
                    victim = await cluster.leader_of(settings.topics.step_events_topic, 0)
                else:
                    victim = await cluster.controller()
                traffic.phase = f'{name} ({victim}) down'
                killed_at = time.monotonic()
                cluster.kill(victim)
                first = await traffic.more_completed(3)  # writes go on with two of three in sync
                recovery[name] = round(first - killed_at, 2)
                cluster.restart(victim)
                await in_sync(cluster, settings)
                traffic.phase = f'{name} ({victim}) back'
                await traffic.more_completed(2)

            # Two of three down: fewer than two replicas in sync, so acks=all cannot be met.
            traffic.phase = 'two down'
            down = list(cluster.nodes)[:2]
            for node in down:
                cluster.kill(node)
            await until(
                lambda: any('two down' in phases for _, phases in traffic.unavailable),
                'a run to fail with two brokers down',
                120,
                wake=traffic.changed,
                describe=traffic.summary,
            )
            for node in down:
                cluster.restart(node)
            await cluster.wait_for_brokers(3)
            await in_sync(cluster, settings)
            traffic.phase = 'all back'
            back_at = time.monotonic()
            first = await traffic.more_completed(3)
            recovery['two down, then back'] = round(first - back_at, 2)

            traffic.stop()
            await asyncio.gather(*workers)
            position = await log.flush(timeout=60)
            await projector.wait_for(position, timeout=120)
            reader = ProjectionReader.of(projector)
            runs = {r.run_id: r for r in await reader.list_runs()}

        assert traffic.other == []
        # Every run that failed was in flight while two brokers were down, and only those.
        assert traffic.unavailable and all('two down' in phases for _, phases in traffic.unavailable)
        completed = [run_id for run_id, _ in traffic.completed]
        for run_id in completed:  # every record of every acknowledged run is in the log, in order
            run = runs[run_id]
            assert run.status == 'completed' and run.gaps == [] and run.event_count == run.last_seq + 1
        for run_id, _ in traffic.unavailable:  # and failed runs say so, once the cluster is back,
            run = runs[run_id]
            # unless the wait that timed out was for records that landed after all: the
            # idempotent producer goes on retrying a send its caller stopped waiting for, so a run
            # told "unavailable" at its last durability point can be whole and completed in the log.
            assert run.status == 'failed' or (
                run.status == 'completed' and run.gaps == [] and run.event_count == run.last_seq + 1
            ), run
        assert all(r.status != 'running' for r in runs.values())

        await rebuild(settings, tmp_path / 'clean', timeout=300)
        _, difference = verify_paths(tmp_path / 'live', tmp_path / 'clean')
        assert difference is None, str(difference)
        # Every completed run's trail is its hash chain, as the projection and the audit read it.
        assert all(runs[run_id].chain == 'intact' for run_id in completed)
        audited = {verdict.run_id: verdict for verdict in (await audit_log(settings)).runs}
        for run_id in completed:
            integrity = audited[run_id].integrity
            assert integrity is not None and integrity.ok, integrity

        figures = {
            'runs completed': len(completed),
            'records acknowledged (completed runs)': sum(runs[r].event_count for r in completed),
            'acknowledged records lost': 0,
            'runs failed (StepStreamUnavailable)': len(traffic.unavailable),
            'seconds from kill to the next completed run': recovery,
        }
    finally:
        cluster.stop()
        print(f'\nthree-broker cluster figures: {figures}')
