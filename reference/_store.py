"""`ReferenceStore`: the projection, read through the reference's `StepStore` protocol.

Code written against pydantic-ai-harness's store (its `inspect_recovery`, `continue_run`,
`fork_run`, `ConversationSearch(SnapshotHistorySource(store))`, an orchestrator's own reads) is
pointed at stepstream's projection unchanged. It reads only: runs are written by their writer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn, Protocol

from stepstream import schemas
from stepstream.errors import ReadOnlyStore
from stepstream.reference import _convert

if TYPE_CHECKING:
    import httpx
    from pydantic_ai_harness.step_persistence import (
        ContinuableSnapshot,
        RunRecord,
        StepEvent,
        ToolEffectRecord,
    )

HOW_TO_WRITE = (
    'new runs are written by their agents through stepstream.producer.StepPersistence (the capability, '
    "in place of the reference's), and the runs of an existing pydantic-ai-harness store are copied "
    'onto the log by `stepstream import`'
)


class Reads(Protocol):
    """The reads a `ReferenceStore` makes: a `ProjectionReader`'s, or a `ServedReader`'s over HTTP."""

    async def get_run(self, run_id: str) -> schemas.RunRecord | None:
        """The run, or None."""
        ...

    async def list_runs(
        self, conversation_id: str | None = None, parent_run_id: str | None = None
    ) -> list[schemas.RunRecord]:
        """The runs matching both filters, in the order they started."""
        ...

    async def list_events(self, run_id: str) -> list[schemas.StepEvent]:
        """The run's step events in `seq` order."""
        ...

    async def latest_snapshot(
        self, run_id: str, include_interrupted: bool = False
    ) -> schemas.ContinuableSnapshot | None:
        """The newest complete snapshot (or newest of any state), or None."""
        ...

    async def list_snapshots(
        self, run_id: str, include_interrupted: bool = False
    ) -> list[schemas.ContinuableSnapshot]:
        """The run's retained snapshots, oldest first."""
        ...

    async def get_tool_effect(self, run_id: str, tool_call_id: str) -> schemas.ToolEffectRecord | None:
        """One call's effect, or None."""
        ...

    async def list_tool_effects(self, run_id: str) -> list[schemas.ToolEffectRecord]:
        """The run's effects, in the order the calls started."""
        ...


class ReferenceStore:
    """The reference's `StepStore` over a `ProjectionReader`: its read methods, its records, its rules.

    ```python
    from pydantic_ai_harness.step_persistence import continue_run
    from stepstream.readmodel import ProjectionReader
    from stepstream.reference import ReferenceStore

    async with ProjectionReader.from_settings(settings) as reader:
        history = await continue_run(ReferenceStore(reader), run_id='support-0193...')
    ```

    Every read answers what the reference's own store would for the same run (docs/migrating.md
    lists what has no counterpart): interrupted snapshots are left out unless asked for, runs come
    in the order they started, a call that has not ended is `started`. The writes of the protocol
    (`register_run`, `append_event`, `save_snapshot`, `record_tool_effect`) raise `ReadOnlyStore`.
    The records are pydantic-ai-harness's, which must be installed (`pip install --no-deps
    pydantic-ai-harness`); stepstream never needs it otherwise.
    """

    def __init__(self, reader: Reads) -> None:
        """A store over `reader`: a `ProjectionReader` (in process), or a `ServedReader` (`served`)."""
        self.reader = reader
        """What it reads (a `ProjectionReader` is closed by its owner, not by the store)."""

    @classmethod
    def served(
        cls, url: str, *, token: str | None = None, client: httpx.AsyncClient | None = None
    ) -> ReferenceStore:
        """A store that asks a read service (`stepstream serve` at `url`) instead of opening the projection.

        `token` is the service's bearer token when it asks for one; `client` an `httpx.AsyncClient`
        of the caller's. Close the store with `aclose` (or `async with`). Offloaded media read as
        the service's links (`/api/media/{sha256}`), not restored bytes: the one difference from
        the store in process.

        ```python
        async with ReferenceStore.served('http://projection.internal:8000', token=token) as store:
            report = await inspect_recovery(store=store, run_id='support-0193...')
        ```
        """
        from stepstream.reference._served import ServedReader

        return cls(ServedReader(url, token=token, client=client))

    async def __aenter__(self) -> ReferenceStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close what the store opened itself (a `served` store's HTTP client); a reader given stays open."""
        from stepstream.reference._served import ServedReader

        if isinstance(self.reader, ServedReader):
            await self.reader.aclose()

    # -- runs ------------------------------------------------------------------------------------

    async def get_run(self, *, run_id: str) -> RunRecord | None:
        """The run's lineage, or None when the projection has not seen it."""
        run = await self.reader.get_run(run_id)
        return None if run is None else _convert.run_record(run)

    async def list_runs(
        self, *, parent_run_id: str | None = None, conversation_id: str | None = None
    ) -> list[RunRecord]:
        """Runs matching both filters (each optional), sorted by `started_at` ascending."""
        runs = await self.reader.list_runs(conversation_id=conversation_id, parent_run_id=parent_run_id)
        records = [_convert.run_record(run) for run in runs]
        return sorted(records, key=lambda record: record.started_at)

    # -- events and snapshots --------------------------------------------------------------------

    async def list_events(self, *, run_id: str) -> list[StepEvent]:
        """The run's events of the reference's kinds, in the order they were written."""
        return _convert.events(await self.reader.list_events(run_id))

    async def latest_snapshot(
        self, *, run_id: str, include_interrupted: bool = False
    ) -> ContinuableSnapshot | None:
        """The newest `complete` snapshot (with `include_interrupted`, the newest of any state), or None."""
        snap = await self.reader.latest_snapshot(run_id, include_interrupted)
        return None if snap is None else _convert.snapshot(snap)

    async def list_snapshots(
        self, *, run_id: str, include_interrupted: bool = False
    ) -> list[ContinuableSnapshot]:
        """The run's retained snapshots in write order; `interrupted` ones only with `include_interrupted`.

        Not in the reference's `StepStore` protocol, but on each of its stores, and what
        `SnapshotHistorySource` reads. A snapshot whose content was erased is left out.
        """
        snaps = await self.reader.list_snapshots(run_id, include_interrupted)
        return [_convert.snapshot(snap) for snap in snaps if not snap.erased]

    # -- tool effects ----------------------------------------------------------------------------

    async def get_tool_effect(self, *, run_id: str, tool_call_id: str) -> ToolEffectRecord | None:
        """The call's effect record, or None."""
        found = await self.reader.get_tool_effect(run_id, tool_call_id)
        return None if found is None else _convert.effect(found)

    async def list_unresolved_tool_effects(self, *, run_id: str) -> list[ToolEffectRecord]:
        """The run's calls whose status is `started` (they have not ended), in the order they started."""
        effects = [_convert.effect(found) for found in await self.reader.list_tool_effects(run_id)]
        return [found for found in effects if found is not None and found.status == 'started']

    # -- the protocol's writes: refused ----------------------------------------------------------

    async def register_run(self, record: RunRecord) -> NoReturn:
        """Refused: `ReadOnlyStore` says how runs are written."""
        _refuse('register_run', record.run_id)

    async def append_event(self, event: StepEvent) -> NoReturn:
        """Refused: `ReadOnlyStore` says how runs are written."""
        _refuse('append_event', event.run_id)

    async def save_snapshot(self, snapshot: ContinuableSnapshot) -> NoReturn:
        """Refused: `ReadOnlyStore` says how runs are written."""
        _refuse('save_snapshot', snapshot.run_id)

    async def record_tool_effect(self, record: ToolEffectRecord) -> NoReturn:
        """Refused: `ReadOnlyStore` says how runs are written."""
        _refuse('record_tool_effect', record.run_id)


def _refuse(method: str, run_id: str) -> NoReturn:
    raise ReadOnlyStore(
        f'ReferenceStore.{method} (run {run_id!r}): this store reads the projection and writes nothing; '
        f'{HOW_TO_WRITE}'
    )
