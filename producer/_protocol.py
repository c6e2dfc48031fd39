"""The seam between the capability and the log it appends to, and the rules every log shares.

`StepPersistence` depends on `StepLog` only: `EventLog` is the Kafka implementation, `InMemoryLog`
the in-process one its rules are tested against in milliseconds. Both refuse the same records
(`encode_record`), route them the same way (`topic_of`, the run's partition) and label them with
the same headers (`record_headers`).
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from aiokafka.structs import RecordMetadata
from opentelemetry import trace

from stepstream.errors import RecordTooLarge
from stepstream.ids import OTHER_ID_FIELDS, RUN_ID_FIELDS, check_record_ids
from stepstream.kafka_client import unavailable
from stepstream.producer._liveness import Liveness
from stepstream.schemas import LogRecord, StepEvent, encode, schema_of
from stepstream.settings import Settings
from stepstream.topics import Position

if TYPE_CHECKING:
    from stepstream.producer._sealing import Sealer

Ack = asyncio.Future[RecordMetadata]
"""Resolves when the log acknowledged one record (for Kafka: acks=all)."""

MAX_RECORD_BYTES = 1024 * 1024
"""Kafka's default `message.max.bytes`; a record above it fails before it is sent."""


@runtime_checkable
class StepLog(Protocol):
    """What `StepPersistence` needs from a log: append in order, acknowledge, flush.

    Records of one run keep their order. `encode` refuses a record before it gets its place (so
    a refused record leaves no gap in the run's `seq`); `send` queues an encoded record and
    returns its acknowledgement without waiting; `wait_acked` is a durability point and raises
    `StepStreamUnavailable` when the acknowledgements do not come in time. `liveness` keeps the
    log's open runs alive on it (heartbeats) and ends them when the log closes. `sealer` (None
    unless erasure is on) seals each conversation's content with its key (decision 0033).
    """

    settings: Settings
    liveness: Liveness
    sealer: Sealer | None

    def encode(self, record: LogRecord) -> bytes:
        """The record's bytes, or `ValueError`/`RecordTooLarge` before anything is sent."""
        ...

    async def send(self, record: LogRecord, value: bytes) -> Ack:
        """Queue a record encoded by `encode`; its acknowledgement, not awaited."""
        ...

    async def append(self, record: LogRecord) -> Ack:
        """`send(record, encode(record))`."""
        ...

    async def wait_acked(self, acks: Iterable[Ack], *, timeout: float | None = None) -> None:
        """Wait until every record in `acks` is acknowledged, or raise `StepStreamUnavailable`."""
        ...

    async def flush(self, *, timeout: float | None = None) -> Position:
        """Wait until everything appended so far is acknowledged; the position written."""
        ...


async def await_acks(settings: Settings, acks: Iterable[Ack], timeout: float | None = None) -> None:
    """Wait for `acks` within `timeout` (default `ack_timeout_s`), the rule every `StepLog` keeps.

    Raises `StepStreamUnavailable` for acknowledgements still missing at the deadline or
    cancelled; what a finished ack failed with is left to the caller, which knows its errors.
    """
    acks = acks if isinstance(acks, list) else list(acks)
    pending = [a for a in acks if not a.done()]
    if pending:
        limit = settings.ack_timeout_s if timeout is None else timeout
        await _all_done(pending, limit)
        not_done = sum(not a.done() for a in pending)
        if not_done:
            raise unavailable(settings, f'did not acknowledge {not_done} record(s)')
    if any(ack.cancelled() for ack in acks):
        raise unavailable(settings, 'did not acknowledge a cancelled send')


async def _all_done(futures: list[Ack], timeout: float) -> None:
    """Return when every future is done or `timeout` seconds passed; never cancels them.

    What `asyncio.wait(futures, timeout=...)` does, without its sets, its `ensure_future` per
    future and its done and pending sets on the way out: a durability point of every run waits
    here (256 concurrent runs put `asyncio.wait` at a tenth of the producer's time).
    """
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    left = len(futures)

    def one_done(_future: Ack) -> None:
        nonlocal left
        left -= 1
        if not left and not waiter.done():
            waiter.set_result(None)

    def expired() -> None:
        if not waiter.done():
            waiter.set_result(None)

    for future in futures:
        future.add_done_callback(one_done)
    deadline = loop.call_later(timeout, expired)
    try:
        await waiter
    finally:
        deadline.cancel()
        for future in futures:
            future.remove_done_callback(one_done)


def encode_record(record: LogRecord, max_record_bytes: int) -> bytes:
    """The record's bytes, refused with the projector's id rules or above `max_record_bytes`.

    Raises `ValueError` for an id the projector would refuse (`stepstream.ids`) and
    `RecordTooLarge` for a record above the limit.
    """
    ids = _ids_of(record)
    if ids not in _PASSED_IDS:  # a run's records repeat its ids: the rules' verdict is kept
        check_record_ids(record)  # the projector applies the same rules; refuse here, not there
        if len(_PASSED_IDS) >= 4096:
            _PASSED_IDS.clear()
        _PASSED_IDS.add(ids)
    value = encode(record)
    if len(value) > max_record_bytes:
        raise RecordTooLarge(
            f'{type(record).__name__} {getattr(record, "kind", "")} of run {record.run_id!r} seq '
            f'{record.seq} is {len(value)} bytes after encoding, above the {max_record_bytes}-byte '
            'limit; large payloads must go to the media store (lower STEPSTREAM_MEDIA_THRESHOLD_BYTES)'
        )
    return value


_ids_of = operator.attrgetter(*RUN_ID_FIELDS, *OTHER_ID_FIELDS)
"""Every id a record carries (both record types have each of these fields)."""

_PASSED_IDS: set[tuple[Any, ...]] = set()
"""Id tuples `check_record_ids` passed: the same values pass again."""


def topic_of(record: LogRecord, settings: Settings) -> str:
    """Step events and tool-effect transitions go to their own topics."""
    return settings.step_events_topic if isinstance(record, StepEvent) else settings.tool_effects_topic


def record_headers(record: LogRecord) -> list[tuple[str, bytes]]:
    """`stepstream-kind`, `stepstream-schema` and, inside a trace, W3C `traceparent` (the contract).

    The kind (a step event's kind, a transition's status) lets a consumer route or filter records
    without decoding them; the schema fingerprint in hex names the `.avsc` to decode with.
    """
    kind = record.kind if isinstance(record, StepEvent) else record.status
    pairs = _PAIRS.get((type(record), kind))
    if pairs is None:
        pairs = (
            ('stepstream-kind', kind.encode()),
            ('stepstream-schema', schema_of(record).fingerprint.hex().encode()),
        )
        if len(_PAIRS) < 256:  # kinds come from a short list; a stray one is not kept
            _PAIRS[type(record), kind] = pairs
    headers = list(pairs)
    span = trace.get_current_span().get_span_context()
    if span.is_valid:  # W3C trace context, so a consumer can join the agent's trace
        traceparent = f'00-{span.trace_id:032x}-{span.span_id:016x}-{int(span.trace_flags):02x}'
        headers.append(('traceparent', traceparent.encode()))
    return headers


_PAIRS: dict[tuple[type, str], tuple[tuple[str, bytes], tuple[str, bytes]]] = {}
"""The kind and schema pairs of each record type and kind, made once (a record is one of a few)."""
