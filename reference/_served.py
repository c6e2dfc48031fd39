"""`ServedReader`: the reads a `ReferenceStore` makes, asked of a read service (`stepstream serve`) over HTTP.

For a process that cannot open the projection itself (another host, no RocksDB): it asks the
service's JSON API (`/api/runs`, `/api/runs/{id}/events`, `.../snapshots`, `.../tool-effects`) and
hands back the read model's records, which `ReferenceStore` turns into the reference's as it does
a `ProjectionReader`'s. httpx (the `serve` extra) is imported when one is made.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from stepstream.errors import StepStreamUnavailable
from stepstream.schemas import ContinuableSnapshot, RunRecord, StepEvent, ToolEffectRecord

if TYPE_CHECKING:
    import httpx

PAGE = 1000
"""The largest page the API gives (`limit`): a run's snapshots and a listing of runs come in pages of it."""


def _time(value: Any) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value)


class ServedReader:
    """A read service's answers as the read model's records: what `ReferenceStore.served` reads through.

    `url` is the service (`http://host:8000`), `token` its bearer token (`STEPSTREAM_SERVE_TOKEN`)
    when it asks for one; `client` an `httpx.AsyncClient` of the caller's (closed by the caller).
    Offloaded media come back as the links the API gives (`/api/media/{sha256}`), not as bytes.
    """

    def __init__(
        self, url: str, *, token: str | None = None, client: httpx.AsyncClient | None = None
    ) -> None:
        import httpx

        headers = {'Authorization': f'Bearer {token}'} if token else {}
        self._owned = client is None
        self._client = client if client is not None else httpx.AsyncClient(base_url=url, timeout=30.0)
        self._base = url.rstrip('/')
        self._headers = headers

    async def aclose(self) -> None:
        """Close the HTTP client if this reader made it."""
        if self._owned:
            await self._client.aclose()

    async def _get(self, path: str, **params: Any) -> Any:
        """The JSON at `/api{path}`, or None for a 404 (an unknown run or snapshot)."""
        import httpx

        query = {k: v for k, v in params.items() if v is not None}
        try:
            response = await self._client.get(f'{self._base}/api{path}', params=query, headers=self._headers)
        except httpx.HTTPError as exc:
            raise StepStreamUnavailable(f'the read service at {self._base} did not answer: {exc}') from exc
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise StepStreamUnavailable(
                f'the read service at {self._base} answered {response.status_code} to {path}: {response.text}'
            )
        return response.json()

    async def get_run(self, run_id: str) -> RunRecord | None:
        """The run, or None when the service does not hold it."""
        found = await self._get(f'/runs/{run_id}')
        return None if found is None else _run(found)

    async def list_runs(
        self, conversation_id: str | None = None, parent_run_id: str | None = None
    ) -> list[RunRecord]:
        """Every run matching both filters, in the order they started (page after page)."""
        runs: list[RunRecord] = []
        after = None
        while True:
            page = await self._get(
                '/runs',
                conversation_id=conversation_id,
                parent_run_id=parent_run_id,
                order='started',
                limit=PAGE,
                after=after,
            )
            if page is None:
                return runs
            runs += [_run(run) for run in page['runs']]
            after = page['next_after']
            if after is None:
                return runs

    async def list_events(self, run_id: str) -> list[StepEvent]:
        """The run's step events in `seq` order ([] for a run it does not hold)."""
        return [_event(event) for event in await self._get(f'/runs/{run_id}/events') or []]

    async def list_snapshots(
        self, run_id: str, include_interrupted: bool = False
    ) -> list[ContinuableSnapshot]:
        """The run's retained snapshots, oldest first, each with its history (one request each)."""
        run = await self.get_run(run_id)
        if run is None:
            return []
        out = []
        for summary in await self._summaries(run_id):
            if include_interrupted or summary['state'] == 'complete':
                snap = await self._snapshot(run, summary['snapshot_seq'])
                if snap is not None:
                    out.append(snap)
        return out

    async def latest_snapshot(
        self, run_id: str, include_interrupted: bool = False
    ) -> ContinuableSnapshot | None:
        """The newest `complete` snapshot (with `include_interrupted`, the newest of any state), or None."""
        run = await self.get_run(run_id)
        if run is None:
            return None
        for summary in reversed(await self._summaries(run_id)):
            if include_interrupted or summary['state'] == 'complete':
                return await self._snapshot(run, summary['snapshot_seq'])
        return None

    async def _summaries(self, run_id: str) -> list[dict[str, Any]]:
        summaries: list[dict[str, Any]] = []
        after = None
        while True:
            page = await self._get(f'/runs/{run_id}/snapshots', after=after, limit=PAGE)
            if page is None:
                return summaries
            summaries += page['snapshots']
            after = page['next_after']
            if after is None:
                return summaries

    async def _snapshot(self, run: RunRecord, snapshot_seq: int) -> ContinuableSnapshot | None:
        from pydantic_ai.messages import ModelMessagesTypeAdapter

        found = await self._get(f'/runs/{run.run_id}/snapshots/{snapshot_seq}')
        if found is None:
            return None
        return ContinuableSnapshot(
            run_id=run.run_id,
            step_index=found['step_index'],
            messages=ModelMessagesTypeAdapter.validate_python(found['messages']),
            snapshot_seq=found['snapshot_seq'],
            seq=found['seq'],
            conversation_id=run.conversation_id,
            parent_run_id=run.parent_run_id,
            agent_name=run.agent_name,
            timestamp=_time(found['timestamp']),
            state=found['state'],
            idempotency_key=found['idempotency_key'],
            erased=found.get('erased', False),
        )

    async def list_tool_effects(self, run_id: str) -> list[ToolEffectRecord]:
        """Every tool effect of the run, in the order the calls started ([] for a run it does not hold)."""
        return [_effect(effect) for effect in await self._get(f'/runs/{run_id}/tool-effects') or []]

    async def get_tool_effect(self, run_id: str, tool_call_id: str) -> ToolEffectRecord | None:
        """One call's effect, or None."""
        found = [e for e in await self.list_tool_effects(run_id) if e.tool_call_id == tool_call_id]
        return found[0] if found else None


def _run(data: dict[str, Any]) -> RunRecord:
    return _record(RunRecord, data)


def _event(data: dict[str, Any]) -> StepEvent:
    return _record(StepEvent, data)


def _effect(data: dict[str, Any]) -> ToolEffectRecord:
    return _record(ToolEffectRecord, data)


_R = TypeVar('_R')
_ADAPTERS: dict[type, Any] = {}


def _record(record: type[_R], data: dict[str, Any]) -> _R:
    """The API's JSON of a record as the record: its one declaration read back (decision 0044)."""
    from pydantic import TypeAdapter

    adapter = _ADAPTERS.get(record)
    if adapter is None:
        adapter = _ADAPTERS[record] = TypeAdapter(record)
    found: _R = adapter.validate_python(data)
    return found
