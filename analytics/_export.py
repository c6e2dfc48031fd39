"""The analytics export: a projection as flat Parquet tables that DuckDB, Polars or Spark read as they are.

Six tables, each a directory of Parquet files partitioned by UTC day (Hive-style `date=YYYY-MM-DD/`):

- `runs`: one row per run, with its lineage, status and usage sums (`RunRecord`, flattened).
- `events`: one row per step event, without snapshot payloads.
- `model_requests`: one row per model request that ended (`model_request_completed|failed`), with its
  model, provider, tokens, cost and duration.
- `tool_effects`: one row per tool call, its merged effect state.
- `resolutions`: one row per operator's resolution or decision on a deferred call (each call's ledger,
  those that stand and those kept as history).
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
and the state rows (`runs`, `tool_effects`, `resolutions`, `messages`) of a run only when its digest
changed, all of that run's rows again, with a higher `export_seq`; the views in docs/analytics.md
keep each run's newest `export_seq`. See docs/decisions/0021-analytics-export.md. The mark, and
where an export is written (a directory or an S3 prefix), are `_mark.py`'s; this module builds the
rows and writes them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelResponse

from stepstream.analytics._mark import (
    MANIFEST,
    TABLES,
    ExportMark,
    _check_mark,
    _digest,
    _exported,
    _remove_strays,
    _same_place,
    export_filesystem,
    read_mark,
)
from stepstream.analytics._tables import (
    EVENTS,
    MODEL_REQUESTS,
    RESOLUTIONS,
    ROWS,
    RUNS,
    TOOL_EFFECTS,
    arrow_schema,
    day,
)
from stepstream.erasure import ErasureError
from stepstream.errors import StepStreamError
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import RunRecord
from stepstream.settings import Settings

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

RUNS_PER_FILE = 1000
"""Runs whose rows go into one set of files: bounds the memory an export holds."""

STATE_TABLES = ('runs', 'tool_effects', 'resolutions', 'messages')
"""Tables whose rows of a run are replaced as a whole (newest `export_seq` wins); the others only grow."""

_MESSAGE = TypeAdapter(ModelMessage)


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


def _schemas() -> dict[str, pa.Schema]:
    return {table: arrow_schema(row) for table, row in ROWS.items()}


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
                'date': day(run.started_at),
            }
        )
    return rows


async def export_parquet(
    reader: ProjectionReader,
    out: str,
    settings: Settings,
    *,
    since: str | ExportMark | None = None,
    progress: Callable[[int], None] | None = None,
) -> ExportReport:
    """Write the six tables of a projection as Parquet under `out` (a directory or `s3://bucket/prefix`).

    ```python
    report = await export_parquet(ProjectionReader.of(projector), 'analytics', settings)
    # duckdb: SELECT agent_name, sum(cost_usd) FROM 'analytics/runs/**/*.parquet' GROUP BY ALL
    later = await export_parquet(ProjectionReader.of(projector), 'analytics', settings, since='analytics')
    ```

    Without `since`, an export replaces the tables under `out` (it writes the whole projection).
    With `since` (an earlier export's directory or manifest, or its `ExportMark`) it writes only
    what changed after that export: new events and model requests, and every state row of each
    run whose state changed, with the next `export_seq`. Into the earlier export's own directory
    it adds files; anywhere else it replaces what is there with just those rows. A mark from
    another log raises `UsageError`.
    """
    mark = read_mark(since, settings) if isinstance(since, str) else since
    status = await reader.status()  # before any row: whatever is applied later is past the mark
    offsets = {f'{topic}:{partition}': offset for (topic, partition), offset in status.offsets.items()}
    if mark is not None:
        _check_mark(mark, status.topic_prefix, offsets)
    fs, base = export_filesystem(out, settings)
    export_seq = 0 if mark is None else mark.export_seq + 1
    files = _Files(fs, base, uuid.uuid4().hex[:12], ExportReport(target=out, export_seq=export_seq))
    appending = mark is not None and _same_place(mark.location, out)
    if appending:
        assert mark is not None
        _remove_strays(fs, base, set(mark.exports))
    else:
        for table in TABLES:
            fs.delete_dir_contents(f'{base}/{table}', missing_dir_ok=True)
    runs_mark: dict[str, list[Any]] = {} if mark is None else dict(mark.runs)

    after: str | None = None
    done = 0
    while True:
        page = await reader.list_runs(after=after, limit=RUNS_PER_FILE)
        if not page:
            break
        for run in page:
            await _add_run(reader, run, runs_mark, files)
        done += len(page)
        if progress is not None:
            progress(done)
        files.flush()
        after = page[-1].run_id
    files.flush()
    files.fill_empty()
    new_mark = ExportMark(
        export_id=files.export_id,
        export_seq=export_seq,
        topic_prefix=status.topic_prefix,
        offsets=offsets,
        runs=runs_mark,
        exports=[*mark.exports, files.export_id] if appending and mark is not None else [files.export_id],
    )
    _write_manifest(files, mark, new_mark)
    return files.report


class _Files:
    """The rows of the runs read so far, written as one set of Parquet files per `flush`."""

    def __init__(self, fs: pafs.FileSystem, base: str, export_id: str, report: ExportReport) -> None:
        self.fs = fs
        self.base = base
        self.export_id = export_id
        self.report = report
        self.schemas = _schemas()
        self.rows: dict[str, list[dict[str, Any]]] = {t: [] for t in TABLES}
        self.chunk = 0

    def flush(self) -> None:
        """Write the rows held (each table's into its own files) and start the next set."""
        import pyarrow as pa
        import pyarrow.dataset as ds

        for table in TABLES:
            rows = self.rows[table]
            if not rows:
                continue
            if table in STATE_TABLES:
                for row in rows:
                    row['export_seq'] = self.report.export_seq
            data = pa.Table.from_pylist(rows, schema=self.schemas[table])
            ds.write_dataset(
                data,
                f'{self.base}/{table}',
                filesystem=self.fs,
                format='parquet',
                partitioning=ds.partitioning(pa.schema([('date', pa.string())]), flavor='hive'),
                basename_template=f'part-{self.export_id}-{self.chunk}-{{i}}.parquet',
                existing_data_behavior='overwrite_or_ignore',
            )
            self.report.rows[table] += len(rows)
            rows.clear()
        self.chunk += 1

    def fill_empty(self) -> None:
        """Give each table with no file under `base` one empty file, so that a glob over it finds it.

        A table with no rows (no decision yet in the log, an export since with nothing new) would
        otherwise be no directory at all, and `read_parquet` of its glob an error. The file is in the
        partition of no day (`date=1970-01-01/`), as a row with no time would be.
        """
        import pyarrow.fs as pafs
        import pyarrow.parquet as pq

        for table in TABLES:
            selector = pafs.FileSelector(f'{self.base}/{table}', allow_not_found=True, recursive=True)
            if any(info.type == pafs.FileType.File for info in self.fs.get_file_info(selector)):
                continue
            schema = self.schemas[table]
            where = f'{self.base}/{table}/date={day(None)}'
            self.fs.create_dir(where, recursive=True)
            empty = schema.remove(schema.get_field_index('date')).empty_table()
            pq.write_table(empty, f'{where}/part-{self.export_id}-empty.parquet', filesystem=self.fs)


async def _add_run(
    reader: ProjectionReader, run: RunRecord, runs_mark: dict[str, list[Any]], files: _Files
) -> None:
    """Add a run's rows to `files`, those `runs_mark` does not say were exported, and mark them."""
    rows, report = files.rows, files.report
    run_row = RUNS.make(run)
    effects = await reader.list_tool_effects(run.run_id)
    effect_rows = [TOOL_EFFECTS.make((e, run)) for e in effects]
    resolution_rows = [RESOLUTIONS.make((e, r, run)) for e in effects for r in e.resolutions]
    digest = _digest(run, run_row, effect_rows, resolution_rows)
    before = runs_mark.get(run.run_id)
    if before is not None and before[1] == digest:
        return  # nothing of this run changed since the mark
    runs_mark[run.run_id] = [run.last_seq, digest, [list(g) for g in run.gaps]]
    rows['runs'].append(run_row)
    rows['tool_effects'] += effect_rows
    rows['resolutions'] += resolution_rows
    for event in await reader.list_events(run.run_id):
        # Exactly what the run record says is there (its last seq, outside its gaps), and
        # none of what the mark says was exported: the next mark starts where this one ends.
        if not _exported(event.seq, run.last_seq, run.gaps):
            continue
        if before is not None and _exported(event.seq, before[0], before[2]):
            continue
        rows['events'].append(EVENTS.make(event))
        if event.kind in ('model_request_completed', 'model_request_failed'):
            rows['model_requests'].append(MODEL_REQUESTS.make(event))
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


def _write_manifest(files: _Files, mark: ExportMark | None, new_mark: ExportMark) -> None:
    """Write the manifest beside the tables: what this export wrote, and its mark."""
    fs, base, report = files.fs, files.base, files.report
    fs.create_dir(base, recursive=True)
    with fs.open_output_stream(f'{base}/{MANIFEST}') as manifest:
        manifest.write(
            json.dumps(
                {
                    'exported_at': datetime.now(UTC).isoformat(),
                    'export_id': files.export_id,
                    'export_seq': report.export_seq,
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
