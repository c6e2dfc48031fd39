"""The recovery view: everything an orchestrator needs to decide how to resume a run, in one call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stepstream.errors import StepStreamError
from stepstream.schemas import ContinuableSnapshot, RunRecord, ToolEffectRecord

if TYPE_CHECKING:
    from stepstream.readmodel._reader import ProjectionReader


@dataclass(kw_only=True)
class RecoveryReport:
    """What an orchestrator needs to decide how to resume a run.

    Its fields read by pydantic-ai-harness's names too (`RecoveryInspection`): `latest`, `settled`,
    `unresolved`, `completed_tools`, `failed_tools`.
    """

    run: RunRecord | None
    latest_snapshot: ContinuableSnapshot | None
    """The newest snapshot of any state."""
    latest_complete_snapshot: ContinuableSnapshot | None
    unresolved: list[ToolEffectRecord]
    """Calls that have not ended: `unknown_after_crash` (they may or may not have happened) or,
    while the run is live, `in_flight` (each says which: `effect.doubt`)."""
    completed_tools: list[str]
    failed_tools: list[str]
    snapshot_error: str | None = None
    """Why the snapshots could not be reconstructed, when the log broke their chain."""

    @property
    def latest(self) -> ContinuableSnapshot | None:
        """`latest_snapshot`, by the name pydantic-ai-harness's `RecoveryInspection` gives it."""
        return self.latest_snapshot

    @property
    def settled(self) -> ContinuableSnapshot | None:
        """`latest_complete_snapshot`, by the name pydantic-ai-harness's `RecoveryInspection` gives it."""
        return self.latest_complete_snapshot


async def inspect_recovery(reader: ProjectionReader, *, run_id: str) -> RecoveryReport:
    """Everything about a run's resumability in one call.

    A snapshot chain the log broke (a missing or corrupt delta) leaves the snapshots None and
    says why in `snapshot_error`; the ledger is reported all the same.
    """
    effects = await reader.list_tool_effects(run_id)
    latest = latest_complete = None
    snapshot_error = None
    try:
        latest = await reader.latest_snapshot(run_id, include_interrupted=True)
        latest_complete = await reader.latest_snapshot(run_id)
    except StepStreamError as exc:
        snapshot_error = str(exc)
    return RecoveryReport(
        run=await reader.get_run(run_id),
        latest_snapshot=latest,
        latest_complete_snapshot=latest_complete,
        unresolved=await reader.list_unresolved_tool_effects(run_id),
        completed_tools=[e.tool_name for e in effects if e.status == 'completed'],
        failed_tools=[e.tool_name for e in effects if e.status == 'failed'],
        snapshot_error=snapshot_error,
    )
