"""What the operator's commands show of the projection itself: its status and its retention.

`stepstream status` (the lag of each partition, who applies it, the projection's figures and
counts, as text or JSON) and `stepstream retention` (the policy and each shard's clock and
cut-off, a policy's preview, a media sweep's report). The read model's own views are in `_render`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from stepstream.console._fit import table, time_text
from stepstream.console._render import to_json
from stepstream.timestamps import from_micros

if TYPE_CHECKING:
    from stepstream.readmodel import ProjectionStatus, RunCounts, SweepReport
    from stepstream.settings import Settings
    from stepstream.storage import RetentionPreview, RetentionState


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
    waiting = ', '.join(f'{kind} {n}' for kind, n in sorted(counts.waiting_calls.items()))
    lines.append(
        f'tool calls waiting for a decision: {sum(counts.waiting_calls.values())}'
        + (f' ({waiting}; `stepstream deferred`)' if waiting else '')
    )
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
    when = time_text(status.updated_at) if status.updated_at else 'never'
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
    return time_text(from_micros(micros)) if micros is not None and micros >= 0 else '-'


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
