"""`GroupOffsets`: the offsets a projector commits to its consumer group, for lag tooling only.

A shard's own stored offsets (written in the same batch as its state) are where it resumes;
the group's committed offsets only let standard tools (`kafka-consumer-groups`, Burrow) show
lag. So they are committed at most once a second, a failed commit is only logged, and the
last ones are committed when the projector stops. A commit runs beside the apply loop, not in
it: the loop does not wait a broker round trip once a second (live, that wait delayed the
batches behind it: docs/benchmarks/history/issue-27.md, "Issue 27, third pass").
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from stepstream.topics import Position

log = logging.getLogger('stepstream.projector')


class GroupOffsets:
    """Commits applied offsets to the consumer group, at most every `interval_s`."""

    def __init__(self, *, enabled: bool = True, interval_s: float = 1.0) -> None:
        """`enabled=False` commits nothing (a rebuild does not show up in lag tooling)."""
        self.enabled = enabled
        self.interval_s = interval_s
        self._uncommitted: Position = {}
        self._last = 0.0
        self._sending: asyncio.Task[None] | None = None
        """The commit in flight, if any: one at a time, so an older one never lands after a newer."""

    @property
    def pending(self) -> bool:
        """Whether offsets were applied since the last commit, or a commit is still in flight."""
        in_flight = self._sending is not None and not self._sending.done()
        return self.enabled and (bool(self._uncommitted) or in_flight)

    async def applied(self, consumer: AIOKafkaConsumer, offsets: Position) -> None:
        """Note a batch's next offsets; commit them when `interval_s` passed since the last commit."""
        self._uncommitted.update(offsets)
        now = time.monotonic()
        if not self.enabled or now - self._last < self.interval_s:
            return
        if self._sending is not None and not self._sending.done():
            return  # the previous one is still in flight: these go with the next
        self._last = now
        self._sending = asyncio.create_task(self._send(consumer), name='stepstream-group-offsets')

    async def commit(self, consumer: AIOKafkaConsumer) -> None:
        """Commit the offsets applied since the last commit, for the partitions still owned.

        Waits for a commit in flight first, so the last offsets are the ones that stay committed.
        """
        sending, self._sending = self._sending, None
        if sending is not None:
            await asyncio.wait({sending})  # its errors are logged by `_send`
        await self._send(consumer)

    async def _send(self, consumer: AIOKafkaConsumer) -> None:
        owned = consumer.assignment()
        offsets = {tp: offset for tp, offset in self._uncommitted.items() if tp in owned}
        self._uncommitted = {}
        if not offsets or not self.enabled:
            return
        try:
            await consumer.commit(offsets)
        except KafkaError as exc:  # lag tooling only; the stored offsets are what counts
            log.debug('group offset commit failed: %r', exc)
        except Exception:  # beside the loop, nobody else would see it
            log.warning('group offset commit failed', exc_info=True)
