"""What the capability needs to know about the durable-execution engine it runs under.

The capability talks to every engine through Pydantic AI's engine-neutral `@durable_operation`
surface. Two questions that surface does not answer are answered here, by looking at the
engines' own context (only when the engine is already imported; none of them is a dependency):

- Is this workflow code of an engine that journals an operation's *inputs*? Temporal records an
  activity's arguments in the workflow history and retries it with them, so the records of a
  write can travel as its arguments. DBOS and Prefect run operations in the workflow's process
  and re-compute their arguments when they recover a run, so the records must first be journaled
  as an operation's *result* (see `StepPersistence._seal_durably`).
- Was stepstream imported inside Temporal's workflow sandbox instead of passed through?
  `refuse_temporal_sandbox_import` says what to add.
- Which execution of a run wrote a record (`Attempt`, marked with `ATTEMPT_KEY` after the first).
- Is an agent run inside an engine's workflow without the durability capability (for example
  under the deprecated `DBOSAgent`/`TemporalAgent`/`PrefectAgent` wrappers)? Its run id is then
  random per attempt and its records are written outside the journal, so a recovered workflow
  would show as a second run; `refuse_undeclared_engine` says so before anything is written.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import secrets
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic_ai.exceptions import UserError

from stepstream.schemas import UNCHAINED_KINDS, LogRecord, StepEvent, chain_hash

_TEMPORAL_PASSTHROUGH_HINT = (
    "import stepstream inside `with workflow.unsafe.imports_passed_through():` in the workflow's module, "
    'or give the worker `workflow_runner=SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default'
    ".with_passthrough_modules('stepstream'))`"
)
"""What a Temporal user adds so that stepstream (and its one `EventLog`) is not re-imported per workflow."""


def in_temporal_workflow() -> bool:
    """True in Temporal workflow code (not in an activity), where operation inputs are journaled."""
    workflow = sys.modules.get('temporalio.workflow')
    return workflow is not None and bool(workflow.in_workflow())


def workflow_engine() -> str | None:
    """The engine whose workflow (or flow) code is running now, if any; None in its steps and tasks."""
    if in_temporal_workflow():
        return 'Temporal'
    dbos = sys.modules.get('dbos')
    if dbos is not None and dbos.DBOS.workflow_id is not None and dbos.DBOS.step_id is None:
        return 'DBOS'
    prefect_context = sys.modules.get('prefect.context')
    if (
        prefect_context is not None
        and prefect_context.FlowRunContext.get() is not None
        and prefect_context.TaskRunContext.get() is None
    ):
        return 'Prefect'
    return None


def refuse_undeclared_engine(in_durable_context: bool) -> None:
    """Raise `UserError` for a run in an engine's workflow code whose agent has no durability capability.

    Such a run (the deprecated `DBOSAgent`, `TemporalAgent` and `PrefectAgent` wrappers, or a plain
    agent called from a workflow) draws a random run id on every attempt and writes outside the
    engine's journal, so a recovered workflow would show as two runs with the first one never ended.
    """
    if in_durable_context:
        return
    engine = workflow_engine()
    if engine is None:
        return
    capability = f'{engine}Durability'
    raise UserError(
        f'StepPersistence runs in {engine} workflow code, but the agent has no `{capability}` capability '
        f'(the deprecated `{engine}Agent` wrapper does not provide one): a recovered workflow would be '
        f'recorded as a second run. Use `Agent(..., capabilities=[StepPersistence(...), {capability}()])`.'
    )


def refuse_temporal_sandbox_import() -> None:
    """Raise `UserError` in Temporal workflow code when stepstream was imported inside the sandbox.

    The sandbox would re-import stepstream (and aiokafka, fastavro, the S3 client) for every
    workflow task, give it a fresh, never started `EventLog`, and refuse its clock. Passed
    through, stepstream is imported once by the worker and its workflow-side code only holds
    records until the next durable write. A module imported in the sandbox sees the sandbox's
    restricted `datetime`, which is how this tells the two apart.
    """
    if not in_temporal_workflow():
        return
    try:
        datetime.now(UTC)
    except Exception as restricted:  # temporalio's RestrictedWorkflowAccessError
        raise UserError(
            'stepstream was imported inside the Temporal workflow sandbox; pass it through: '
            + _TEMPORAL_PASSTHROUGH_HINT
        ) from restricted


ATTEMPT_KEY = 'stepstream.attempt'
"""Metadata key on the events a recovered attempt writes: which attempt of the run wrote them."""


@functools.cache
def _this_process() -> str:
    """Tells the processes that executed a run's durable operations apart (see `Attempt`).

    Drawn on first use, not at import: Temporal's workflow sandbox refuses randomness at import.
    """
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Attempt:
    """Which execution of a run wrote its records, as journaled by a durable-execution engine.

    Every durable write returns the attempt that performed it. An engine that recovers a run
    returns the journaled attempt for writes that already happened, so the run can tell, before
    it writes anything new, that it is a later attempt than the one that began it.
    """

    process: str
    number: int
    head: str | None = None
    """The chain head of the records the write sent: what the log holds, so what a recovered run
    links its next record to (its rebuilt records may differ from the journaled ones it wrote)."""
    signed: str | None = None
    """The head the write's last signed head (`chain_signed`) signs, if it sent one."""

    def next_write(self) -> Attempt:
        """The attempt that performs a write in this process after this one."""
        if self.process == _this_process():
            return self
        return Attempt(_this_process(), self.number + 1)

    def wrote(self, records: Sequence[LogRecord], encode: Callable[[LogRecord], bytes]) -> Attempt:
        """The attempt, with the chain head of `records` (the batch it wrote) and the head it signed last."""
        head = signed = None
        for record in reversed(records):
            if isinstance(record, StepEvent) and record.kind in UNCHAINED_KINDS:
                signed = signed or (record.prev_hash if record.kind == 'chain_signed' else None)
                continue
            head = chain_hash(encode(record))
            break
        return dataclasses.replace(self, head=head, signed=signed)

    @staticmethod
    def first() -> Attempt:
        """The attempt that performs a run's first write, in this process."""
        return Attempt(_this_process(), 1)


def writer_id(run_id: str, context_run_id: str | None) -> str:
    """The writer of a run: the same for every execution of one run, different across runs.

    Derived from the run id and the context's run id, which a durable-execution engine gives a
    re-executed run again; two runs that reuse one explicit `run_id` (each `.run()` has its own
    context run id) still show as two writers, i.e. as a conflict.
    """
    if context_run_id is None:
        return secrets.token_hex(8)
    return hashlib.sha256(f'{run_id}\x00{context_run_id}'.encode('utf-8', 'surrogatepass')).hexdigest()[:16]
