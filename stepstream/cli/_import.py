"""`stepstream import`: a pydantic-ai-harness store's runs appended to the log (decision 0060).

The store is read-only to the command; what is on the log already is read from the projection at
`STEPSTREAM_DB_PATH` (so a projector must have run: without it, runs of other writers could not be
told apart), and each run is written by its own writer with the producer's code, so redaction,
sealing and signing apply as the settings say. It prints what it read, wrote and skipped; a
damaged record ends it with exit 1 naming the run and the record, after the runs before it.
"""

from __future__ import annotations

import argparse
import json
import sys

from stepstream.cli._common import EXIT_FAILED, EXIT_OK, Declare, add_json, open_reader
from stepstream.settings import Settings


def add_commands(command: Declare) -> None:
    """Declare `import`."""
    parser = command(
        'import',
        _import,
        'Append the runs of a pydantic-ai-harness store (a SqliteStepStore file, a FileStepStore '
        'directory or a PostgresStepStore database) to the log, each once, by its own writer; a second '
        'import writes nothing.',
    )
    parser.add_argument(
        'path',
        help='the SqliteStepStore file, the FileStepStore directory, or the PostgresStepStore database as a '
        'DSN (postgresql://user@host:5432/db; needs stepstream[import-postgres])',
    )
    parser.add_argument(
        '--table',
        default=None,
        metavar='PREFIX',
        help="a PostgresStepStore's table prefix, when it was given one (default step_persistence)",
    )
    parser.add_argument(
        '--concurrency',
        type=int,
        default=16,
        metavar='N',
        help='runs written at once (each waits for the broker at its end; default 16)',
    )
    add_json(parser)


async def _import(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.errors import UsageError
    from stepstream.importer import (
        DamagedStore,
        ImportReport,
        import_store,
        is_dsn,
        open_postgres,
        open_store,
    )
    from stepstream.media import S3MediaStore
    from stepstream.producer import EventLog

    if args.concurrency < 1:
        raise UsageError(f'--concurrency must be at least 1, got {args.concurrency}')
    if args.table is not None and not is_dsn(args.path):
        raise UsageError('--table is a PostgresStepStore option: give the store as postgresql://...')
    store = await open_postgres(args.path, prefix=args.table) if is_dsn(args.path) else open_store(args.path)
    report: ImportReport | None = None
    error: DamagedStore | None = None
    try:
        async with open_reader(settings) as reader, EventLog(settings) as log:
            try:
                report = await import_store(
                    store,
                    log,
                    reader,
                    media_store=S3MediaStore.from_settings(settings.media),
                    concurrency=args.concurrency,
                )
            except DamagedStore as exc:
                error, report = exc, getattr(exc, 'report', None)
    finally:
        store.close()
    if args.json:
        answer = report.as_dict() if report is not None else {}
        print(json.dumps({**answer, 'error': None if error is None else str(error)}, indent=2))
    elif report is not None:
        print(report.text())
    if error is not None:
        print(f'stepstream: {error}', file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
