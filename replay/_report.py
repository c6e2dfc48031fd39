"""What a replay reports: the outcome, and the first divergence with where it is and a diff."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic_core import to_jsonable_python

from stepstream.replay._compare import diff

ToolMode = Literal['recorded', 'live']
Outcome = Literal['matched', 'diverged', 'in_doubt', 'erased', 'unreplayable', 'forked']

NOT_RECORDED = (
    'written before schema v6: tool definitions, model settings and the output type are not in this '
    "run's records, so they were not checked"
)


@dataclass(slots=True)
class Divergence:
    """The first place the replayed code did something the recording did not."""

    step: int
    """The step as the log numbers it (`step_index`: the model request it happened in or after)."""
    kind: str
    """`instructions`, `tool_definitions`, `output_type`, `settings`, `request_content`, `response`
    (the response that entered the history, after the code's capabilities, is not the recorded
    one), `tool_name`, `tool_arguments` (a call's arguments differ from the recorded call's: changed
    by a capability, or refused by the tool), `tool_result`, `final_output`, `extra_request` (the
    code made a request the recording does not have), `missing_request` (a recorded request the
    code did not make) or `error` (the code raised)."""
    detail: str
    recorded: Any = None
    replayed: Any = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    @property
    def diff(self) -> str:
        """A unified diff of the recorded and replayed values."""
        return diff(self.recorded, self.replayed)


@dataclass(slots=True)
class ReplayReport:
    """What replaying one run found."""

    run_id: str
    outcome: Outcome
    """`matched`; `diverged` (see `divergence`); `in_doubt` (matched up to a tool call the recording
    holds in doubt, where replay stops); `erased` or `unreplayable` (see `detail`)."""
    steps: int = 0
    """Model requests served from the recording."""
    tools: ToolMode = 'recorded'
    divergence: Divergence | None = None
    detail: str = ''
    notes: list[str] = field(default_factory=list)
    forked_run_id: str | None = None
    """A fork's new run (`stepstream.replay.fork_run_from_step`), written from the live step on."""

    @property
    def ok(self) -> bool:
        """True when nothing the recording holds was done differently (`matched`, `in_doubt`, `forked`)."""
        return self.outcome in ('matched', 'in_doubt', 'forked')

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data (`stepstream replay --json`)."""
        divergence = self.divergence
        return {
            'run_id': self.run_id,
            'outcome': self.outcome,
            'ok': self.ok,
            'steps': self.steps,
            'tools': self.tools,
            'detail': self.detail,
            'notes': self.notes,
            'forked_run_id': self.forked_run_id,
            'divergence': None
            if divergence is None
            else {
                'step': divergence.step,
                'kind': divergence.kind,
                'detail': divergence.detail,
                'tool_name': divergence.tool_name,
                'tool_call_id': divergence.tool_call_id,
                'recorded': to_jsonable_python(divergence.recorded, fallback=str),
                'replayed': to_jsonable_python(divergence.replayed, fallback=str),
                'diff': divergence.diff,
            },
        }

    def text(self) -> str:
        """The report for a person: one line, and for a divergence where and what, with its diff."""
        head = f'{self.run_id}: {self.outcome} after {self.steps} step(s), tools {self.tools}'
        lines = [head + (f': {self.detail}' if self.detail else '')]
        if self.divergence is not None:
            d = self.divergence
            call = f' ({d.tool_name} {d.tool_call_id})' if d.tool_name else ''
            lines += [
                f'  step {d.step}: {d.kind}{call}: {d.detail}',
                *('  ' + x for x in d.diff.splitlines()),
            ]
        lines += [f'  note: {note}' for note in self.notes]
        return '\n'.join(lines)
