"""Binding a `StepPersistence` to one `.run()`: the run's id, its parent and its `RunWriter`.

`StepPersistence.for_run` copies the capability for each run and calls these. The run id and the
writer id are functions of the run context (and the explicit `run_id`), never random: a run
re-executed by a durable-execution engine is the same run, same writer
(docs/decisions/0008-replay-safe-identity.md). The bound copy is seen here through `Bound`, so
this module stays below the capability.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from pydantic_ai.tools import RunContext

from stepstream.errors import StepStreamError
from stepstream.ids import to_run_id
from stepstream.media import MediaStore
from stepstream.producer._current import current_call, current_run
from stepstream.producer._engines import writer_id
from stepstream.producer._protocol import StepLog
from stepstream.producer._redaction import Redaction
from stepstream.producer._run import DurableOperations, RunWriter
from stepstream.producer._snapshots import SnapshotWriter
from stepstream.schemas import PARENT_CALL_KEY
from stepstream.signing import Signer


class Bound(DurableOperations, Protocol):
    """The run-bound copy of a `StepPersistence`, as its writer is made from it."""

    log: StepLog
    run_id: str | None
    agent_name: str | None
    parent_run_id: str | None
    metadata: dict[str, str]
    redaction: Redaction | None

    @property
    def threshold_bytes(self) -> int:
        """The media threshold in effect."""
        ...


def run_id_for(explicit: str | None, agent_name: str | None, context_run_id: str | None) -> str:
    """The run's id: the explicit `run_id`, else `{agent_name}-{ctx.run_id}`, else `ctx.run_id`."""
    if explicit is not None:
        return explicit
    if context_run_id is not None and agent_name is not None:
        return to_run_id(f'{agent_name}-{context_run_id}')
    if context_run_id is not None:
        return to_run_id(context_run_id)
    raise RuntimeError('StepPersistence needs a run id: set run_id= or agent_name=')


def parent_for(explicit: str | None) -> str | None:
    """The spawning run: the explicit `parent_run_id`, else the enclosing persisted run (`current_run`)."""
    if explicit is not None:
        return explicit
    enclosing = current_run.get()
    return enclosing.run_id if enclosing is not None else None


def with_parent_call(metadata: dict[str, str], parent_run_id: str | None) -> dict[str, str]:
    """`metadata`, naming the parent's tool call (`PARENT_CALL_KEY`) when this run starts inside one.

    Only a call of the parent run itself: a delegate given another run as its parent, or started
    outside any tool body, is linked to its parent run alone.
    """
    within = current_call.get()
    if parent_run_id is None or within is None or within[0] != parent_run_id:
        return metadata
    return {**metadata, PARENT_CALL_KEY: within[1]}


def run_writer(bound: Bound, ctx: RunContext[Any], store: MediaStore | None) -> RunWriter:
    """The writer of the run `bound` is bound to: its identity, snapshot writer and durable operations.

    `store` is None under a durable-execution engine: there the media store is only used by the
    offload operation (an activity or step), so workflow code never builds the S3 client.
    """
    run_id = bound.run_id
    assert run_id is not None
    log = bound.log
    if ctx.in_durable_context and log.sealer is not None:
        raise StepStreamError(
            'erasure (STEPSTREAM_ERASURE_KEY) is not supported under a durable-execution engine yet: '
            'unset it for this process, or run the agent outside the engine (decision 0033)'
        )
    redaction = bound.redaction if bound.redaction is not None else Redaction.from_settings(log.settings)
    return RunWriter(
        log=log,
        run_id=run_id,
        writer_id=writer_id(run_id, ctx.run_id),
        agent_name=bound.agent_name,
        parent_run_id=bound.parent_run_id,
        metadata=redaction.metadata(bound.metadata),
        context_run_id=ctx.run_id,
        durable_engine=ctx.in_durable_context,
        snapshots=SnapshotWriter(store, bound.threshold_bytes, redaction),
        operations=weakref.ref(bound),
        redaction=redaction,
        signer=Signer.from_secret(key) if (key := log.settings.security.signing_key) is not None else None,
    )
