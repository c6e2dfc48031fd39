"""Synthetic runs for the throughput workloads: the records a real run appends, without the agent.

A run is the sequence `StepPersistence` writes (see producer/_capability.py): `run_started`;
per tool step `model_request_started`, `model_request_completed`, the tool's `started`
transition and `tool_call_started` (a durability point), `completed` and `tool_call_completed`,
then `snapshot_saved` with the step's new messages (a durability point); and a closing answer,
snapshot and `run_completed`. Tool results are short (about 100 bytes) so that records average
about 300 bytes, the size the issue's ceilings are quoted for.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from aiokafka import AIOKafkaProducer
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from stepstream.producer._protocol import record_headers, topic_of
from stepstream.schemas import LogRecord, SnapshotDelta, StepEvent, ToolEffectTransition, encode
from stepstream.settings import Settings

RUN_ID_WIDTH = 18
"""Every synthetic run id has this length, so encoded templates can be re-keyed by byte replacement."""

T = TypeVar('T')


def run_id(prefix: str, index: int) -> str:
    return f'{prefix}-{index:0{RUN_ID_WIDTH - len(prefix) - 1}d}'


@dataclass(frozen=True, slots=True)
class Planned:
    """One record of a run, and whether the capability waits for its acknowledgement."""

    record: LogRecord
    durable: bool


def _tail_json(messages: list[ModelMessage]) -> str:
    return ModelMessagesTypeAdapter.dump_json(messages).decode()


def plan_run(
    rid: str, steps: int, *, start: datetime | None = None, conversation_id: str | None = None
) -> list[Planned]:
    """The records of one run with `steps` tool calls, in append order (in `conversation_id`, if given)."""
    writer = secrets.token_hex(8)
    now = start or datetime.now(UTC)
    seq = 0
    out: list[Planned] = []

    def envelope() -> dict[str, Any]:
        nonlocal seq
        seq += 1
        return {
            'run_id': rid,
            'seq': seq - 1,
            'writer_id': writer,
            'timestamp': now + timedelta(microseconds=seq),
            'agent_name': 'bench',
            'conversation_id': conversation_id,
            'parent_run_id': None,
        }

    def event(kind: Any, step: int, durable: bool = False, **fields: Any) -> None:
        env = envelope()
        key = f'{env["seq"]}:{step}:{kind}:{fields.get("tool_call_id") or ""}'
        out.append(
            Planned(StepEvent(**env, kind=kind, step_index=step, idempotency_key=key, **fields), durable)
        )

    def effect(call_id: str, status: Any, durable: bool = False) -> None:
        record = ToolEffectTransition(**envelope(), tool_call_id=call_id, tool_name='lookup', status=status)
        out.append(Planned(record, durable))

    snapshot_seq = 0

    def snapshot(step: int, prefix_len: int, tail: list[ModelMessage]) -> None:
        nonlocal snapshot_seq
        delta = SnapshotDelta(
            snapshot_seq=snapshot_seq, state='complete', prefix_len=prefix_len, messages=_tail_json(tail)
        )
        snapshot_seq += 1
        event('snapshot_saved', step, durable=True, snapshot=delta)

    history = 1  # the user prompt request
    event('run_started', 0)
    for step in range(1, steps + 1):
        call_id = f'call-{step}'
        event('model_request_started', step)
        event('model_request_completed', step)
        effect(call_id, 'started')
        event('tool_call_started', step, durable=True, tool_call_id=call_id, tool_name='lookup')
        effect(call_id, 'completed')
        event('tool_call_completed', step, tool_call_id=call_id, tool_name='lookup')
        response = ModelResponse(
            parts=[TextPart(f'Step {step}.'), ToolCallPart('lookup', {'i': step}, tool_call_id=call_id)],
            timestamp=now,
        )
        result = ToolReturnPart(
            'lookup', f'record {step:06d}: shelf 4, row 2', tool_call_id=call_id, timestamp=now
        )
        tail: list[ModelMessage] = [response, ModelRequest(parts=[result])]
        if step == 1:
            tail.insert(0, ModelRequest(parts=[UserPromptPart('Look up the records.', timestamp=now)]))
        snapshot(step, 0 if step == 1 else history, tail)
        history += 2
    event('model_request_started', steps + 1)
    event('model_request_completed', steps + 1)
    snapshot(steps + 1, history, [ModelResponse(parts=[TextPart('Done.')], timestamp=now)])
    event('run_completed', steps + 1, durable=True)
    return out


async def write_run(
    records: Iterable[tuple[T, bool]],
    send: Callable[[T], Awaitable[asyncio.Future[Any]]],
    wait: Callable[[list[asyncio.Future[Any]]], Awaitable[Any]],
) -> None:
    """One simulated run: `send` each record in order, `wait` for the sent ones at its durability points.

    The `bool` beside each record is `Planned.durable`: where the capability waits for the broker.
    """
    pending: list[asyncio.Future[Any]] = []
    for record, durable in records:
        pending.append(await send(record))
        if durable:
            await wait(pending)
            pending = []


@dataclass(frozen=True, slots=True)
class Wire:
    """A record as the producer sends it."""

    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


def to_wire(record: LogRecord, settings: Settings) -> Wire:
    """What `EventLog.append` puts on the wire for `record` (no traceparent: no trace here)."""
    topic = topic_of(record, settings.topics)
    return Wire(topic, record.run_id.encode(), encode(record), record_headers(record))


def many_runs(
    settings: Settings, prefix: str, total: int, steps: int, *, conversation_id: str | None = None
) -> Iterator[Wire]:
    """About `total` records from runs of `steps` steps: one template run, re-keyed per run.

    With `conversation_id`, every run is of that one conversation.

    Encoding a million records takes longer than sending them; since every run id has the
    same length, replacing the id's bytes in an encoded template keeps each record valid Avro.
    """
    template_id = run_id(prefix, 0)
    planned = plan_run(template_id, steps, conversation_id=conversation_id)
    template = [to_wire(p.record, settings) for p in planned]
    old = template_id.encode()
    runs = -(-total // len(template))
    for index in range(runs):
        new = run_id(prefix, index).encode()
        for w in template:
            yield Wire(w.topic, new, w.value.replace(old, new), w.headers)


async def send_wire(producer: AIOKafkaProducer, wire: Wire) -> asyncio.Future[Any]:
    """`producer.send` of a `Wire`: its acknowledgement, not awaited."""
    return await producer.send(wire.topic, wire.value, key=wire.key, headers=wire.headers)


async def gather(pending: list[asyncio.Future[Any]]) -> None:
    """Wait for every acknowledgement in `pending` (raw aiokafka's durability point)."""
    await asyncio.gather(*pending)
