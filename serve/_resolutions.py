"""The service's one write: an operator's resolution of an effect in doubt, appended to the log.

The resolution is written with the service's own `EventLog` (started on the first resolution,
unless the service was given one), then the service waits until its projection shows it.
"""

from __future__ import annotations

import asyncio

from stepstream.errors import NotFound
from stepstream.producer import EventLog, StepLog, resolve_tool_effect, resolver_id
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import Resolution, ToolEffectRecord, ToolEffectTransition
from stepstream.serve._models import Resolution as ResolutionModel
from stepstream.serve._models import Resolved, ToolEffect
from stepstream.settings import Settings


class Resolutions:
    """Writes resolutions for one service, and says whether its projection shows them yet."""

    def __init__(self, settings: Settings, reader: ProjectionReader, log: StepLog | None) -> None:
        """Write with `log`, or with an `EventLog` of `settings` started when first needed."""
        self.settings = settings
        self.reader = reader
        self._log = log
        self._owned_log: EventLog | None = None
        self._log_lock = asyncio.Lock()

    async def aclose(self) -> None:
        """Close the log this started, if it did."""
        if self._owned_log is not None:
            owned, self._owned_log = self._owned_log, None
            await owned.close()

    async def write(
        self,
        run_id: str,
        tool_call_id: str,
        *,
        resolution: Resolution,
        note: str,
        operator: str | None,
        force: bool = False,
    ) -> Resolved:
        """`Source.resolve` for a run of this service's own shards (the run is known to exist)."""
        effect = await self.reader.get_tool_effect(run_id, tool_call_id)
        if effect is None:
            raise NotFound(f'run {run_id!r} has no tool call {tool_call_id!r} in the projection')
        record = await resolve_tool_effect(
            await self.writer(),
            effect,
            resolution=resolution,
            note=note,
            operator=operator or self.settings.serve.operator_name,
            writer_id=resolver_id('serve'),
            force=force,
        )
        shown = await self.wait_shown(record)
        now = shown or await self.reader.get_tool_effect(run_id, tool_call_id) or effect
        written = next(
            (
                r
                for r in now.resolutions
                if (r.writer_id, r.resolved_at) == (record.writer_id, record.timestamp)
            ),
            None,
        )
        return Resolved(
            written=ResolutionModel.of(written)
            if written is not None
            else ResolutionModel(
                resolution=resolution,
                resolved_by=record.resolved_by or '',
                writer_id=record.writer_id,
                resolved_at=record.timestamp,
                note=note,
                resolves_seq=record.seq,
                applied=False,
            ),
            applied=shown is not None,
            effect=ToolEffect.of(now),
        )

    async def writer(self) -> StepLog:
        """The log resolutions (and decisions on deferred calls) are written to."""
        if self._log is not None:
            return self._log
        async with self._log_lock:
            if self._owned_log is None:
                log = EventLog(self.settings, create_topics=False)
                await log.start()
                self._owned_log = log
            return self._owned_log

    async def wait_shown(self, record: ToolEffectTransition) -> ToolEffectRecord | None:
        """The effect once the projection shows `record` in its ledger, or None after the timeout.

        The reader is a RocksDB secondary: it offers no change notification, so it is asked again
        every 50 ms (each ask catches up with the primary).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.kafka.ack_timeout_s
        while True:
            effect = await self.reader.get_tool_effect(record.run_id, record.tool_call_id)
            if effect is not None and any(
                (r.writer_id, r.resolved_at) == (record.writer_id, record.timestamp)
                for r in effect.resolutions
            ):
                return effect
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(0.05)
