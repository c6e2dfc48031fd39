"""Continuing and forking a run: a snapshot's messages, for `Agent.run(message_history=...)`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.erasure import ContentErased
from stepstream.schemas import ContinuableSnapshot

if TYPE_CHECKING:
    from pydantic_ai.messages import ModelMessage

    from stepstream.readmodel._reader import ProjectionReader


async def continue_run(
    reader: ProjectionReader, *, run_id: str, include_interrupted: bool = False
) -> list[ModelMessage]:
    """The latest continuable history of a run, ready for `Agent.run(message_history=...)`.

    Only `complete` snapshots unless `include_interrupted=True` (check
    `list_unresolved_tool_effects` before resuming from an interrupted one). Raises
    `LookupError` when the run has no such snapshot, and `ContentErased` when its content was
    erased (`stepstream forget`).
    """
    snapshot = await reader.latest_snapshot(run_id, include_interrupted=include_interrupted)
    if snapshot is None:
        kind = 'snapshot' if include_interrupted else 'complete snapshot'
        raise LookupError(f'no {kind} for run_id {run_id!r} in the projection')
    return _content(snapshot)


async def fork_run(
    reader: ProjectionReader,
    *,
    run_id: str,
    snapshot_seq: int | None = None,
    include_interrupted: bool = False,
) -> list[ModelMessage]:
    """The messages of any retained snapshot, to start a new run from.

    Without `snapshot_seq`, the latest complete one (or the latest of any state with
    `include_interrupted=True`), as `continue_run` picks it.
    """
    if snapshot_seq is None:
        return await continue_run(reader, run_id=run_id, include_interrupted=include_interrupted)
    snapshot = await reader.get_snapshot(run_id, snapshot_seq)
    if snapshot is None:
        raise LookupError(f'run_id {run_id!r} has no snapshot {snapshot_seq} in the projection')
    return _content(snapshot)


def _content(snapshot: ContinuableSnapshot) -> list[ModelMessage]:
    if snapshot.erased:
        raise ContentErased(
            f'the content of run {snapshot.run_id!r} (conversation {snapshot.conversation_id!r}) was '
            'erased: its structure remains, its messages cannot be continued from'
        )
    return snapshot.messages
