"""Plain-text and JSON renderings of the read model's views, shared by the console views and the demo.

Runs, lineage trees, events, tool effects and histories, and the table and JSON they are made of;
what the operator's commands show of the projection itself (status, retention) is in `_status`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from stepstream.console._fit import fit, ident, table, time_text, when, wrap
from stepstream.console._timeline import Answer, Answered, other_topic_seqs, seq_note
from stepstream.ids import short_id
from stepstream.schemas import RunRecord, StepEvent, ToolEffectRecord


def to_json(value: Any, *, indent: int | None = 2) -> str:
    """JSON for scripts: dataclasses as objects, datetimes in ISO 8601 (`indent=None`: one line)."""

    def default(obj: Any) -> Any:
        if isinstance(obj, UnresolvedEffect):
            return {**default(obj.effect), 'run_status': obj.run_status}
        if isinstance(obj, ToolEffectRecord):  # the status the table shows, and the flag behind it
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return {
                **fields,
                'status': effect_status(obj),
                'unknown_after_crash': obj.unknown_after_crash,
                'in_flight': obj.in_flight,
            }
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        if isinstance(obj, datetime):
            return obj.isoformat()
        raise TypeError(f'cannot render {type(obj).__name__} as JSON')

    return json.dumps(value, default=default, indent=indent)


def runs_table(runs: Sequence[RunRecord], *, wide: bool = False) -> str:
    """One line per run: id, agent, status, chain, lineage, times, counts, tokens (in/out) and cost.

    In 120 columns (not `wide`): ids shortened, no conversation or record count, and what is amiss
    (a broken chain, gaps, an expired parent) in one `note` column, there when a run on the page
    has one; the agent, then the note, are cut to fit.
    """
    if not wide:
        rows = [
            (
                short_id(r.run_id),
                r.agent_name,
                r.status,
                ident(r.parent_run_id, wide),
                when(r.started_at, wide),
                _tokens(r),
                _cost(r.usage.cost_usd, r.usage.unpriced_requests),
                _amiss(r),
            )
            for r in runs
        ]
        headers = ['run_id', 'agent', 'status', 'parent', 'started', 'tokens', 'cost', 'note']
        noted = any(row[-1] for row in rows)
        return fit(headers, rows, wide=False, shown=headers if noted else headers[:-1], cut=('agent', 'note'))
    full = [
        (
            r.run_id,
            r.agent_name,
            r.status,
            f'broken@{r.chain_break_seq}' if r.chain == 'broken' else r.chain,
            f'{r.parent_run_id} (expired)' if r.parent_expired else r.parent_run_id,
            r.conversation_id,
            time_text(r.started_at),
            r.event_count,
            _gaps(r) or None,
            _tokens(r),
            _cost(r.usage.cost_usd, r.usage.unpriced_requests),
        )
        for r in runs
    ]
    headers = ['run_id', 'agent', 'status', 'chain', 'parent', 'conversation', 'started', 'records', 'gaps']
    return table([*headers, 'tokens', 'cost'], full)


def _gaps(r: RunRecord) -> str:
    return ','.join(str(lo) if lo == hi else f'{lo}-{hi}' for lo, hi in r.gaps)


def _tokens(r: RunRecord) -> str | None:
    return f'{r.usage.input_tokens}/{r.usage.output_tokens}' if r.usage.model_requests else None


def _amiss(r: RunRecord) -> str | None:
    """What a narrow `runs_table` notes of a run: a broken chain, gaps, an expired parent."""
    notes = [f'chain broken@{r.chain_break_seq}'] if r.chain == 'broken' else []
    notes += [f'gaps {_gaps(r)}'] if r.gaps else []
    notes += ['parent expired'] if r.parent_expired else []
    return '; '.join(notes) or None


def _cost(cost_usd: str | None, unpriced: int) -> str | None:
    """`$0.0041`, with `+?` when some requests could not be priced (the sum is a lower bound)."""
    if cost_usd is None:
        return '?' if unpriced else None
    return f'${float(cost_usd):.4f}{"+?" if unpriced else ""}'


def _duration(micros: int) -> str:
    return f'{micros / 1000:.1f}ms' if micros < 10_000_000 else f'{micros / 1_000_000:.1f}s'


def _event_detail(e: StepEvent) -> str:
    """What a line of `events_table` says beside the kind: tool, snapshot, usage, duration, error."""
    detail = e.tool_name or ''
    if e.snapshot is not None:
        detail = f'snapshot {e.snapshot.snapshot_seq} {e.snapshot.state} (prefix {e.snapshot.prefix_len})'
    if e.usage is not None:
        u = e.usage
        detail = f'{u.model_name or "?"} {u.input_tokens}/{u.output_tokens} tokens'
        if u.cost_usd is not None:
            detail += f' {_cost(u.cost_usd, 0)}'
        if u.finish_reason is not None:
            detail += f' {u.finish_reason}'
    if e.duration_us is not None:
        detail = f'{detail} {_duration(e.duration_us)}'.strip()
    if e.error:
        detail = f'{detail} {e.error}'.strip()
    return detail


def tree(runs: Sequence[RunRecord], *, wide: bool = False) -> str:
    """A lineage tree of `runs` (as `ProjectionReader.run_tree` returns them: the root first).

    ```
    orchestrator-1  [orchestrator, completed]
    ├── researcher-2  [researcher, completed]
    │   └── searcher-4  [searcher, completed]
    └── publisher-3  [publisher, stale]
    ```

    Ids shortened (`short_id`) unless `wide`.
    """
    if not runs:
        return ''
    known = {run.run_id for run in runs}
    children: dict[str, list[RunRecord]] = {}
    for run in runs[1:]:
        parent = run.parent_run_id if run.parent_run_id in known else runs[0].run_id
        children.setdefault(parent, []).append(run)

    def label(run: RunRecord) -> str:
        return f'{ident(run.run_id, wide)}  [{run.agent_name or "-"}, {run.status}]'

    lines = [label(runs[0])]

    def draw(run_id: str, indent: str) -> None:
        kids = children.get(run_id, [])
        for i, child in enumerate(kids):
            last = i == len(kids) - 1
            lines.append(f'{indent}{"└── " if last else "├── "}{label(child)}')
            draw(child.run_id, indent + ('    ' if last else '│   '))

    draw(runs[0].run_id, '')
    return '\n'.join(lines)


def events_table(
    events: Sequence[StepEvent | Answer[Any]], run: RunRecord | None = None, *, wide: bool = False
) -> str:
    """One line per event, in seq order, and per resolution or decision among them (`timeline`).

    A resolution's or decision's line has no seq or step (it takes none of the run's): its kind
    (`resolution`, `decision`), then the call and what it says (`answer_text`). The detail is cut
    to fit 120 columns unless `wide`. Given the `run`, a line under the table names the seqs its
    tool calls' records took (`seq_note`).
    """
    rows = [
        (e.seq, time_text(e.timestamp), e.step_index, e.kind, _event_detail(e) or None)
        if isinstance(e, StepEvent)
        else (None, time_text(e.timestamp), None, e.kind, _answer_detail(e, wide))
        for e in events
    ]
    text = fit(['seq', 'time', 'step', 'kind', 'detail'], rows, wide=wide, cut=('detail',))
    if run is not None and (skipped := other_topic_seqs(events, run.last_seq, run.gaps)):
        text += '\n' + wrap(seq_note(skipped, f'`stepstream effects {run.run_id}` shows those calls'), wide)
    return text


def _answer_detail(entry: Answer[Any], wide: bool) -> str:
    return f'{entry.tool_name} {ident(entry.tool_call_id, wide)}: {answer_text(entry.answer, at=False)}'


def answer_text(r: Answered, *, at: bool = True) -> str:
    """What a resolution or decision says: `approved by alice at T: the note; arguments {...}`.

    Arguments, result and error as stored (redacted). One not `applied` reads as history only: the
    call had ended, or an earlier answer decides it. Without `at`, the time is the line's own column.
    """
    text = f'{r.resolution.replace("_", " ")} by {r.resolved_by}'
    if at:
        text += f' at {time_text(r.resolved_at)}'
    if not r.applied:
        text += ' (history only: it does not decide the status)'
    if r.note:
        text += f': {r.note}'
    for label, value in (('arguments', r.args), ('result', r.result), ('error', r.error)):
        if value is not None:
            text += f'; {label} {value}'
    return text


def effect_status(effect: ToolEffectRecord) -> str:
    """The status views show.

    For a call whose latest transition is `started`: `in_flight` while its run is live,
    `unknown_after_crash` once it is not.
    """
    return effect.doubt or effect.status


def effects_table(effects: Sequence[ToolEffectRecord], *, wide: bool = False) -> str:
    """One line per tool effect; `started` shows as in_flight or unknown_after_crash."""
    return unresolved_table([UnresolvedEffect(e, None) for e in effects], wide=wide)


WAITS_FOR = {
    'approval': 'a person to approve or deny it (it has not run)',
    'question': 'an answer to what it asks',
    'external': "an outside system's result",
}
"""What a `deferred` call waits for, by its `deferral`, in words: its run resumes once it has it."""


def waits_for(deferral: str | None) -> str:
    """What a `deferred` call of this `deferral` waits for, for a person (`an outside system's result`)."""
    return WAITS_FOR.get(deferral or '', 'a decision or a result')


def ledger(effects: Sequence[ToolEffectRecord], *, wide: bool = False) -> str:
    """`stepstream effects RUN`: each call's effect, then what a deferred call waits for and every resolution.

    A deferred call's status says its kind (`deferred (approval)`, once decided `resolved
    (approval)`); a line under the table says what it waits (or waited) for, with its arguments
    and metadata as stored (redacted), and one line per resolution or decision in log order (the
    one that stands, and those that came later as history), with what it says (`answer_text`).
    Unless `wide`: ids shortened, no times, the summary, error, key and tool cut (in that order)
    and the lines under it folded to fit 120 columns.
    """
    if not effects:
        return 'no tool calls'
    rows = [
        (
            ident(e.tool_call_id, wide),
            e.tool_name,
            f'{effect_status(e)} ({e.deferral})' if e.deferral is not None else effect_status(e),
            when(e.started_at, wide),
            when(e.ended_at, wide) if e.ended_at else None,
            e.idempotency_key,
            e.effect_summary,
            e.error,
        )
        for e in effects
    ]
    headers = ['tool_call_id', 'tool', 'status', 'started', 'ended', 'idempotency_key', 'summary', 'error']
    shown = [h for h in headers if h not in ('started', 'ended')]
    lines = [fit(headers, rows, wide=wide, shown=shown, cut=('summary', 'error', 'idempotency_key', 'tool'))]
    for e in effects:
        call = ident(e.tool_call_id, wide)
        if e.deferral is not None:
            metadata = f'; metadata {e.deferral_metadata}' if e.deferral_metadata is not None else ''
            waits = f'{"waits" if e.status == "deferred" else "waited"} for {waits_for(e.deferral)}'
            args = '(erased)' if e.content_erased else e.args or '{}'
            lines.append(wrap(f'{call}: {waits}; arguments {args}{metadata}', wide))
        erased = '; its content erased' if e.content_erased else ''
        lines += [wrap(f'{call}: resolved {answer_text(r)}{erased}', wide) for r in e.resolutions]
    return '\n'.join(lines)


def messages_text(messages: Sequence[Any]) -> str:
    """A history as text a person reads: each message's parts, the prompts and answers in full."""
    lines = []
    for i, message in enumerate(messages):
        lines.append(f'#{i} {message.kind}')
        for part in message.parts:
            lines.extend('    ' + line for line in _part_text(part).splitlines() or [''])
    return '\n'.join(lines)


def _part_text(part: Any) -> str:
    kind = getattr(part, 'part_kind', type(part).__name__)
    if kind in ('tool-call', 'builtin-tool-call'):
        args = json.dumps(part.args_as_dict(), ensure_ascii=False)
        return f'tool call {part.tool_name} ({part.tool_call_id}): {args}'
    if kind in ('tool-return', 'builtin-tool-return'):
        return f'tool return {part.tool_name} ({part.tool_call_id}): {_content_text(part.content)}'
    if kind == 'retry-prompt':
        target = part.tool_name or 'output'
        return f'retry {target}: {_content_text(part.content)}'
    if kind in ('system-prompt', 'user-prompt', 'text', 'thinking'):
        label = {'system-prompt': 'system', 'user-prompt': 'user', 'text': 'text', 'thinking': 'thinking'}[
            kind
        ]
        return f'{label}: {_content_text(part.content)}'
    return f'{kind}: {_content_text(getattr(part, "content", part))}'


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list | tuple):
        return ' '.join(_content_text(c) for c in content)
    url = getattr(content, 'url', None)
    if isinstance(url, str):
        return f'[{getattr(content, "media_type", "media")} {url}]'
    data = getattr(content, 'data', None)
    if isinstance(data, bytes):
        return f'[{getattr(content, "media_type", "binary")}, {len(data)} bytes]'
    try:
        return json.dumps(content, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(content)


@dataclass(frozen=True, slots=True)
class UnresolvedEffect:
    """A tool effect in the unresolved sweep, beside its run's status (`stale`, `failed`, ...).

    A `running` run may still finish the call (it shows `in_flight`); a run that is stale or
    ended will not (`unknown_after_crash`). A `deferred` call is never here: it waits, it is not in doubt.
    """

    effect: ToolEffectRecord
    run_status: str | None


def unresolved_table(items: Sequence[UnresolvedEffect], *, wide: bool = False) -> str:
    """One line per tool effect, with its run's status when known.

    Unless `wide`: ids shortened, no start time, the summary, key and tool cut (in that order) to fit.
    """
    with_run = any(item.run_status is not None for item in items)
    rows = [
        (
            ident(item.effect.run_id, wide),
            *((item.run_status,) if with_run else ()),
            ident(item.effect.tool_call_id, wide),
            item.effect.tool_name,
            effect_status(item.effect),
            when(item.effect.started_at, wide),
            item.effect.idempotency_key,
            item.effect.effect_summary,
        )
        for item in items
    ]
    headers = ['run_id', *(['run_status'] if with_run else []), 'tool_call_id', 'tool', 'status']
    headers = [*headers, 'started', 'idempotency_key', 'summary']
    shown = [h for h in headers if h != 'started']
    return fit(headers, rows, wide=wide, shown=shown, cut=('summary', 'idempotency_key', 'tool'))
