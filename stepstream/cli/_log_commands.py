"""Commands over the whole log and projection: rebuild, verify, status, export, topics, schemas."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stepstream.cli._common import EXIT_FAILED, EXIT_OK, Declare, add_json, open_reader
from stepstream.errors import UsageError
from stepstream.settings import Settings


def add_commands(command: Declare) -> None:
    """Declare `rebuild`, `verify`, `status`, `export`, `topics` and `schemas`."""
    rebuild = command(
        'rebuild', _rebuild, 'Replay both topics from offset zero into a new projection directory.'
    )
    rebuild.add_argument(
        '--into', required=True, help='a new or empty directory, or an unfinished rebuild to resume'
    )
    rebuild.add_argument(
        '--max-snapshots-per-run', type=int, default=None, help='as for `stepstream projector`'
    )
    rebuild.add_argument('--like', metavar='PATH', help='copy the options of the projection at PATH')
    rebuild.add_argument('--jobs', type=int, default=1, metavar='N', help='rebuild the shards in N processes')

    verify = command('verify', _verify, 'Compare two projections; print the first difference.')
    verify.add_argument('left', help='a projection directory')
    verify.add_argument('right', help='another projection directory')

    status = command(
        'status', _status, 'Per-partition lag, records applied per second, DLQ count (exit 1 if behind).'
    )
    status.add_argument(
        '--max-lag',
        type=int,
        default=None,
        metavar='N',
        help='exit 1 when more than N records are not applied yet (a health check)',
    )
    add_json(status)

    export = command(
        'export',
        _export,
        'Write the projection as Parquet tables (runs, events, model_requests, tool_effects, resolutions, '
        'messages), partitioned by date, for DuckDB and friends.',
    )
    export.add_argument('--format', choices=['parquet'], default='parquet', help='the file format (Parquet)')
    export.add_argument(
        '--out', required=True, help="a directory, or s3://BUCKET/PREFIX in the settings' S3 endpoint"
    )
    export.add_argument(
        '--from-topics',
        action='store_true',
        help='read the topics from offset zero (a rebuild into a temporary projection), not --db-path',
    )
    export.add_argument(
        '--since',
        metavar='PATH_OR_MARK',
        help='an earlier export (its directory, s3://BUCKET/PREFIX or _stepstream_export.json): write only '
        'what changed after it (into that same --out: adds files; elsewhere: just the new rows)',
    )

    topics = command('topics', _topics, 'Create the topics (idempotent) and check they are co-partitioned.')
    topics.add_argument('action', choices=['ensure'], help='ensure: create what is missing, then check')

    schemas = command(
        'schemas',
        _schemas,
        'Register every committed schema version, in order, in the schema registry (registry mode).',
    )
    schemas.add_argument(
        'action',
        choices=['register'],
        help="register: set each topic subject's compatibility, then register its versions oldest first",
    )
    schemas.add_argument(
        '--compatibility',
        default='FULL_TRANSITIVE',
        help="the subjects' compatibility level (default FULL_TRANSITIVE: every version reads every other)",
    )


async def _rebuild(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli._paths import projection, to_make
    from stepstream.projector import progress_bar, rebuild

    to_make(
        '--into', args.into, 'folder', 'give --into a new or empty folder, or an unfinished rebuild to resume'
    )
    if args.like is not None:
        projection(
            '--like',
            args.like,
            'give --like the folder of a projection whose options to copy, or leave it out',
        )
    end = await rebuild(
        settings,
        args.into,
        max_snapshots_per_run=args.max_snapshots_per_run,
        like=args.like,
        on_progress=progress_bar(),
        jobs=args.jobs,
    )
    print(f'rebuilt {sum(end.values())} records into {args.into}')
    return EXIT_OK


async def _verify(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    from stepstream.cli._paths import projection
    from stepstream.projector import verify_paths

    for side, path in (('LEFT', args.left), ('RIGHT', args.right)):
        projection(
            f'verify {side}',
            path,
            "give two projection folders (a stack's is .stepstream/projection; "
            '`stepstream rebuild --into DIR` makes one from the log)',
        )
    equal, difference = await asyncio.to_thread(verify_paths, args.left, args.right)
    if difference is not None:
        print(f'projections differ after {equal} equal items; {difference}')
        return EXIT_FAILED
    print(f'projections are identical ({equal} items)')
    return EXIT_OK


async def _status(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.console import status_json, status_text
    from stepstream.topics import ensure_topics, log_end_offsets

    async with open_reader(settings) as reader:
        status = await reader.status()
    layout = await ensure_topics(settings, create=False)
    applied = {
        (topic, p): status.offsets.get((topic, p), 0)
        for topic in (settings.topics.step_events_topic, settings.topics.tool_effects_topic)
        for p in range(layout.partitions)
    }
    ends = await log_end_offsets(settings.kafka, applied)
    print(status_json(status, applied, ends) if args.json else status_text(status, applied, ends, settings))
    lag = sum(max(ends[tp] - offset, 0) for tp, offset in applied.items())
    if args.max_lag is not None and lag > args.max_lag:
        print(
            f'stepstream: the projection is {lag} records behind (more than --max-lag {args.max_lag})',
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


async def _export(args: argparse.Namespace, settings: Settings) -> int:
    import tempfile

    from stepstream.analytics import export_parquet, read_mark
    from stepstream.cli._paths import to_make
    from stepstream.projector import progress_bar, rebuild

    if not args.out.startswith('s3://'):
        to_make(
            '--out',
            args.out,
            'folder',
            'give --out a folder (new, or an earlier export) or s3://BUCKET/PREFIX',
        )
    mark = read_mark(args.since, settings) if args.since else None  # a bad mark fails before any work
    with tempfile.TemporaryDirectory(prefix='stepstream-export-') as scratch:
        if args.from_topics:  # the one replay of the log there is, into a projection thrown away after
            settings = settings.replace(db_path=str(Path(scratch) / 'projection'))
            await rebuild(settings, settings.projection.db_path, on_progress=progress_bar())
        async with open_reader(settings) as reader:
            report = await export_parquet(reader, args.out, settings, since=mark)
    counts = ', '.join(f'{rows} {table}' for table, rows in report.rows.items())
    since = f' (export {report.export_seq}, since {args.since})' if mark is not None else ''
    print(f'exported {counts} to {args.out}{since}')
    if report.unreadable_histories:
        print(
            f'{len(report.unreadable_histories)} run(s) have no messages rows: their snapshots cannot be '
            f'replayed (a gap in the log): {", ".join(report.unreadable_histories[:10])}',
            file=sys.stderr,
        )
    if report.erased_histories:
        print(f'{len(report.erased_histories)} run(s) have no messages rows: their content was erased')
    if report.sealed_histories:
        first = next(iter(report.sealed_histories.values()))
        key = (
            'STEPSTREAM_ERASURE_KEY is not set'
            if settings.security.erasure_key is None
            else 'STEPSTREAM_ERASURE_KEY is not the key-encryption key their writers used'
        )
        print(
            f'the export is incomplete: {len(report.sealed_histories)} run(s) have no messages rows because '
            f"their content is sealed and {key} ({first}). Export again with the writers' "
            'STEPSTREAM_ERASURE_KEY',
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


async def _topics(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.topics import ensure_topics

    layout = await ensure_topics(settings)
    print(
        f'{settings.topics.step_events_topic}, {settings.topics.tool_effects_topic}, '
        f'{settings.topics.dlq_topic}: '
        f'{layout.partitions} partitions each'
    )
    if settings.security.erasure_key is not None:  # erasure on: the compacted key topic too (decision 0033)
        from stepstream.erasure import ensure_key_topic, key_topic

        await ensure_key_topic(settings)
        print(f'{key_topic(settings.topics)}: compacted, the conversation keys')
    return EXIT_OK


async def _schemas(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.schema_registry import SchemaRegistry
    from stepstream.schemas import STEP_EVENT_SCHEMA, TOOL_EFFECT_SCHEMA, load_schema_versions, subject_of

    if settings.registry.schema_registry_url is None:
        raise UsageError('no schema registry: set STEPSTREAM_SCHEMA_REGISTRY_URL (--schema-registry-url)')
    versions = load_schema_versions()
    topics = {
        settings.topics.step_events_topic: STEP_EVENT_SCHEMA,
        settings.topics.tool_effects_topic: TOOL_EFFECT_SCHEMA,
    }
    async with SchemaRegistry(settings.registry, timeout_s=settings.kafka.ack_timeout_s) as registry:
        for topic, newest in topics.items():
            subject = subject_of(topic)
            ids = await registry.register_history(subject, versions[newest.name], args.compatibility)
            listed = ', '.join(f'v{v.version}={i}' for v, i in zip(versions[newest.name], ids, strict=True))
            print(f'{subject} ({args.compatibility}): {listed}')
    return EXIT_OK
