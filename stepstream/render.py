"""Plain-text and JSON renderings of projection views, shared by the CLI and the demo."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from stepstream.schemas import RunRecord, StepEvent, ToolEffectRecord


def to_json(value: Any) -> str:
    """JSON for scripts: dataclasses as objects, datetimes in ISO 8601."""

    def default(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        if isinstance(obj, datetime):
            return obj.isoformat()
        raise TypeError(f'cannot render {type(obj).__name__} as JSON')

    return json.dumps(value, default=default, indent=2)


def _time(ts: datetime | None) -> str:
    return ts.strftime('%Y-%m-%d %H:%M:%S.%f')[:-3] if ts is not None else '-'


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A left-aligned text table."""
    cells = [[str(h) for h in headers], *[[('-' if c is None else str(c)) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ['  '.join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, '  '.join('-' * w for w in widths))
    return '\n'.join(lines)


def runs_table(runs: Sequence[RunRecord]) -> str:
    """One line per run: id, agent, status, lineage, times, counts."""
    rows = [
        (
            r.run_id,
            r.agent_name,
            r.status,
            r.parent_run_id,
            r.conversation_id,
            _time(r.started_at),
            r.event_count,
            ','.join(str(lo) if lo == hi else f'{lo}-{hi}' for lo, hi in r.gaps) or None,
        )
        for r in runs
    ]
    return table(['run_id', 'agent', 'status', 'parent', 'conversation', 'started', 'records', 'gaps'], rows)


def tree(runs: Sequence[RunRecord]) -> str:
    """An indented lineage tree of `runs` (as `ProjectionReader.run_tree` returns them)."""
    depth: dict[str, int] = {}
    lines = []
    for run in runs:
        level = depth.get(run.parent_run_id, -1) + 1 if run.parent_run_id is not None else 0
        depth[run.run_id] = level
        prefix = '    ' * (level - 1) + '└── ' if level else ''
        lines.append(f'{prefix}{run.run_id}  [{run.agent_name or "-"}, {run.status}]')
    return '\n'.join(lines)


def events_table(events: Sequence[StepEvent]) -> str:
    """One line per event, in seq order."""
    rows = []
    for e in events:
        detail = e.tool_name or ''
        if e.snapshot is not None:
            detail = f'snapshot {e.snapshot.snapshot_seq} {e.snapshot.state} (prefix {e.snapshot.prefix_len})'
        if e.error:
            detail = f'{detail} {e.error}'.strip()
        rows.append((e.seq, _time(e.timestamp), e.step_index, e.kind, detail or None))
    return table(['seq', 'time', 'step', 'kind', 'detail'], rows)


def effects_table(effects: Sequence[ToolEffectRecord]) -> str:
    """One line per tool effect; `started` shows as unknown_after_crash."""
    rows = [
        (
            e.run_id,
            e.tool_call_id,
            e.tool_name,
            'unknown_after_crash' if e.unknown_after_crash else e.status,
            _time(e.started_at),
            e.idempotency_key,
            e.effect_summary,
        )
        for e in effects
    ]
    return table(['run_id', 'tool_call_id', 'tool', 'status', 'started', 'idempotency_key', 'summary'], rows)
