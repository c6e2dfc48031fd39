"""`DeadLetterSender`: the projector's one write to Kafka, the dead-letter queue.

A record that cannot apply goes to the DLQ with its reason, and the batch holding it commits
only once the DLQ acknowledged it: a crash in between repeats it in the DLQ on restart, and
never loses one. The DLQ being unreachable is no reason to stop projecting for good, so the
sends are retried with backoff until they are acknowledged or the projector stops.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError

from stepstream.kafka_client import AUTHORIZATION_ERRORS, access_denied, client_options
from stepstream.projector._apply import Rejection
from stepstream.settings import KafkaSettings
from stepstream.storage import dumps
from stepstream.topics import unavailable

DLQ_INLINE_BYTES = 512 * 1024
"""A dead letter whose key and value exceed this goes to the DLQ as an envelope (see `dlq_envelope`)."""

DLQ_HEAD_BYTES = 1024
"""How much of an oversized record's value an envelope keeps."""

log = logging.getLogger('stepstream.projector')

_HEADER = 'stepstream-'


@dataclass(frozen=True, slots=True)
class DeadLetterHeaders:
    """Why a record was dead-lettered and where it came from: a DLQ record's headers.

    Written by `DeadLetterSender` and read by the service's `/api/dlq` through this one
    declaration: `stepstream-dlq-reason`, `stepstream-dlq-detail` (at most 4 KiB),
    `stepstream-source-topic`, `stepstream-source-partition`, `stepstream-source-offset`, and
    `stepstream-dlq-envelope: 1` when the value is an envelope (`dlq_envelope`).
    """

    reason: str | None = None
    detail: str | None = None
    source_topic: str | None = None
    source_partition: int | None = None
    source_offset: int | None = None
    envelope: bool = False

    def encode(self) -> list[tuple[str, bytes]]:
        """The Kafka headers, in the order the projector has always written them."""
        headers = [
            (f'{_HEADER}dlq-reason', (self.reason or '').encode()),
            (f'{_HEADER}dlq-detail', (self.detail or '').encode(errors='replace')[:4096]),
            (f'{_HEADER}source-topic', (self.source_topic or '').encode()),
            (f'{_HEADER}source-partition', str(self.source_partition).encode()),
            (f'{_HEADER}source-offset', str(self.source_offset).encode()),
        ]
        if self.envelope:
            headers.append((f'{_HEADER}dlq-envelope', b'1'))
        return headers

    @classmethod
    def decode(cls, headers: Iterable[tuple[str, bytes | None]]) -> DeadLetterHeaders:
        """Read them back from any record's headers; a missing or garbled one reads as None."""
        found = {name: value for name, value in headers if value is not None}

        def text(name: str) -> str | None:
            value = found.get(f'{_HEADER}{name}')
            return None if value is None else value.decode('utf-8', 'replace')

        def number(name: str) -> int | None:
            value = text(name)
            return int(value) if value is not None and value.isdigit() else None

        return cls(
            reason=text('dlq-reason'),
            detail=text('dlq-detail'),
            source_topic=text('source-topic'),
            source_partition=number('source-partition'),
            source_offset=number('source-offset'),
            envelope=found.get(f'{_HEADER}dlq-envelope') == b'1',
        )


class DeadLetterSender:
    """Sends dead letters to `dlq_topic` (`settings.topics.dlq_topic`), with reason and source coordinates.

    ```python
    sender = DeadLetterSender(settings.kafka, settings.topics.dlq_topic, topics=(events_topic, effects_topic))
    await sender.start()
    if await sender.send(outcome.dead, stopping=lambda: False):
        txn.commit()
    ```
    """

    def __init__(self, kafka: KafkaSettings, dlq_topic: str, *, topics: tuple[str, str]) -> None:
        """`topics` are the step-events and tool-effects topic names (a letter's source topic index)."""
        self.kafka = kafka
        self.dlq_topic = dlq_topic
        self.topics = topics
        self._producer: AIOKafkaProducer | None = None

    async def start(self) -> None:
        """Connect the DLQ producer (`acks=all`)."""
        producer = AIOKafkaProducer(
            **client_options(self.kafka), acks='all', client_id='stepstream-projector-dlq'
        )
        try:
            await asyncio.wait_for(producer.start(), self.kafka.ack_timeout_s)
        except BaseException:
            await producer.stop()
            raise
        self._producer = producer

    async def stop(self) -> None:
        """Disconnect (a no-op when not started)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    async def send(self, dead: list[Rejection], *, stopping: Callable[[], bool]) -> bool:
        """Send `dead` until the DLQ acknowledges them all; False if `stopping()` meanwhile.

        A missing WRITE grant on the DLQ is raised at once: retrying cannot help.
        """
        delay = 0.2
        while True:
            try:
                await self._send(dead)
                return True
            except AUTHORIZATION_ERRORS as exc:
                raise access_denied(
                    self.kafka,
                    f'write dead letters to {self.dlq_topic}',
                    exc,
                    fix=f'grant it WRITE on {self.dlq_topic} (the projector ACL)',
                ) from exc
            except (KafkaError, TimeoutError, OSError) as exc:
                if stopping():
                    return False
                log.warning('the DLQ did not take %d record(s), retrying in %.1fs: %r', len(dead), delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _send(self, dead: list[Rejection]) -> None:
        assert self._producer is not None, 'DeadLetterSender.start() first'
        acks = []
        for letter in dead:
            source = letter.source
            topic = self.topics[source.topic]
            why = DeadLetterHeaders(letter.reason, letter.detail, topic, source.partition, source.offset)
            key, value = source.key, source.value
            if len(key or b'') + len(value or b'') > DLQ_INLINE_BYTES:
                key, value = None, dlq_envelope(letter, topic)
                why = replace(why, envelope=True)
            try:
                ack = await self._producer.send(self.dlq_topic, value, key=key, headers=why.encode())
            except MessageSizeTooLargeError:  # the DLQ's own limit is below ours: send the envelope
                ack = await self._producer.send(
                    self.dlq_topic,
                    dlq_envelope(letter, topic),
                    headers=replace(why, envelope=True).encode(),
                )
            acks.append(ack)
        try:
            await asyncio.wait_for(asyncio.gather(*acks), self.kafka.ack_timeout_s)
        except AUTHORIZATION_ERRORS:
            raise
        except (KafkaError, TimeoutError) as exc:
            raise unavailable(self.kafka, 'did not acknowledge dead-lettered records', exc) from exc


def dlq_envelope(letter: Rejection, topic: str) -> bytes:
    """What goes to the DLQ in place of a record too large for it: JSON, a few KiB at most.

    `{"reason", "detail", "topic", "partition", "offset", "key_sha256", "value_sha256",
    "value_bytes", "value_head"}`, the head being the first `DLQ_HEAD_BYTES` of the value in
    base64. The record itself stays in the source topic at those coordinates.
    """
    source = letter.source
    value = source.value or b''
    return dumps(
        {
            'reason': letter.reason,
            'detail': letter.detail[:2000],
            'topic': topic,
            'partition': source.partition,
            'offset': source.offset,
            'key_sha256': hashlib.sha256(source.key).hexdigest() if source.key is not None else None,
            'value_sha256': hashlib.sha256(value).hexdigest(),
            'value_bytes': len(value),
            'value_head': base64.b64encode(value[:DLQ_HEAD_BYTES]).decode(),
        }
    )
