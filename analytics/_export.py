"""The analytics export: a projection as flat Parquet tables that DuckDB, Polars or Spark read as they are.

Five tables, each a directory of Parquet files partitioned by UTC day (Hive-style `date=YYYY-MM-DD/`):

- `runs`: one row per run, with its lineage, status and usage sums (`RunRecord`, flattened).
- `events`: one row per step event, without snapshot payloads.
- `model_requests`: one row per model request that ended (`model_request_completed|failed`), with its
  model, provider, tokens, cost and duration.
- `tool_effects`: one row per tool call, its merged effect state.
- `messages`: the run's newest snapshot (of any state) replayed from the deltas, one row per message,
  as Pydantic AI's own JSON with offloaded media left as `media+sha256://` URIs.

Rows are built from the projection (what `ProjectionReader` answers), so the export says exactly what
the CLI and the API say; the log's deltas are materialized by the reader's replay, the one way to do it.
The target is a local directory or `s3://bucket/prefix` in the settings' S3 endpoint (pyarrow's S3
filesystem, the same credentials as the media store).

Incremental (`since=` an earlier export): `_stepstream_export.json` holds a mark, the projection's applied
offsets (read before any row) and, per run, the last seq, the gaps and a digest of the state rows it
exported. A later export writes `events`/`model_requests` rows only past that (seq above the last seq or
in a recorded gap, and never past the run's own last seq or in its current gaps: each event exactly once),
and the `runs`/`tool_effects`/`messages` rows of a run only when its digest changed, all of that run's
rows again, with a higher `export_seq`; the views in docs/analytics.md keep each run's newest
`export_seq`. See docs/decisions/0021-analytics-export.md.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelResponse

from stepstream.analytics._tables import COST_SCALE, ROWS, arrow_schema
from stepstream.erasure import ErasureError
from stepstream.errors import StepStreamError, UsageError
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import RunRecord, StepEvent, ToolEffectRecord
from stepstream.settings import Settings

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

TABLES = tuple(ROWS)
"""The tables an export writes, each a directory under the target (their rows: `_tables.py`)."""

RUNS_PER_FILE = 1000
"""Runs whose rows go into one set of files: bounds the memory an export holds."""

MANIFEST = '_stepstream_export.json'
"""The file beside the tables that says what an export wrote, and its mark for a later `--since`."""

MARK_VERSION = 1
"""The layout of the mark in the manifest; a mark of another version is refused."""

STATE_TABLES = ('runs', 'tool_effects', 'messages')
"""Tables whose rows of a run are replaced as a whole (newest `export_seq` wins); the others only grow."""

_MESSAGE = TypeAdapter(ModelMessage)
_QUANTUM = Decimal(1).scaleb(-COST_SCALE)


@dataclass
class ExportReport:
    """What an export wrote: rows per table, and the runs whose messages could not be replayed."""

    target: str
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TABLES, 0))
    unreadable_histories: list[str] = field(default_factory=list)
    """Runs whose snapshots cannot be reconstructed (a gap in the log): no `messages` rows for them."""
    erased_histories: list[str] = field(default_factory=list)
    """Runs whose content was erased (`stepstream forget`): no `messages` rows, every other row stays."""
    sealed_histories: dict[str, str] = field(default_factory=dict)
    """Runs whose content is sealed and could not be opened, with why (no `STEPSTREAM_ERASURE_KEY`,
    or another one than the writers'): no `messages` rows. An export with any is incomplete."""
    export_seq: int = 0
    """0 for a full export; one more than the mark's for an export `since` one."""


@dataclass
class ExportMark:
    """An export's high-water mark: what a later export `since` it must not write again.

    `runs` maps a run_id to `[last_seq, digest, gaps]`: the events of that run with seq at most
    `last_seq` and outside `gaps` were exported, and `digest` is the hash of the run's state rows
    (its `runs` row, gaps and `tool_effects` rows) as exported. `offsets` are the projection's applied
    offsets (`topic:partition` -> next offset) read before any row: a mark ahead of a projection
    is from another log.
    """

    export_id: str
    export_seq: int
    topic_prefix: str | None
    offsets: dict[str, int]
    runs: dict[str, list[Any]]
    exports: list[str]
    """The export ids whose files are in the mark's directory (a chain appended into one place): files
    of any other id there are what a failed export left, and the next export into it removes them."""
    location: str = ''
    """Where the mark was read from (the export's directory or `s3://` prefix)."""

    def to_json(self) -> dict[str, Any]:
        """The mark as it is stored in the manifest."""
        return {
            'version': MARK_VERSION,
            'export_id': self.export_id,
            'export_seq': self.export_seq,
            'topic_prefix': self.topic_prefix,
            'offsets': self.offsets,
            'runs': self.runs,
            'exports': self.exports,
        }


def _schemas() -> dict[str, pa.Schema]:
    return {table: arrow_schema(row) for table, row in ROWS.items()}


def _day(ts: datetime | None) -> str:
    return (ts or datetime(1970, 1, 1, tzinfo=UTC)).astimezone(UTC).strftime('%Y-%m-%d')


def _cost(text: str | None) -> Decimal | None:
    return None if text is None else Decimal(text).quantize(_QUANTUM, rounding=ROUND_HALF_EVEN)


def _run_row(run: RunRecord) -> dict[str, Any]:
    u = run.usage
    return {
        'run_id': run.run_id,
        'agent_name': run.agent_name,
        'conversation_id': run.conversation_id,
        'parent_run_id': run.parent_run_id,
        'parent_expired': run.parent_expired,
        'status': run.status,
        'started_at': run.started_at,
        'ended_at': run.ended_at,
        'error': run.error,
        'metadata': run.metadata,
        'registration_id': run.registration_id,
        'event_count': run.event_count,
        'last_seq': run.last_seq,
        'missing_seqs': sum(high - low + 1 for low, high in run.gaps),
        'model_requests': u.model_requests,
        'requests': u.requests,
        'input_tokens': u.input_tokens,
        'output_tokens': u.output_tokens,
        'cache_read_tokens': u.cache_read_tokens,
        'cache_write_tokens': u.cache_write_tokens,
        'cost_usd': _cost(u.cost_usd),
        'unpriced_requests': u.unpriced_requests,
        'model_request_us': u.model_request_us,
        'tool_calls': u.tool_calls,
        'tool_call_failures': u.tool_call_failures,
        'tool_call_us': u.tool_call_us,
        'date': _day(run.started_at),
    }


def _event_row(e: StepEvent) -> dict[str, Any]:
    return {
        'run_id': e.run_id,
        'seq': e.seq,
        'writer_id': e.writer_id,
        'timestamp': e.timestamp,
        'kind': e.kind,
        'step_index': e.step_index,
        'agent_name': e.agent_name,
        'conversation_id': e.conversation_id,
        'parent_run_id': e.parent_run_id,
        'tool_call_id': e.tool_call_id,
        'tool_name': e.tool_name,
        'error': e.error,
        'idempotency_key': e.idempotency_key,
        'snapshot_seq': e.snapshot.snapshot_seq if e.snapshot is not None else None,
        'duration_us': e.duration_us,
        'trace_id': e.trace_id,
        'span_id': e.span_id,
        'date': _day(e.timestamp),
    }


def _request_row(e: StepEvent) -> dict[str, Any]:
    u = e.usage
    return {
        'run_id': e.run_id,
        'seq': e.seq,
        'timestamp': e.timestamp,
        'agent_name': e.agent_name,
        'conversation_id': e.conversation_id,
        'step_index': e.step_index,
        'failed': e.kind == 'model_request_failed',
        'error': e.error,
        'model_name': u.model_name if u else None,
        'provider': u.provider if u else None,
        'input_tokens': u.input_tokens if u else None,
        'output_tokens': u.output_tokens if u else None,
        'cache_read_tokens': u.cache_read_tokens if u else None,
        'cache_write_tokens': u.cache_write_tokens if u else None,
        'requests': u.requests if u else None,
        'finish_reason': u.finish_reason if u else None,
        'cost_usd': _cost(u.cost_usd) if u else None,
        'duration_us': e.duration_us,
        'trace_id': e.trace_id,
        'span_id': e.span_id,
        'date': _day(e.timestamp),
    }


def _effect_row(effect: ToolEffectRecord, run: RunRecord) -> dict[str, Any]:
    resolution = effect.resolution
    return {
        'run_id': effect.run_id,
        'agent_name': run.agent_name,
        'tool_call_id': effect.tool_call_id,
        'tool_name': effect.tool_name,
        'status': effect.status,
        'unknown_after_crash': effect.unknown_after_crash,
        'run_status': run.status,
        'started_at': effect.started_at,
        'ended_at': effect.ended_at,
        'idempotency_key': effect.idempotency_key,
        'effect_summary': effect.effect_summary,
        'error': effect.error,
        'last_seq': effect.last_seq,
        'resolution': resolution.resolution if resolution else None,
        'resolved_by': resolution.resolved_by if resolution else None,
        'resolved_at': resolution.resolved_at if resolution else None,
        'resolution_note': resolution.note if resolution else None,
        'date': _day(effect.started_at or run.started_at),
    }


def _message_rows(
    run: RunRecord, messages: Sequence[ModelMessage], seq: int, state: str
) -> list[dict[str, Any]]:
    rows = []
    for index, message in enumerate(messages):
        rows.append(
            {
                'run_id': run.run_id,
                'agent_name': run.agent_name,
                'snapshot_seq': seq,
                'snapshot_state': state,
                'message_index': index,
                'kind': message.kind,
                'timestamp': message.timestamp,
                'model_name': message.model_name if isinstance(message, ModelResponse) else None,
                'part_kinds': [part.part_kind for part in message.parts],
                'message_json': _MESSAGE.dump_json(message).decode(),
                'date': _day(run.started_at),
            }
        )
    return rows


def export_filesystem(out: str, settings: Settings) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and base path of `out`: a local directory, or `s3://bucket/prefix`.

    S3 uses the settings' endpoint, region and credentials (the media store's), path-style, over
    http or https as the endpoint says.
    """
    import pyarrow.fs as pafs

    if not out.startswith('s3://'):
        return pafs.LocalFileSystem(), out
    endpoint = settings.s3_endpoint
    scheme = 'https'
    if endpoint is not None and '://' in endpoint:
        scheme, endpoint = endpoint.split('://', 1)
    s3 = pafs.S3FileSystem(
        access_key=settings.s3_access_key_id,
        secret_key=(
            settings.s3_secret_access_key.get_secret_value() if settings.s3_secret_access_key else None
        ),
        region=settings.s3_region,
        endpoint_override=endpoint,
        scheme=scheme,
        force_virtual_addressing=False,
    )
    return s3, out.removeprefix('s3://').rstrip('/')


def _same_place(a: str, b: str) -> bool:
    if a.startswith('s3://') or b.startswith('s3://'):
        return a.rstrip('/') == b.rstrip('/')
    return Path(a).resolve() == Path(b).resolve()


def read_mark(since: str, settings: Settings) -> ExportMark:
    """The mark of an earlier export: `since` is its directory (or `s3://` prefix) or its manifest.

    Raises `UsageError` (exit code 2) when there is no manifest there, or it holds no mark this
    version of stepstream wrote (an export made before incremental exports, or not an export).
    """
    import pyarrow.fs as pafs

    location = since.rstrip('/')
    if location.endswith('.json'):
        location = location.rsplit('/', 1)[0] if '/' in location else '.'
    fs, base = export_filesystem(location, settings)
    path = f'{base}/{MANIFEST}'
    try:
        if fs.get_file_info(path).type != pafs.FileType.File:
            raise UsageError(f'--since {since}: no {MANIFEST} at {location} (not an export)')
        with fs.open_input_stream(path) as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise UsageError(f'--since {since}: cannot read {MANIFEST} at {location}: {exc}') from exc
    mark = manifest.get('mark') if isinstance(manifest, dict) else None
    if not isinstance(mark, dict) or mark.get('version') != MARK_VERSION:
        raise UsageError(
            f'--since {since}: {MANIFEST} at {location} holds no export mark of version {MARK_VERSION} '
            '(an export made before incremental exports, or not an export): make a full export first'
        )
    try:
        return ExportMark(
            export_id=str(mark['export_id']),
            export_seq=int(mark['export_seq']),
            topic_prefix=mark['topic_prefix'],
            offsets={str(k): int(v) for k, v in mark['offsets'].items()},
            runs={str(k): list(v) for k, v in mark['runs'].items()},
            exports=[str(e) for e in mark['exports']],
            location=location,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(
            f'--since {since}: the mark in {MANIFEST} at {location} is malformed: {exc!r}'
        ) from exc


def _check_mark(mark: ExportMark, topic_prefix: str | None, offsets: dict[str, int]) -> None:
    """Refuse a mark from another log: another topic prefix, or offsets this projection has not reached."""
    if mark.topic_prefix != topic_prefix:
        raise UsageError(
            f'--since {mark.location}: that export is of topic prefix {mark.topic_prefix!r}, '
            f'this projection of {topic_prefix!r}: a mark from another log'
        )
    ahead = sorted(tp for tp, offset in mark.offsets.items() if offset > offsets.get(tp, 0))
    if ahead:
        raise UsageError(
            f'--since {mark.location}: that export had applied more of {", ".join(ahead)} than this '
            'projection has: a mark from another log, or a projection behind it (let it catch up, '
            'or make a full export)'
        )


def _remove_strays(fs: pafs.FileSystem, base: str, exports: set[str]) -> None:
    """Delete the table files under `base` that no export in `exports` wrote (a failed export's)."""
    import pyarrow.fs as pafs

    for table in TABLES:
        selector = pafs.FileSelector(f'{base}/{table}', allow_not_found=True, recursive=True)
        for info in fs.get_file_info(selector):
            name = info.base_name
            if (
                info.type == pafs.FileType.File
                and name.startswith('part-')
                and name.split('-')[1] not in exports
            ):
                fs.delete_file(info.path)


def _digest(run: RunRecord, run_row: dict[str, Any], effect_rows: list[dict[str, Any]]) -> str:
    """The hash of a run's state rows: a later export rewrites the run's state only when it differs."""
    content = json.dumps([run_row, run.gaps, effect_rows], sort_keys=True, default=str)
    return hashlib.sha256(content.encode()).hexdigest()[:32]


def _exported(seq: int, last_seq: int, gaps: Sequence[Sequence[int]]) -> bool:
    """Whether a mark of `last_seq` and `gaps` covers the event `seq`."""
    return seq <= last_seq and not any(low <= seq <= high for low, high in gaps)


async def export_parquet(
    reader: ProjectionReader,
    out: str,
    settings: Settings,
    *,
    since: str | ExportMark | None = None,
    progress: Callable[[int], None] | None = None,
) -> ExportReport:
    """Write the five tables of a projection as Parquet under `out` (a directory or `s3://bucket/prefix`).

    ```python
    report = await export_parquet(projector.reader(), 'analytics', settings)
    # duckdb: SELECT agent_name, sum(cost_usd) FROM 'analytics/runs/**/*.parquet' GROUP BY ALL
    later = await export_parquet(projector.reader(), 'analytics', settings, since='analytics')
    ```

    Without `since`, an export replaces the tables under `out` (it writes the whole projection).
    With `since` (an earlier export's directory or manifest, or its `ExportMark`) it writes only
    what changed after that export: new events and model requests, and every state row of each
    run whose state changed, with the next `export_seq`. Into the earlier export's own directory
    it adds files; anywhere else it replaces what is there with just those rows. A mark from
    another log raises `UsageError`.
    """
    import pyarrow as pa
    import pyarrow.dataset as ds

    mark = read_mark(since, settings) if isinstance(since, str) else since
    status = await reader.status()  # before any row: whatever is applied later is past the mark
    offsets = {f'{topic}:{partition}': offset for (topic, partition), offset in status.offsets.items()}
    if mark is not None:
        _check_mark(mark, status.topic_prefix, offsets)
    fs, base = export_filesystem(out, settings)
    schemas = _schemas()
    export_id = uuid.uuid4().hex[:12]
    export_seq = 0 if mark is None else mark.export_seq + 1
    report = ExportReport(target=out, export_seq=export_seq)
    appending = mark is not None and _same_place(mark.location, out)
    if appending:
        assert mark is not None
        _remove_strays(fs, base, set(mark.exports))
    else:
        for table in TABLES:
            fs.delete_dir_contents(f'{base}/{table}', missing_dir_ok=True)
    runs_mark: dict[str, list[Any]] = {} if mark is None else dict(mark.runs)

    rows: dict[str, list[dict[str, Any]]] = {t: [] for t in TABLES}
    chunk = 0

    def flush() -> None:
        nonlocal chunk
        for table in TABLES:
            if not rows[table]:
                continue
            if table in STATE_TABLES:
                for row in rows[table]:
                    row['export_seq'] = export_seq
            data = pa.Table.from_pylist(rows[table], schema=schemas[table])
            ds.write_dataset(
                data,
                f'{base}/{table}',
                filesystem=fs,
                format='parquet',
                partitioning=ds.partitioning(pa.schema([('date', pa.string())]), flavor='hive'),
                basename_template=f'part-{export_id}-{chunk}-{{i}}.parquet',
                existing_data_behavior='overwrite_or_ignore',
            )
            report.rows[table] += len(rows[table])
            rows[table].clear()
        chunk += 1

    after: str | None = None
    done = 0
    while True:
        page = await reader.list_runs(after=after, limit=RUNS_PER_FILE)
        if not page:
            break
        for run in page:
            run_row = _run_row(run)
            effect_rows = [_effect_row(e, run) for e in await reader.list_tool_effects(run.run_id)]
            digest = _digest(run, run_row, effect_rows)
            before = runs_mark.get(run.run_id)
            if before is not None and before[1] == digest:
                continue  # nothing of this run changed since the mark
            runs_mark[run.run_id] = [run.last_seq, digest, [list(g) for g in run.gaps]]
            rows['runs'].append(run_row)
            rows['tool_effects'] += effect_rows
            for event in await reader.list_events(run.run_id):
                # Exactly what the run record says is there (its last seq, outside its gaps), and
                # none of what the mark says was exported: the next mark starts where this one ends.
                if not _exported(event.seq, run.last_seq, run.gaps):
                    continue
                if before is not None and _exported(event.seq, before[0], before[2]):
                    continue
                rows['events'].append(_event_row(event))
                if event.kind in ('model_request_completed', 'model_request_failed'):
                    rows['model_requests'].append(_request_row(event))
            try:
                snap = await reader.latest_snapshot(run.run_id, include_interrupted=True, restore=False)
            except ErasureError as exc:  # the reader's key, not the log: never called a gap
                report.sealed_histories[run.run_id] = str(exc)
                snap = None
            except StepStreamError:
                report.unreadable_histories.append(run.run_id)
                snap = None
            if snap is not None and snap.erased:
                report.erased_histories.append(run.run_id)
            elif snap is not None:
                rows['messages'] += _message_rows(run, snap.messages, snap.snapshot_seq, snap.state)
        done += len(page)
        if progress is not None:
            progress(done)
        flush()
        after = page[-1].run_id
    flush()
    new_mark = ExportMark(
        export_id=export_id,
        export_seq=export_seq,
        topic_prefix=status.topic_prefix,
        offsets=offsets,
        runs=runs_mark,
        exports=[*mark.exports, export_id] if appending and mark is not None else [export_id],
    )
    fs.create_dir(base, recursive=True)
    with fs.open_output_stream(f'{base}/{MANIFEST}') as manifest:
        manifest.write(
            json.dumps(
                {
                    'exported_at': datetime.now(UTC).isoformat(),
                    'export_id': export_id,
                    'export_seq': export_seq,
                    'since': None
                    if mark is None
                    else {
                        'location': mark.location,
                        'export_id': mark.export_id,
                        'export_seq': mark.export_seq,
                    },
                    'tables': list(TABLES),
                    'rows': report.rows,
                    'unreadable_histories': report.unreadable_histories,
                    'sealed_histories': sorted(report.sealed_histories),
                    'mark': new_mark.to_json(),
                },
                indent=2,
            ).encode()
        )
    return report
