"""The seam between the capability and the log it appends to, and the rules every log shares.

`StepPersistence` depends on `StepLog` only: `EventLog` is the Kafka implementation, `InMemoryLog`
the in-process one its rules are tested against in milliseconds. Both refuse the same records
(`encode_record`), route them the same way (`topic_of`, the run's partition) and label them with
the same headers (`record_headers`).

Both serve every thread and event loop of the process (decision 0052). An acknowledgement is a
future of the loop that appended the record, and only that loop's thread completes it: what
crosses between loops goes through a `Mailbox` (or `wake`); no thread completes another loop's future.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import operator
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from aiokafka.structs import RecordMetadata
from opentelemetry import trace

from stepstream.errors import RecordTooLarge, StepStreamError, StepStreamUnavailable
from stepstream.ids import OTHER_ID_FIELDS, RUN_ID_FIELDS, check_record_ids
from stepstream.kafka_client import unavailable
from stepstream.producer._liveness import Liveness
from stepstream.schemas import LogRecord, StepEvent, encode, schema_of
from stepstream.settings import KafkaSettings, Settings, TopicSettings
from stepstream.topics import Position

if TYPE_CHECKING:
    from stepstream.producer._sealing import Sealer

Ack = asyncio.Future[RecordMetadata]
"""Resolves when the log acknowledged one record (for Kafka: acks=all); a future of the appending loop."""

logger = logging.getLogger('stepstream.producer')

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

    Every method may be called from any thread's event loop; an acknowledgement belongs to the
    loop that appended its record, and is waited for there.
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


async def await_acks(kafka: KafkaSettings, acks: Iterable[Ack], timeout: float | None = None) -> None:
    """Wait for `acks` within `timeout` (default `ack_timeout_s`), the rule every `StepLog` keeps.

    Raises `StepStreamUnavailable` for acknowledgements still missing at the deadline or
    cancelled; what a finished ack failed with is left to the caller, which knows its errors.
    """
    acks = acks if isinstance(acks, list) else list(acks)
    pending = [a for a in acks if not a.done()]
    if pending:
        limit = kafka.ack_timeout_s if timeout is None else timeout
        await all_done(pending, limit)
        not_done = sum(not a.done() for a in pending)
        if not_done:
            raise unavailable(kafka, f'did not acknowledge {not_done} record(s)')
    if any(ack.cancelled() for ack in acks):
        raise unavailable(kafka, 'did not acknowledge a cancelled send')


async def all_done(futures: Sequence[asyncio.Future[Any]], timeout: float) -> None:
    """Return when every future is done or `timeout` seconds passed; never cancels them.

    What `asyncio.wait(futures, timeout=...)` does, without its sets, its `ensure_future` per
    future and its done and pending sets on the way out: a durability point of every run waits
    here (256 concurrent runs put `asyncio.wait` at a tenth of the producer's time).
    """
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    left = len(futures)

    def one_done(_future: asyncio.Future[Any]) -> None:
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


class Mailbox:
    """Calls posted from any thread, run on one event loop in the order each thread posted them.

    The one way the logs cross threads: a future belongs to its loop, and only that loop's thread
    may complete it or run its callbacks; `call_soon_threadsafe` is what wakes a loop from another
    thread. One wake-up serves every call posted before the loop gets to them, so a step's records,
    or a batch's acknowledgements, cross in one.
    """

    __slots__ = ('_calls', '_due', 'loop')

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._calls: collections.deque[tuple[Callable[..., object], tuple[object, ...]]] = collections.deque()
        self._due = False

    def post(self, call: Callable[..., object], *args: object) -> None:
        """Run `call(*args)` on the loop soon, after every call this thread posted before.

        Raises `RuntimeError` when the loop is closed (nothing will run it).
        """
        self._calls.append((call, args))
        if not self._due:
            self._due = True
            self.loop.call_soon_threadsafe(self.run)

    def put(self, call: Callable[..., object], *args: object) -> None:
        """Queue `call(*args)` without waking the loop: it runs with the next call posted (or `run`)."""
        self._calls.append((call, args))

    def wake(self) -> None:
        """Run the calls put so far soon (on the loop's thread). Raises `RuntimeError` when it is closed."""
        if self._calls and not self._due:
            self._due = True
            self.loop.call_soon_threadsafe(self.run)

    def run(self) -> None:
        """Run every call posted so far, in order (on the loop's thread)."""
        # Cleared before the calls are taken: a call posted meanwhile is run here or wakes us again.
        self._due = False
        calls = self._calls
        while calls:
            call, args = calls.popleft()
            try:
                call(*args)
            except Exception:
                logger.exception('stepstream: a call handed over from another thread failed')

    @property
    def waiting(self) -> int:
        """Calls posted and not run yet: a loop that holds some for long is not turning."""
        return len(self._calls)


def wake(waiter: asyncio.Future[None]) -> None:
    """Resolve `waiter` (a future of any loop) from any thread; a waiter of a closed loop is left."""
    loop = waiter.get_loop()
    if loop is asyncio._get_running_loop():
        if not waiter.done():
            waiter.set_result(None)
        return
    with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits on it
        loop.call_soon_threadsafe(_wake_here, waiter)


def _wake_here(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


T = TypeVar('T')

ONE_LOG_PER_PROCESS = 'docs/recording.md, "One EventLog per process"'
"""Where the docs say how to share one log among threads and loops."""


async def run_on(loop: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, T], limit: float) -> T:
    """Run `work` on `loop` (another thread's) and wait for it here, at most `limit` seconds.

    Raises `loop_gone` when `loop` no longer runs, and `loop_blocked` when it did not finish
    `work` in time (its own deadlines, shorter, raise first while the loop turns).
    """
    if not loop.is_running():
        work.close()
        raise loop_gone(loop)
    try:
        running = asyncio.run_coroutine_threadsafe(work, loop)
    except RuntimeError:  # closed just now
        work.close()
        raise loop_gone(loop) from None
    try:
        async with asyncio.timeout(limit):
            return await asyncio.wrap_future(running)
    except TimeoutError:
        running.cancel()
        raise loop_blocked(limit) from None


def gone(loop: asyncio.AbstractEventLoop) -> str:
    """What became of a loop that no longer runs."""
    return 'was closed' if loop.is_closed() else 'is not running'


def loop_gone(loop: asyncio.AbstractEventLoop) -> StepStreamError:
    """The refusal of a record (or a wait) from another loop that no loop would ever send."""
    return StepStreamError(
        f'EventLog: the event loop it was started on {gone(loop)}, so nothing would send this record '
        '(a log started inside an `asyncio.run` that has returned, say). Start the log on a loop that '
        f'lives as long as the process (a thread of its own: {ONE_LOG_PER_PROCESS}), or open an '
        'EventLog inside each event loop that runs agents.'
    )


def loop_blocked(waited: float) -> StepStreamUnavailable:
    """The error for records from another loop that the log's own loop did not take in time."""
    return StepStreamUnavailable(
        f'EventLog: its event loop did not run for {waited:g}s, so the records of this thread were '
        'not sent (the loop the log was started on is busy in blocking code, or waits on this '
        f'thread). Keep that loop free, or start the log on a thread of its own ({ONE_LOG_PER_PROCESS}).'
    )


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


def topic_of(record: LogRecord, topics: TopicSettings) -> str:
    """Step events and tool-effect transitions go to their own topics."""
    return topics.step_events_topic if isinstance(record, StepEvent) else topics.tool_effects_topic


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
