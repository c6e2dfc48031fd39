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
filesystem, the same credentials as the media store). See docs/decisions/0020-analytics-export.md.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelResponse

from stepstream.errors import StepStreamError
from stepstream.projector._reader import ProjectionReader
from stepstream.schemas import RunRecord, StepEvent, ToolEffectRecord
from stepstream.settings import Settings

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

TABLES = ('runs', 'events', 'model_requests', 'tool_effects', 'messages')
"""The tables an export writes, each a directory under the target."""

COST_SCALE = 18
"""Decimal places of the `cost_usd` columns (`decimal(38, 18)`): costs are rounded half-even to them."""

RUNS_PER_FILE = 1000
"""Runs whose rows go into one set of files: bounds the memory an export holds."""

_MESSAGE = TypeAdapter(ModelMessage)
_QUANTUM = Decimal(1).scaleb(-COST_SCALE)


@dataclass
class ExportReport:
    """What an export wrote: rows per table, and the runs whose messages could not be replayed."""

    target: str
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TABLES, 0))
    unreadable_histories: list[str] = field(default_factory=list)
    """Runs whose snapshots cannot be reconstructed (a gap in the log): no `messages` rows for them."""


def _schemas() -> dict[str, pa.Schema]:
    import pyarrow as pa

    ts = pa.timestamp('us', tz='UTC')
    cost = pa.decimal128(38, COST_SCALE)
    return {
        'runs': pa.schema(
            [
                ('run_id', pa.string()),
                ('agent_name', pa.string()),
                ('conversation_id', pa.string()),
                ('parent_run_id', pa.string()),
                ('status', pa.string()),
                ('started_at', ts),
                ('ended_at', ts),
                ('error', pa.string()),
                ('metadata', pa.map_(pa.string(), pa.string())),
                ('registration_id', pa.string()),
                ('event_count', pa.int64()),
                ('last_seq', pa.int64()),
                ('missing_seqs', pa.int64()),
                ('model_requests', pa.int64()),
                ('requests', pa.int64()),
                ('input_tokens', pa.int64()),
                ('output_tokens', pa.int64()),
                ('cache_read_tokens', pa.int64()),
                ('cache_write_tokens', pa.int64()),
                ('cost_usd', cost),
                ('unpriced_requests', pa.int64()),
                ('model_request_us', pa.int64()),
                ('tool_calls', pa.int64()),
                ('tool_call_failures', pa.int64()),
                ('tool_call_us', pa.int64()),
                ('date', pa.string()),
            ]
        ),
        'events': pa.schema(
            [
                ('run_id', pa.string()),
                ('seq', pa.int64()),
                ('writer_id', pa.string()),
                ('timestamp', ts),
                ('kind', pa.string()),
                ('step_index', pa.int64()),
                ('agent_name', pa.string()),
                ('conversation_id', pa.string()),
                ('parent_run_id', pa.string()),
                ('tool_call_id', pa.string()),
                ('tool_name', pa.string()),
                ('error', pa.string()),
                ('idempotency_key', pa.string()),
                ('snapshot_seq', pa.int64()),
                ('duration_us', pa.int64()),
                ('trace_id', pa.string()),
                ('span_id', pa.string()),
                ('date', pa.string()),
            ]
        ),
        'model_requests': pa.schema(
            [
                ('run_id', pa.string()),
                ('seq', pa.int64()),
                ('timestamp', ts),
                ('agent_name', pa.string()),
                ('conversation_id', pa.string()),
                ('step_index', pa.int64()),
                ('failed', pa.bool_()),
                ('error', pa.string()),
                ('model_name', pa.string()),
                ('provider', pa.string()),
                ('input_tokens', pa.int64()),
                ('output_tokens', pa.int64()),
                ('cache_read_tokens', pa.int64()),
                ('cache_write_tokens', pa.int64()),
                ('requests', pa.int64()),
                ('finish_reason', pa.string()),
                ('cost_usd', cost),
                ('duration_us', pa.int64()),
                ('trace_id', pa.string()),
                ('span_id', pa.string()),
                ('date', pa.string()),
            ]
        ),
        'tool_effects': pa.schema(
            [
                ('run_id', pa.string()),
                ('agent_name', pa.string()),
                ('tool_call_id', pa.string()),
                ('tool_name', pa.string()),
                ('status', pa.string()),
                ('unknown_after_crash', pa.bool_()),
                ('run_status', pa.string()),
                ('started_at', ts),
                ('ended_at', ts),
                ('idempotency_key', pa.string()),
                ('effect_summary', pa.string()),
                ('error', pa.string()),
                ('last_seq', pa.int64()),
                ('resolution', pa.string()),
                ('resolved_by', pa.string()),
                ('resolved_at', ts),
                ('resolution_note', pa.string()),
                ('date', pa.string()),
            ]
        ),
        'messages': pa.schema(
            [
                ('run_id', pa.string()),
                ('agent_name', pa.string()),
                ('snapshot_seq', pa.int64()),
                ('snapshot_state', pa.string()),
                ('message_index', pa.int64()),
                ('kind', pa.string()),
                ('timestamp', ts),
                ('model_name', pa.string()),
                ('part_kinds', pa.list_(pa.string())),
                ('message_json', pa.string()),
                ('date', pa.string()),
            ]
        ),
    }


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
        'status': run.status,
        'started_at': run.started_at,
        'ended_at': run.ended_at,
        'error': run.error,
        'metadata': list(run.metadata.items()),
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


async def export_parquet(
    reader: ProjectionReader,
    out: str,
    settings: Settings,
    *,
    progress: Callable[[int], None] | None = None,
) -> ExportReport:
    """Write the five tables of a projection as Parquet under `out` (a directory or `s3://bucket/prefix`).

    ```python
    report = await export_parquet(projector.reader(), 'analytics', settings)
    # duckdb: SELECT agent_name, sum(cost_usd) FROM 'analytics/runs/**/*.parquet' GROUP BY ALL
    ```

    An export replaces the tables under `out` (each export writes the whole projection).
    """
    import pyarrow as pa
    import pyarrow.dataset as ds

    fs, base = export_filesystem(out, settings)
    schemas = _schemas()
    report = ExportReport(target=out)
    export_id = uuid.uuid4().hex[:12]
    for table in TABLES:
        fs.delete_dir_contents(f'{base}/{table}', missing_dir_ok=True)

    rows: dict[str, list[dict[str, Any]]] = {t: [] for t in TABLES}
    chunk = 0

    def flush() -> None:
        nonlocal chunk
        for table in TABLES:
            if not rows[table]:
                continue
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
            rows['runs'].append(_run_row(run))
            for event in await reader.list_events(run.run_id):
                rows['events'].append(_event_row(event))
                if event.kind in ('model_request_completed', 'model_request_failed'):
                    rows['model_requests'].append(_request_row(event))
            for effect in await reader.list_tool_effects(run.run_id):
                rows['tool_effects'].append(_effect_row(effect, run))
            try:
                snap = await reader.latest_snapshot(run.run_id, include_interrupted=True, restore=False)
            except StepStreamError:
                report.unreadable_histories.append(run.run_id)
                snap = None
            if snap is not None:
                rows['messages'] += _message_rows(run, snap.messages, snap.snapshot_seq, snap.state)
        done += len(page)
        if progress is not None:
            progress(done)
        flush()
        after = page[-1].run_id
    flush()
    fs.create_dir(base, recursive=True)
    with fs.open_output_stream(f'{base}/_stepstream_export.json') as manifest:
        manifest.write(
            json.dumps(
                {
                    'exported_at': datetime.now(UTC).isoformat(),
                    'tables': list(TABLES),
                    'rows': report.rows,
                    'unreadable_histories': report.unreadable_histories,
                },
                indent=2,
            ).encode()
        )
    return report
