"""A three-node Apache Kafka cluster on loopback, for failure tests: kill and restart any node.

Each node is broker and KRaft controller (three voters), built from the same jars and broker
settings as the embedded Apache Kafka (`stepstream.embedded.apache_kafka`), with what a replicated
cluster needs on top: replication factor 3 and `min.insync.replicas=2` for every topic, and a
short broker session so the controller notices a dead broker within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from stepstream.embedded import apache_kafka

from processes import HOST, free_port, spawn, stop

CLUSTER_OVERRIDES = {
    'default.replication.factor': '3',
    'min.insync.replicas': '2',
    'offsets.topic.replication.factor': '3',
    'transaction.state.log.replication.factor': '3',
    'transaction.state.log.min.isr': '2',
    'share.coordinator.state.topic.replication.factor': '3',
    'share.coordinator.state.topic.min.isr': '2',
    'unclean.leader.election.enable': 'false',
    'broker.session.timeout.ms': '3000',
    'broker.heartbeat.interval.ms': '500',
}


@dataclass
class Node:
    node_id: int
    port: int
    controller_port: int
    properties: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None


class KafkaCluster:
    """Three Apache Kafka nodes; `kill(n)` SIGKILLs one, `restart(n)` brings it back."""

    def __init__(self, data_dir: Path, size: int = 3) -> None:
        self.data_dir = data_dir
        self.java = apache_kafka.java_binary()
        self.lib = apache_kafka.resolve_jars()
        ports = [(free_port(), free_port()) for _ in range(size)]
        voters = ','.join(f'{i + 1}@{HOST}:{controller}' for i, (_, controller) in enumerate(ports))
        cluster_id = apache_kafka.new_cluster_id()
        self.nodes: dict[int, Node] = {}
        for i, (port, controller) in enumerate(ports):
            node_id = i + 1
            home = data_dir / f'node-{node_id}'
            home.mkdir(parents=True)
            properties = home / 'server.properties'
            properties.write_text(
                apache_kafka.server_properties(
                    host=HOST,
                    port=port,
                    controller_port=controller,
                    log_dir=home / 'log',
                    node_id=node_id,
                    voters=voters,
                    overrides=CLUSTER_OVERRIDES,
                )
            )
            subprocess.run(
                apache_kafka.format_command(self.java, self.lib, properties, cluster_id),
                check=True,
                capture_output=True,
            )
            self.nodes[node_id] = Node(node_id, port, controller, properties, home / 'kafka.log')

    @property
    def bootstrap_servers(self) -> str:
        return ','.join(f'{HOST}:{n.port}' for n in self.nodes.values())

    def _spawn(self, node: Node) -> None:
        node.process = spawn(
            apache_kafka.broker_command(self.java, self.lib, node.properties), node.log, new_session=True
        )

    async def start(self) -> None:
        for node in self.nodes.values():
            self._spawn(node)
        await self.wait_for_brokers(len(self.nodes))

    async def wait_for_brokers(self, count: int, timeout: float = 90) -> None:
        """Until the cluster's metadata lists `count` live brokers."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            with contextlib.suppress(Exception):
                if len((await self.describe())['brokers']) >= count:
                    return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f'the cluster did not show {count} brokers within {timeout}s')
            await asyncio.sleep(0.3)

    async def describe(self) -> dict[str, object]:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, request_timeout_ms=5000)
        await asyncio.wait_for(admin.start(), 10)
        try:
            return await asyncio.wait_for(admin.describe_cluster(), 10)
        finally:
            await admin.close()

    async def controller(self) -> int:
        return int((await self.describe())['controller_id'])  # type: ignore[call-overload]

    async def leader_of(self, topic: str, partition: int) -> int:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, request_timeout_ms=5000)
        await asyncio.wait_for(admin.start(), 10)
        try:
            [described] = await admin.describe_topics([topic])
        finally:
            await admin.close()
        return int(next(p['leader'] for p in described['partitions'] if p['partition'] == partition))

    async def fully_in_sync(self, topics: list[str]) -> bool:
        """Whether every replica of every partition of `topics` is in sync (False while unsure)."""
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, request_timeout_ms=5000)
        try:
            await asyncio.wait_for(admin.start(), 10)
            described = await asyncio.wait_for(admin.describe_topics(topics), 10)
        except (KafkaError, TimeoutError, OSError):
            return False  # a node that is just starting may take the request and not answer yet
        finally:
            await admin.close()
        return all(len(p['isr']) == len(self.nodes) for t in described for p in t['partitions'])

    def kill(self, node_id: int) -> None:
        process = self.nodes[node_id].process
        assert process is not None and process.poll() is None, f'node {node_id} is not running'
        process.send_signal(signal.SIGKILL)
        process.wait()

    def restart(self, node_id: int) -> None:
        self._spawn(self.nodes[node_id])

    def stop(self) -> None:
        stop(*(node.process for node in self.nodes.values()), grace_s=10)
