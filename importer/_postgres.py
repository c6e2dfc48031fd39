"""Reading a pydantic-ai-harness `PostgresStepStore`: its tables, directly and read-only, through asyncpg.

As with the SQLite file (`_stores.py`, decision 0060), the tables are read here rather than through
the reference's store class, which creates its schema on the first call and skips a snapshot it
cannot read. The session is read-only (`default_transaction_read_only`) and the whole import reads
one repeatable-read transaction, so the runs listed and the rows read are one state of the store,
even if its writers were still running. asyncpg is an optional dependency (`stepstream[import-postgres]`).

The tables, each named by the store's prefix (`step_persistence` unless it was given another):
`{prefix}_runs`, `{prefix}_events` and `{prefix}_snapshots` (ordered by an identity `seq`),
`{prefix}_messages` (each stored message once, by SHA-256; a snapshot's `messages` holds
`{"message_refs": [...]}`, or its history inline when written by an older reference),
`{prefix}_tool_effects` (a call's latest record only) and `{prefix}_media`. Times and JSON are text,
as in the SQLite file.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from stepstream.errors import UsageError
from stepstream.importer._reference import (
    MEDIA_MARK,
    DamagedStore,
    Fields,
    ReferenceRun,
    damaged,
    effect,
    event,
    run_record,
    snapshot,
)
from stepstream.importer._stores import stored_history

DSN_SCHEMES = ('postgresql://', 'postgres://')
"""What a store location starts with when it is a Postgres DSN rather than a path."""

DEFAULT_PREFIX = 'step_persistence'
"""The reference's default table prefix."""

_PREFIX = re.compile(r'[a-z_][a-z0-9_]{0,39}')

_RUN_COLUMNS = (
    'run_id',
    'conversation_id',
    'parent_run_id',
    'agent_name',
    'metadata',
    'started_at',
    'registration_id',
)
_EVENT_COLUMNS = (
    'seq',
    'kind',
    'step_index',
    'timestamp',
    'tool_call_id',
    'tool_name',
    'error',
    'metadata',
    'idempotency_key',
)
_SNAPSHOT_COLUMNS = ('seq', 'step_index', 'timestamp', 'state', 'messages', 'idempotency_key')
_EFFECT_COLUMNS = (
    'tool_call_id',
    'tool_name',
    'status',
    'started_at',
    'ended_at',
    'idempotency_key',
    'effect_summary',
)


def is_dsn(location: object) -> bool:
    """Whether `location` names a Postgres database (`postgresql://...`) rather than a file or directory."""
    return isinstance(location, str) and location.startswith(DSN_SCHEMES)


def shown(dsn: str) -> str:
    """`dsn` without its password and query (options may hold secrets too), for messages."""
    try:
        parts = urlsplit(dsn)
        host = parts.hostname or ''
        port = f':{parts.port}' if parts.port else ''
    except ValueError:
        return 'postgresql://...'
    user = f'{parts.username}@' if parts.username else ''
    return urlunsplit((parts.scheme, f'{user}{host}{port}', parts.path, '', ''))


async def open_postgres(dsn: str, *, prefix: str | None = None, media_store: Any = None) -> PostgresStore:
    """The `PostgresStepStore` whose tables start with `prefix` in the database at `dsn`, opened read-only.

    `prefix` is the store's `table` (None: the reference's default, `step_persistence`).

    `media_store` is the reference's `MediaStore` its histories' externalized media are in, when it
    is not the store's default (the `{prefix}_media` table, read here without the reference's class,
    which would create it). Raises `UsageError` when asyncpg is missing or the server cannot be
    reached, `DamagedStore` when the database holds no such store.
    """
    prefix = DEFAULT_PREFIX if prefix is None else prefix
    if not _PREFIX.fullmatch(prefix):
        raise UsageError(
            f'{prefix!r} is not a PostgresStepStore table prefix (lowercase, at most 40 characters)'
        )
    try:
        import asyncpg
    except ImportError:
        raise UsageError(
            'reading a Postgres store needs asyncpg: pip install "stepstream[import-postgres]"'
        ) from None
    name = f'Postgres {shown(dsn)!r} (tables {prefix}_*)'
    try:
        conn = await asyncpg.connect(
            dsn,
            server_settings={'default_transaction_read_only': 'on', 'application_name': 'stepstream-import'},
        )
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
        raise UsageError(f'cannot connect to {name}: {exc}') from None
    store = PostgresStore(conn, name, prefix, media_store)
    try:
        await store.start()
    except BaseException:
        store.close()
        raise
    return store


class PostgresMedia:
    """The reference's `{prefix}_media` table as a media store that only reads (`restore_media` only gets)."""

    def __init__(self, conn: Any, table: str) -> None:
        """Read blobs from `table` over `conn`."""
        self._conn, self._table = conn, table

    async def get(self, uri: str, *, context: object = None) -> bytes:
        """The bytes at the reference's media `uri`; `FileNotFoundError` if the table lacks them."""
        import asyncpg
        from pydantic_ai_harness.media import parse_media_uri

        digest = parse_media_uri(uri)
        try:
            row = await self._conn.fetchrow(f'SELECT bytes FROM {self._table} WHERE sha256 = $1', digest)
        except asyncpg.PostgresError as exc:
            raise FileNotFoundError(f'{self._table}: {exc}') from None
        if row is None:
            raise FileNotFoundError(f'{self._table} has no media {digest}')
        return bytes(row[0])


class PostgresStore:
    """A `PostgresStepStore`'s tables over one read-only connection, in one repeatable-read transaction."""

    def __init__(self, conn: Any, name: str, prefix: str, media_store: Any = None) -> None:
        """Use `conn` (open_postgres makes it); `start` reads the schema and the runs."""
        self.name = name
        self._conn = conn
        self._prefix = prefix
        self._media_store = media_store if media_store is not None else PostgresMedia(conn, f'{prefix}_media')
        self._columns: dict[str, set[str]] = {}
        self._run_ids: list[str] = []

    def _table(self, kind: str) -> str:
        return f'{self._prefix}_{kind}'

    async def _query(self, run_id: str | None, where: str, sql: str, *params: Any) -> list[Any]:
        import asyncpg

        try:
            return list(await self._conn.fetch(sql, *params))
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            raise damaged(self.name, run_id, where, f'Postgres cannot read it ({exc})') from None

    async def start(self) -> None:
        """Begin the transaction, check the tables are the reference's and list the runs."""
        await self._conn.execute('BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY')
        kinds = ('runs', 'events', 'snapshots', 'tool_effects', 'messages')
        rows = await self._query(
            None,
            'the schema',
            'SELECT table_name, column_name FROM information_schema.columns '
            'WHERE table_schema = current_schema() AND table_name = ANY($1::text[])',
            [self._table(k) for k in kinds],
        )
        for table, column in rows:
            self._columns.setdefault(table, set()).add(column)
        missing = [self._table(k) for k in kinds[:4] if self._table(k) not in self._columns]
        if missing:
            raise DamagedStore(
                f'{self.name} is not a pydantic-ai-harness PostgresStepStore: '
                f'it has no table {", ".join(missing)}'
            )
        started = {}
        for run_id, at in await self._query(
            None, f'table {self._table("runs")}', f'SELECT run_id, started_at FROM {self._table("runs")}'
        ):
            fields = Fields(self.name, run_id, f'{self._table("runs")} row', {'started_at': at})
            started[run_id] = fields.time('started_at')
        self._run_ids = sorted(started, key=lambda r: (started[r], r))  # the reference's order: by instant

    def _select(self, kind: str, names: tuple[str, ...]) -> str:
        """The column list of `names`, NULL for a column an older reference did not have yet."""
        have = self._columns.get(self._table(kind), set())
        return ', '.join(n if n in have else f'NULL AS {n}' for n in names)

    async def _rows(self, run_id: str, kind: str, names: tuple[str, ...], order: str) -> list[dict[str, Any]]:
        table = self._table(kind)
        rows = await self._query(
            run_id,
            f'table {table}',
            f'SELECT {self._select(kind, names)} FROM {table} WHERE run_id = $1 ORDER BY {order}',
            run_id,
        )
        return [dict(zip(names, row, strict=True)) for row in rows]

    def run_ids(self) -> list[str]:
        """Every run id, by `started_at` (as an instant, as the reference lists them) then run id."""
        return list(self._run_ids)

    def _media(self) -> Any:
        return self._media_store

    async def read_run(self, run_id: str) -> ReferenceRun:
        """The run with its events, snapshots (histories rebuilt, media restored) and ledger."""
        runs = self._table('runs')
        found = await self._rows(run_id, 'runs', _RUN_COLUMNS, 'run_id')
        if not found:
            raise damaged(self.name, run_id, f'table {runs}', 'the run is gone')
        run = ReferenceRun(run_record(Fields(self.name, run_id, f'{runs} row', found[0])))
        for data in await self._rows(run_id, 'events', _EVENT_COLUMNS, 'seq'):
            where = f'{self._table("events")} row seq={data["seq"]}'
            run.events.append(event(Fields(self.name, run_id, where, data)))
        for data in await self._rows(run_id, 'snapshots', _SNAPSHOT_COLUMNS, 'seq'):
            fields = Fields(self.name, run_id, f'{self._table("snapshots")} row seq={data["seq"]}', data)
            run.snapshots.append(snapshot(fields, await self._history(fields)))
        # The table keeps a call's latest record, with no order of writing: by start, then call.
        for data in await self._rows(run_id, 'tool_effects', _EFFECT_COLUMNS, 'started_at, tool_call_id'):
            where = f'{self._table("tool_effects")} row {data["tool_call_id"]!r:.80}'
            run.effects.append(effect(Fields(self.name, run_id, where, data)))
        return run

    async def _history(self, fields: Fields) -> object:
        """The snapshot's history as JSON values: inline, or rebuilt from the stored messages it names."""
        text = fields.text('messages')
        marked = MEDIA_MARK in text
        if text.startswith('{'):  # {"message_refs": [sha256, ...]}: each message stored once
            try:
                refs = json.loads(text)['message_refs']
            except (ValueError, KeyError, TypeError):
                raise fields.damaged('messages is neither a history nor stored message references') from None
            if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
                raise fields.damaged('its message_refs are not a list of keys')
            messages = self._table('messages')
            if messages not in self._columns:
                raise fields.damaged(f'it references stored messages, but the store has no table {messages}')
            rows = await self._query(
                fields.run_id,
                fields.where,
                f'SELECT sha256, message FROM {messages} WHERE sha256 = ANY($1::text[])',
                sorted(set(refs)),
            )
            stored = {sha: message for sha, message in rows}
            lacking = len({r for r in refs if r not in stored})
            if lacking:
                raise fields.damaged(
                    f'{len(refs)} stored message(s) referenced, {lacking} missing from {messages}'
                )
            found = [stored[r] for r in refs]
            marked = marked or any(MEDIA_MARK in m for m in found)
            text = '[' + ','.join(found) + ']'
        return await stored_history(text, marked, self, self._media, fields)

    def close(self) -> None:
        """Drop the connection: the server ends the read-only transaction (nothing was written)."""
        self._conn.terminate()
