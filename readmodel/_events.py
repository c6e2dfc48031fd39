"""The events view: a run's step events as the log carried them, in `seq` order."""

from __future__ import annotations

from stepstream.readmodel._shards import Shards
from stepstream.schemas import StepEvent, decode
from stepstream.storage import EVENT


class Events:
    """The `EVENT` keyspace of a run's shard, decoded."""

    def __init__(self, shards: Shards) -> None:
        self._shards = shards

    async def list_events(self, run_id: str) -> list[StepEvent]:
        """`ProjectionReader.list_events`."""

        def query() -> list[StepEvent]:
            events = []
            for _, raw in self._shards.db(run_id).scan(EVENT.prefix(run_id)):
                event = decode(raw)
                assert isinstance(event, StepEvent)
                events.append(event)
            return events

        return await self._shards.query(query)
