"""`GroupOffsets`: the offsets a projector commits to its consumer group, for lag tooling only.

A shard's own stored offsets (written in the same batch as its state) are where it resumes;
the group's committed offsets only let standard tools (`kafka-consumer-groups`, Burrow) show
lag. So they are committed at most once a second, a failed commit is only logged, and the
last ones are committed when the projector stops.
"""

from __future__ import annotations

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

    @property
    def pending(self) -> bool:
        """Whether offsets were applied since the last commit."""
        return self.enabled and bool(self._uncommitted)

    async def applied(self, consumer: AIOKafkaConsumer, offsets: Position) -> None:
        """Note a batch's next offsets; commit them when `interval_s` passed since the last commit."""
        self._uncommitted.update(offsets)
        now = time.monotonic()
        if not self.enabled or now - self._last < self.interval_s:
            return
        self._last = now
        await self.commit(consumer)

    async def commit(self, consumer: AIOKafkaConsumer) -> None:
        """Commit the offsets applied since the last commit, for the partitions still owned."""
        owned = consumer.assignment()
        offsets = {tp: offset for tp, offset in self._uncommitted.items() if tp in owned}
        self._uncommitted = {}
        if not offsets or not self.enabled:
            return
        try:
            await consumer.commit(offsets)
        except KafkaError as exc:  # lag tooling only; the stored offsets are what counts
            log.debug('group offset commit failed: %r', exc)
