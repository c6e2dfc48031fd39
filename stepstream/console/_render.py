"""Plain-text and JSON renderings of the read model's views, shared by the console views and the demo."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from stepstream.schemas import RunRecord, StepEvent, ToolEffectRecord
from stepstream.timestamps import from_micros

if TYPE_CHECKING:
    from stepstream.projector import RetentionPreview, RetentionState, SweepReport
    from stepstream.readmodel import ProjectionStatus, RunCounts
    from stepstream.settings import Settings


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
    """One line per run: id, agent, status, chain, lineage, times, counts, tokens (in/out) and cost."""
    rows = [
        (
            r.run_id,
            r.agent_name,
            r.status,
            f'broken@{r.chain_break_seq}' if r.chain == 'broken' else r.chain,
            f'{r.parent_run_id} (expired)' if r.parent_expired else r.parent_run_id,
            r.conversation_id,
            _time(r.started_at),
            r.event_count,
            ','.join(str(lo) if lo == hi else f'{lo}-{hi}' for lo, hi in r.gaps) or None,
            f'{r.usage.input_tokens}/{r.usage.output_tokens}' if r.usage.model_requests else None,
            _cost(r.usage.cost_usd, r.usage.unpriced_requests),
        )
        for r in runs
    ]
    headers = [
        'run_id',
        'agent',
        'status',
        'chain',
        'parent',
        'conversation',
        'started',
        'records',
        'gaps',
        'tokens',
        'cost',
    ]
    return table(headers, rows)


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


def tree(runs: Sequence[RunRecord]) -> str:
    """A lineage tree of `runs` (as `ProjectionReader.run_tree` returns them: the root first).

    ```
    orchestrator-1  [orchestrator, completed]
    ├── researcher-2  [researcher, completed]
    │   └── searcher-4  [searcher, completed]
    └── publisher-3  [publisher, stale]
    ```
    """
    if not runs:
        return ''
    known = {run.run_id for run in runs}
    children: dict[str, list[RunRecord]] = {}
    for run in runs[1:]:
        parent = run.parent_run_id if run.parent_run_id in known else runs[0].run_id
        children.setdefault(parent, []).append(run)

    def label(run: RunRecord) -> str:
        return f'{run.run_id}  [{run.agent_name or "-"}, {run.status}]'

    lines = [label(runs[0])]

    def draw(run_id: str, indent: str) -> None:
        kids = children.get(run_id, [])
        for i, child in enumerate(kids):
            last = i == len(kids) - 1
            lines.append(f'{indent}{"└── " if last else "├── "}{label(child)}')
            draw(child.run_id, indent + ('    ' if last else '│   '))

    draw(runs[0].run_id, '')
    return '\n'.join(lines)


def events_table(events: Sequence[StepEvent]) -> str:
    """One line per event, in seq order."""
    rows = [(e.seq, _time(e.timestamp), e.step_index, e.kind, _event_detail(e) or None) for e in events]
    return table(['seq', 'time', 'step', 'kind', 'detail'], rows)


def effect_status(effect: ToolEffectRecord) -> str:
    """The status views show.

    For a call whose latest transition is `started`: `in_flight` while its run is live,
    `unknown_after_crash` once it is not.
    """
    return effect.doubt or effect.status


def effects_table(effects: Sequence[ToolEffectRecord]) -> str:
    """One line per tool effect; `started` shows as in_flight or unknown_after_crash."""
    return unresolved_table([UnresolvedEffect(e, None) for e in effects])


WAITS_FOR = {
    'approval': 'a person to approve or deny it (it has not run)',
    'question': 'an answer to what it asks',
    'external': "an outside system's result",
}
"""What a `deferred` call waits for, by its `deferral`, in words: its run resumes once it has it."""


def waits_for(deferral: str | None) -> str:
    """What a `deferred` call of this `deferral` waits for, for a person (`an outside system's result`)."""
    return WAITS_FOR.get(deferral or '', 'a decision or a result')


def ledger(effects: Sequence[ToolEffectRecord]) -> str:
    """`stepstream effects RUN`: each call's effect, then what a deferred call waits for and every resolution.

    A deferred call's status says its kind (`deferred (approval)`); a line under the table says
    what it waits for, with its arguments and metadata as stored (redacted).
    """
    if not effects:
        return 'no tool calls'
    rows = [
        (
            e.tool_call_id,
            e.tool_name,
            f'deferred ({e.deferral})' if e.status == 'deferred' else effect_status(e),
            _time(e.started_at),
            _time(e.ended_at) if e.ended_at else None,
            e.idempotency_key,
            e.effect_summary,
            e.error,
        )
        for e in effects
    ]
    headers = ['tool_call_id', 'tool', 'status', 'started', 'ended', 'idempotency_key', 'summary', 'error']
    lines = [table(headers, rows)]
    for e in effects:
        if e.status == 'deferred':
            metadata = f'; metadata {e.deferral_metadata}' if e.deferral_metadata is not None else ''
            waits = f'waits for {waits_for(e.deferral)}; arguments {e.args or "{}"}{metadata}'
            lines.append(f'{e.tool_call_id}: {waits}')
        for r in e.resolutions:
            applied = '' if r.applied else ' (history only: it does not decide the status)'
            lines.append(
                f'{e.tool_call_id}: resolved {r.resolution.replace("_", " ")} by {r.resolved_by} at '
                f'{_time(r.resolved_at)}{applied}: {r.note}'
            )
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


def unresolved_table(items: Sequence[UnresolvedEffect]) -> str:
    """One line per tool effect, with its run's status when known."""
    with_run = any(item.run_status is not None for item in items)
    rows = [
        (
            item.effect.run_id,
            *((item.run_status,) if with_run else ()),
            item.effect.tool_call_id,
            item.effect.tool_name,
            effect_status(item.effect),
            _time(item.effect.started_at),
            item.effect.idempotency_key,
            item.effect.effect_summary,
        )
        for item in items
    ]
    headers = ['run_id', *(['run_status'] if with_run else []), 'tool_call_id', 'tool', 'status']
    return table([*headers, 'started', 'idempotency_key', 'summary'], rows)


Offsets = Mapping[tuple[str, int], int]


def status_json(status: ProjectionStatus, applied: Offsets, ends: Offsets) -> str:
    """`stepstream status --json`: one object per partition, then the projection's figures."""
    partitions = [
        {
            'topic': topic,
            'partition': partition,
            'applied': offset,
            'end': ends[topic, partition],
            'lag': max(ends[topic, partition] - offset, 0),
        }
        for (topic, partition), offset in applied.items()
    ]
    figures = {f.name: getattr(status, f.name) for f in dataclasses.fields(status) if f.name != 'offsets'}
    total = sum(p['lag'] for p in partitions)  # type: ignore[misc]
    return to_json({'partitions': partitions, 'total_lag': total, **figures})


def applier(status: ProjectionStatus, partition: int) -> tuple[str, str]:
    """Who applies a partition's shard (`pid N` or `none`) and how long ago it last committed."""
    pid = status.writers.get(partition)
    at = status.last_batch_at.get(partition)
    ago = 'never' if at is None else f'{max((datetime.now(UTC) - at).total_seconds(), 0):.1f} s ago'
    return ('none' if pid is None else f'pid {pid}'), ago


def counts_text(counts: RunCounts | None) -> list[str]:
    """The status's counts: runs per status, the agents with most runs, the calls in doubt."""
    if counts is None:
        return ['runs: not counted (a shard predates the counts or is missing; `stepstream rebuild` counts)']
    by_status = ', '.join(f'{status} {n}' for status, n in counts.by_status.items())
    lines = [f'runs: {sum(counts.by_status.values())} ({by_status})']
    if counts.by_agent:
        top = sorted(counts.by_agent.items(), key=lambda item: (-item[1], item[0]))
        shown = ', '.join(f'{name} {n}' for name, n in top[:5])
        more = f', and {len(top) - 5} more' if len(top) > 5 else ''
        lines.append(f'agents: {len(top)} ({shown}{more})')
    lines.append(f'tool calls in doubt: {counts.unresolved_effects}')
    if counts.broken_chains:
        lines.append(f'runs with a broken hash chain: {counts.broken_chains} (`stepstream audit verify`)')
    return lines


def status_text(status: ProjectionStatus, applied: Offsets, ends: Offsets, settings: Settings) -> str:
    """`stepstream status`: the lag table and one line per figure."""
    rows = [
        (
            topic,
            partition,
            offset,
            ends[topic, partition],
            max(ends[topic, partition] - offset, 0),
            *applier(status, partition),
        )
        for (topic, partition), offset in applied.items()
    ]
    headers = ['topic', 'partition', 'applied', 'end', 'lag', 'projector', 'last batch']
    lines = [table(headers, rows), '']
    lines.append(f'total lag: {sum(int(r[4]) for r in rows)} records')
    idle = sorted({p for p, pid in status.writers.items() if pid is None})
    if idle:
        lines.append(
            f'no projector applies partition(s) {idle}: nothing new shows in the views until one runs '
            '(`stepstream stack up` starts one; or `stepstream projector`)'
        )
    when = _time(status.updated_at) if status.updated_at else 'never'
    lines.append(f'applied: {status.applied_per_second:g} records/s (last batch at {when})')
    reasons = ', '.join(f'{reason} {count}' for reason, count in status.dead_lettered_by_reason.items())
    lines.append(f'dead-lettered: {status.dead_lettered}' + (f' ({reasons})' if reasons else ''))
    lines.append(f'runs with conflicting writers: {status.conflicting_runs}')
    lines.extend(counts_text(status.runs))
    if status.parked_records:
        lines.append(f'records waiting for a run_started that has not arrived: {status.parked_records}')
    if status.state == 'rebuilding':
        resume = f'stepstream rebuild --into {settings.projection.db_path}'
        lines.append(f'this projection is an unfinished rebuild: resume it with `{resume}`')
    return '\n'.join(lines)


def _log_time(micros: int | None) -> str:
    return _time(from_micros(micros)) if micros is not None and micros >= 0 else '-'


def retention_text(policy: int | None, shards: Sequence[RetentionState]) -> str:
    """`stepstream retention`: the policy, then one line per shard (times are the log's)."""
    if policy is None:
        return 'retention: none (every run is kept; set STEPSTREAM_RETAIN_ENDED_DAYS and rebuild to bound it)'
    days = policy / 86_400_000_000
    unit = 'day' if days == 1 else 'days'
    head = f"retention: runs that ended {days:g} {unit} before their partition's clock are dropped"
    rows = [
        (
            s.partition,
            _log_time(s.clock),
            _log_time(s.cutoff),
            s.waiting,
            _log_time(s.next_expiry),
            s.expired,
            s.media,
            ', '.join(s.unresolved_ending) or None,
        )
        for s in shards
    ]
    headers = [
        'shard',
        'clock',
        'cut-off',
        'ended kept',
        'next expiry',
        'dropped',
        'media',
        'ended, unresolved',
    ]
    lines = [head, table(headers, rows)]
    if any(s.unresolved_ending for s in shards):
        lines.append(
            'ended runs with an unresolved tool effect expire with their run: resolve them first '
            '(`stepstream unresolved`, `stepstream resolve`)'
        )
    return '\n'.join(lines)


def sweep_text(report: SweepReport) -> str:
    """`stepstream retention sweep-media`: what the sweep saw and deleted."""
    verb = 'would delete' if report.dry_run else 'deleted'
    return (
        f'{report.listed} payloads in the bucket, {report.referenced} referenced by kept runs, '
        f'{report.young} unreferenced but younger than the grace period; '
        f'{verb} {len(report.deleted)} ({report.deleted_bytes} bytes)'
    ) + (
        f'; kept {len(report.guarded)} that kept runs read although the media index does not list them '
        '(the index is incomplete: rebuild the projection)'
        if report.guarded
        else ''
    )


def preview_text(days: float, shards: Sequence[RetentionPreview]) -> str:
    """`stepstream retention --preview-days N`: what that policy would drop from each shard now."""
    rows = [
        (s.partition, _log_time(s.clock), _log_time(s.cutoff), s.would_drop, s.would_keep) for s in shards
    ]
    total = sum(s.would_drop for s in shards)
    head = (
        f'a policy of {days:g} days would drop {total} runs now '
        f'(rebuild with STEPSTREAM_RETAIN_ENDED_DAYS={days:g} to apply it)'
    )
    return '\n'.join([head, table(['shard', 'clock', 'cut-off', 'would drop', 'would keep'], rows)])
