"""`stepstream import`: a pydantic-ai-harness store's runs appended to the log, each by its own writer.

Read top-down: `_import.py` (`import_store`: which runs to write, what is on the log already, the
report) -> `_writing.py` (one run as the records the capability would have appended, through the
producer's `RunWriter` and `SnapshotWriter`) -> `_stores.py` (the reference's SQLite file and
directory, read-only), `_postgres.py` (its Postgres tables, read-only, through asyncpg) ->
`_reference.py` (its records, checked field by field). Decision 0060.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.importer._import import ImportReport, import_store
    from stepstream.importer._postgres import PostgresStore, is_dsn, open_postgres
    from stepstream.importer._reference import DamagedStore, ReferenceRun
    from stepstream.importer._stores import SourceStore, open_store
    from stepstream.importer._writing import IMPORTED_KEY, import_writer_id

_WHERE = {
    'IMPORTED_KEY': 'stepstream.importer._writing',
    'DamagedStore': 'stepstream.importer._reference',
    'ImportReport': 'stepstream.importer._import',
    'ReferenceRun': 'stepstream.importer._reference',
    'SourceStore': 'stepstream.importer._stores',
    'import_store': 'stepstream.importer._import',
    'is_dsn': 'stepstream.importer._postgres',
    'open_postgres': 'stepstream.importer._postgres',
    'PostgresStore': 'stepstream.importer._postgres',
    'import_writer_id': 'stepstream.importer._writing',
    'open_store': 'stepstream.importer._stores',
}
"""Where each public name lives: imported on first use, so a command pays only for what it uses."""

__all__ = [
    'IMPORTED_KEY',
    'DamagedStore',
    'ImportReport',
    'PostgresStore',
    'ReferenceRun',
    'SourceStore',
    'import_store',
    'import_writer_id',
    'is_dsn',
    'open_postgres',
    'open_store',
]

__getattr__ = lazy_exports(__name__, _WHERE)
