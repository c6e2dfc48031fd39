"""The projector's rules without a broker: an `InMemoryLog`'s records applied to a `MemoryShard`.

The fast tier's stand-in for `Projector` where a test is about what the capability writes: the
same `Applier` stages the same bytes, at the offsets the in-memory log gave them, and a
`ProjectionReader` reads the result. test_e2e.py and the property tests on the real broker prove
that the pipeline between them (produce, fetch, commit) changes nothing.
"""

from __future__ import annotations

from typing import Any

from stepstream.media import MediaStore
from stepstream.producer import InMemoryLog
from stepstream.projector._apply import EFFECTS, EVENTS, Applier, Rejection, SourceRecord
from stepstream.readmodel import ProjectionReader
from stepstream.storage import LiveShards, MemoryShard
from stepstream.topics import Position


class MemoryProjection:
    """`wait_for` applies what `log` stored since the last call; `reader()` reads the projection."""

    def __init__(self, log: InMemoryLog, media_store: MediaStore | None = None) -> None:
        """Apply `log`'s records; the reader restores offloaded media from `media_store` (None: none)."""
        settings = log.settings
        self.media_store = media_store
        self.log = log
        self.shard = MemoryShard()
        self.applier = Applier(
            (settings.topics.step_events_topic, settings.topics.tool_effects_topic),
            partitions=settings.topics.partitions,
        )
        self._topics = {
            settings.topics.step_events_topic: EVENTS,
            settings.topics.tool_effects_topic: EFFECTS,
        }
        self._applied = 0
        self.dead: list[Rejection] = []
        """Every record the rules dead-lettered, in order."""
        self.duplicates_ignored = 0

    async def wait_for(self, position: Position | None = None) -> None:
        """Apply every record stored so far, as one batch (a flush's `position` is within them)."""
        new = self.log.records[self._applied :]
        self._applied += len(new)
        sources = [SourceRecord(self._topics[r.topic], r.partition, r.offset, r.key, r.value) for r in new]
        txn, outcome = self.applier.stage(self.shard, sources)
        txn.commit()
        self.dead += outcome.dead
        self.duplicates_ignored += outcome.duplicates

    def reader(self) -> ProjectionReader:
        """A reader of the projection as it stands."""
        return ProjectionReader.of(self)

    def live_shards(self) -> LiveShards:
        """Its one shard, holding every partition's runs (`ProjectionReader.of` reads it)."""
        return LiveShards(
            {0: self.shard},
            partitions=1,
            media_store=self.media_store,
            keys=None,
            stale_after_s=20.0,
            scope=None,
        )


class CountingShard(MemoryShard):
    """A shard that counts the keys its scans hand out (how much a page reads)."""

    handed = 0

    def scan(self, prefix: bytes, *, start: bytes | None = None, reverse: bool = False) -> Any:
        """`MemoryShard.scan`, counting each key it yields in `CountingShard.handed`."""
        for item in super().scan(prefix, start=start, reverse=reverse):
            CountingShard.handed += 1
            yield item
