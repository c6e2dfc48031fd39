"""Pieces every stepstream-side workload uses: progress output, fresh topics, byte counts, percentiles."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import statistics
import struct
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from aiokafka import AIOKafkaConsumer, ConsumerRecord
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.structs import TopicPartition

from stepstream import Settings
from stepstream.producer import EventLog
from stepstream.topics import Position, ensure_topics

REPO = Path(__file__).resolve().parent.parent

EVENTLOG_LINGER_MS: int = inspect.signature(EventLog).parameters['linger_ms'].default
"""The linger `EventLog` uses by default: the raw aiokafka ceilings are configured the same."""


@dataclass(frozen=True)
class Scale:
    """How big each workload is; `quick` is for iterating on the benchmarks themselves."""

    quick: bool
    full: bool

    @property
    def ns(self) -> list[int]:
        return [50, 200] if self.quick else [50, 200, 1000]

    @property
    def repeats(self) -> int:
        return 1 if self.quick else 3

    @property
    def harness_budget_s(self) -> float | None:
        """Time budget of one reference run above N=200 (None: run to the end)."""
        return None if self.full else 30.0

    @property
    def producer_records(self) -> int:
        return 30_000 if self.quick else 150_000

    @property
    def rebuild_records(self) -> int:
        return 100_000 if self.quick else 1_000_000

    @property
    def ceiling_records(self) -> int:
        return 50_000 if self.quick else 200_000

    @property
    def freshness_s(self) -> float:
        return 8.0 if self.quick else 30.0


def say(message: str) -> None:
    """Progress, on stderr, so stdout stays the table."""
    print(message, file=sys.stderr, flush=True)


def fresh(settings: Settings, tag: str, partitions: int | None = None) -> Settings:
    """Settings with a topic prefix of its own: each measurement reads and writes only its topics."""
    changes: dict[str, Any] = {'topic_prefix': f'bench-{tag}-{uuid.uuid4().hex[:8]}'}
    if partitions is not None:
        changes['partitions'] = partitions
    return settings.replace(**changes)


async def fresh_topics(settings: Settings, tag: str) -> Settings:
    """`fresh` settings whose topics exist already, so a timed part does not create them."""
    settings = fresh(settings, tag)
    await ensure_topics(settings)
    return settings


def log_partitions(settings: Settings, count: int) -> list[TopicPartition]:
    """Every partition of both log topics."""
    topics = (settings.topics.step_events_topic, settings.topics.tool_effects_topic)
    return [TopicPartition(t, p) for t in topics for p in range(count)]


async def read_topics(settings: Settings, position: Position) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record on both log topics up to `position` (what `EventLog.flush()` returned).

    Not up to `end_offsets`: Tansu answers ListOffsets with the base offset of the partition's
    last batch + 1, so the end it reports misses the rest of that batch (see
    docs/benchmarks/history/2026-11-30-recorded-run.md, "Broker findings").
    """
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        remaining = {tp: end for tp, end in position.items() if end > 0}
        consumer.assign(list(remaining))
        await consumer.seek_to_beginning(*remaining)
        records: list[ConsumerRecord[bytes, bytes]] = []
        while remaining:
            batches = await consumer.getmany(timeout_ms=5000, max_records=10_000)
            if not batches:
                raise RuntimeError(f'the log ends before the position written: {remaining}')
            for tp, messages in batches.items():
                records.extend(m for m in messages if m.offset < remaining.get(tp, 0))
                if messages and messages[-1].offset + 1 >= remaining.get(tp, 0):
                    remaining.pop(tp, None)
        return records
    finally:
        await consumer.stop()


async def stored_bytes(settings: Settings, position: Position) -> int:
    """Bytes of the record batches the broker holds up to `position`, as stored.

    Compression and Kafka's batch framing included: the batches are fetched raw (a Fetch
    request through aiokafka's client, not its consumer, which would decompress them) and
    only their sizes are summed.
    """
    client = AIOKafkaClient(bootstrap_servers=settings.kafka.bootstrap_servers)
    await client.bootstrap()
    try:
        for topic in {tp.topic for tp in position}:
            client.add_topic(topic)
        await client.force_metadata_update()
        total = 0
        for tp, end in position.items():
            offset = 0
            while offset < end:
                leader = client.cluster.leader_for_partition(tp)
                wanted = [(tp.topic, [(tp.partition, offset, _FETCH_BYTES)])]
                # A wait above zero: Tansu answers a zero-wait fetch with no topics at all.
                response = await client.send(leader, FetchRequest(500, 1, _FETCH_BYTES, 0, wanted))
                data = response.topics[0][1][0][-1] if response.topics else b''
                walked = _walk_batches(data, end)
                if walked is None:
                    raise RuntimeError(f'no complete record batch at {tp} offset {offset}')
                size, offset = walked
                total += size
        return total
    finally:
        await client.close()


_FETCH_BYTES = 64 * 1024 * 1024


def _walk_batches(data: bytes, end: int) -> tuple[int, int] | None:
    """(bytes of the whole batches in `data` below `end`, the offset after them); None if none."""
    pos = size = 0
    next_offset = None
    while pos + 27 <= len(data):
        # Record batch v2: baseOffset int64, batchLength int32, ..., lastOffsetDelta int32 at 23.
        base, length = struct.unpack_from('>qi', data, pos)
        if base >= end:
            return size, end
        if pos + 12 + length > len(data):
            break  # a batch cut off by the fetch size: fetched again from its offset
        size += 12 + length
        next_offset = base + struct.unpack_from('>i', data, pos + 23)[0] + 1
        pos += 12 + length
    return None if next_offset is None else (size, next_offset)


def record_bytes(record: ConsumerRecord[bytes, bytes]) -> int:
    """A record's size as the producer sent it: value, key and headers."""
    return len(record.value or b'') + len(record.key or b'') + sum(len(k) + len(v) for k, v in record.headers)


class ProjectorProcess:
    """`bench.projector_child` as a child process: the projector running beside the agents."""

    def __init__(self, settings: Settings, db_path: Path) -> None:
        self.settings = settings
        self.db_path = db_path
        self._proc: asyncio.subprocess.Process | None = None
        self.report: dict[str, Any] = {}

    async def __aenter__(self) -> Self:
        env = {**os.environ, **self.settings.to_env()}
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            '-m',
            'bench.projector_child',
            str(self.db_path),
            cwd=REPO,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self._proc.stdout is not None
        line = await asyncio.wait_for(self._proc.stdout.readline(), 60)
        if line.strip() != b'ready':
            await self._proc.wait()
            raise RuntimeError(f'the projector child did not start (said {line!r})')
        return self

    async def finish(self, position: Position) -> dict[str, Any]:
        """Let the child apply everything up to `position`, and return what it applied."""
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        wanted = [[tp.topic, tp.partition, offset] for tp, offset in position.items()]
        self._proc.stdin.write(json.dumps(wanted).encode() + b'\n')
        await self._proc.stdin.drain()
        self._proc.stdin.close()
        line = await asyncio.wait_for(self._proc.stdout.readline(), 320)
        await self._proc.wait()
        self.report = json.loads(line)
        return self.report

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()


def dir_bytes(path: Path) -> int:
    """Bytes of every file under `path` (blocking: call it through `asyncio.to_thread`)."""
    return sum(p.stat().st_size for p in path.rglob('*') if p.is_file())


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) a process has used so far; 0 when it cannot be read."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank on sorted data."""
    ordered = sorted(values)
    if not ordered:
        return float('nan')
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float('nan')
