"""Free loopback ports for one stack, and the probes that check something answers on them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import secrets
import socket
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from stepstream.embedded._processes import EmbeddedStackError

_T = TypeVar('_T')

HOST = '127.0.0.1'
"""Every embedded service listens here only, never on 0.0.0.0."""

# SeaweedFS derives a component's gRPC address from its HTTP port + 10000 in places that ignore
# the explicit `-*.port.grpc` flags (the admin worker does), so every gRPC port follows that rule.
GRPC_OFFSET = 10000
_RANDOM = random.Random(secrets.randbits(64))  # private: tests that seed `random` must not collide
_PAIRED_PORT_RANGE = (15000, 32000)  # gRPC twin lands in 25000..42000, below 65535


@dataclass(frozen=True)
class Ports:
    """The ports of one stack."""

    kafka: int
    controller: int
    """Apache Kafka's KRaft controller listener (unused with Tansu)."""
    weed: dict[str, int]
    """HTTP port of each SeaweedFS component; its gRPC port is this + `GRPC_OFFSET`."""

    @property
    def s3(self) -> int:
        """The S3 API's port."""
        return self.weed['s3']


def pick_ports(weed_components: Sequence[str]) -> Ports:
    """Free loopback ports for one stack, all distinct, held open until every one is chosen."""
    held: list[socket.socket] = []
    try:
        kafka_sock = _bind(0)
        assert kafka_sock is not None
        held.append(kafka_sock)
        kafka = kafka_sock.getsockname()[1]
        controller_sock = _bind(0)
        assert controller_sock is not None
        held.append(controller_sock)
        controller = controller_sock.getsockname()[1]
        weed: dict[str, int] = {}
        taken = {kafka, controller}
        for component in weed_components:
            for _ in range(1000):
                port = _RANDOM.randrange(*_PAIRED_PORT_RANGE)
                if {port, port + GRPC_OFFSET} & taken:
                    continue
                first = _bind(port)
                if first is None:
                    continue
                second = _bind(port + GRPC_OFFSET)
                if second is None:
                    first.close()
                    continue
                held += [first, second]
                taken |= {port, port + GRPC_OFFSET}
                weed[component] = port
                break
            else:
                raise EmbeddedStackError('no free loopback ports found for SeaweedFS')
        return Ports(kafka=kafka, controller=controller, weed=weed)
    finally:
        for sock in held:
            sock.close()


def _bind(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, port))
    except OSError:
        sock.close()
        return None
    return sock


def tcp_probe(port: int) -> None:
    """Fail fast (and quietly) until something accepts connections on the port."""
    with socket.create_connection((HOST, port), timeout=1.0):
        pass


def kafka_probe(port: int) -> None:
    """A real Kafka request to the broker on `port`: bootstrap, ApiVersions and Metadata."""
    tcp_probe(port)
    _run_coroutine(_kafka_metadata(f'{HOST}:{port}'))


async def _kafka_metadata(bootstrap: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
    try:
        await admin.start()
        await admin.list_topics()
    finally:
        await admin.close()


def _run_coroutine(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine to completion from sync code, even if this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
