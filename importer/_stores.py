"""Reading a pydantic-ai-harness store: its SQLite file or its directory, read-only, as stored.

The importer reads the reference's formats itself rather than through the reference's store
classes (decision 0060): `SqliteStepStore` creates and migrates its schema on the first call (a
write into the store being migrated), its `list_snapshots` skips a snapshot it cannot read with a
warning (an import would silently lose it), a SQLite store keeps only each call's latest ledger
record while a file store keeps every one (neither protocol method lists them), and its errors do
not say which record was bad. Only the reference's media markers are read with its own code
(`restore_media`, and its media store of the store's kind), when a history holds one: that format is
its walker's, versioned and escaped, and re-implementing it would be a second copy to keep in step.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

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


class SourceStore(Protocol):
    """A reference store opened for reading: its runs in the reference's `list_runs` order."""

    name: str
    """How messages name it: its kind and path."""

    def run_ids(self) -> list[str]:
        """Every run id, by `started_at` then run id."""
        ...

    async def read_run(self, run_id: str) -> ReferenceRun:
        """The run with everything the store holds of it, or `DamagedStore`."""
        ...

    def close(self) -> None:
        """Release the store."""
        ...


def open_store(path: str | Path, *, media_store: Any = None) -> SourceStore:
    """The reference store at `path`: a directory is a `FileStepStore`, a file a `SqliteStepStore`.

    `media_store` is the reference's `MediaStore` its histories' externalized media are in, when
    it is not the store's default (`<dir>/media` for a file store, the `media` table of the SQLite
    file); pydantic-ai-harness is imported only for a history that holds such media.
    """
    where = Path(path)
    if where.is_dir():
        return FileStore(where, media_store)
    if where.is_file():
        return SqliteStore(where, media_store)
    raise UsageError(
        f'no reference store at {str(where)!r}: give a SqliteStepStore file or a FileStepStore directory'
    )


async def stored_history(text: str, marked: bool, store: SourceStore, media: Any, fields: Fields) -> object:
    """A snapshot's stored messages (JSON `text`) as a history, its media inlined when `marked`."""
    try:
        history: object = json.loads(text)
    except ValueError as exc:
        raise fields.damaged(f'its messages are not JSON ({exc})') from None
    if marked:
        history = await restore_media(history, store, media, fields)
    return history


async def restore_media(history: object, store: SourceStore, media: Any, fields: Fields) -> object:
    """`history` with the reference's externalized media inlined again, by the reference's own walker."""
    try:
        from pydantic_ai_harness.media import restore_media as restore
    except ImportError:
        raise fields.damaged(
            'its history holds media the reference stored apart; pydantic-ai-harness reads them back: '
            'install it where you run the import (pip install pydantic-ai-harness)'
        ) from None
    try:
        return await restore(history, media_store=media())
    except (OSError, ValueError, KeyError) as exc:
        raise fields.damaged(f'its media could not be read back: {exc!r:.300}') from None


class SqliteStore:
    """A `SqliteStepStore` file, opened read-only (nothing in it is created, migrated or changed)."""

    TABLES = ('runs', 'events', 'snapshots', 'tool_effects')

    def __init__(self, path: Path, media_store: Any = None) -> None:
        """Open `path` read-only and check it holds the reference's tables."""
        self.path = path
        self.name = f'SQLite {str(path)!r}'
        self._media_given = media_store
        self._media_made: Any = None
        self._conn = sqlite3.connect(f'{path.resolve().as_uri()}?mode=ro', uri=True)
        tables = set(self._query(None, 'the schema', "SELECT name FROM sqlite_master WHERE type = 'table'"))
        names = {row[0] for row in tables}
        missing = [t for t in self.TABLES if t not in names]
        if missing:
            raise DamagedStore(
                f'{self.name} is not a pydantic-ai-harness SqliteStepStore: '
                f'it has no table {", ".join(missing)}'
            )
        self._refs = 'snapshot_message_refs' in names and 'snapshot_messages' in names
        self._columns = {t: self._columns_of(t) for t in self.TABLES}

    def _columns_of(self, table: str) -> set[str]:
        return {row[1] for row in self._query(None, f'table {table}', f'PRAGMA table_info({table})')}

    def _query(self, run_id: str | None, where: str, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as exc:  # truncated or overwritten: "malformed", "not a database"
            raise damaged(self.name, run_id, where, f'SQLite cannot read it ({exc})') from None

    def _select(self, table: str, names: tuple[str, ...]) -> str:
        """The column list of `names`, NULL for a column an older reference did not have yet."""
        have = self._columns[table]
        return ', '.join(n if n in have else f'NULL AS {n}' for n in names)

    def run_ids(self) -> list[str]:
        """Every run id, by `started_at` then run id."""
        rows = self._query(None, 'table runs', 'SELECT run_id FROM runs ORDER BY started_at, run_id')
        return [row[0] for row in rows]

    def _media(self) -> Any:
        if self._media_given is not None:
            return self._media_given
        if self._media_made is None:
            from pydantic_ai_harness.media import SqliteMediaStore

            self._media_made = SqliteMediaStore(database=self.path)
        return self._media_made

    async def read_run(self, run_id: str) -> ReferenceRun:
        """The run with its events, snapshots (histories rebuilt, media restored) and ledger."""
        run_cols = (
            'run_id',
            'conversation_id',
            'parent_run_id',
            'agent_name',
            'metadata',
            'started_at',
            'registration_id',
        )
        rows = self._query(
            run_id,
            'table runs',
            f'SELECT {self._select("runs", run_cols)} FROM runs WHERE run_id = ?',
            (run_id,),
        )
        if not rows:
            raise damaged(self.name, run_id, 'table runs', 'the run is gone')
        run = ReferenceRun(
            run_record(Fields(self.name, run_id, 'runs row', dict(zip(run_cols, rows[0], strict=True))))
        )
        event_cols = (
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
        for row in self._query(
            run_id,
            'table events',
            f'SELECT {self._select("events", event_cols)} FROM events WHERE run_id = ? ORDER BY seq',
            (run_id,),
        ):
            data = dict(zip(event_cols, row, strict=True))
            run.events.append(event(Fields(self.name, run_id, f'events row seq={data["seq"]}', data)))
        snapshot_cols = ('seq', 'step_index', 'timestamp', 'state', 'messages', 'idempotency_key')
        for row in self._query(
            run_id,
            'table snapshots',
            f'SELECT {self._select("snapshots", snapshot_cols)} FROM snapshots WHERE run_id = ? ORDER BY seq',
            (run_id,),
        ):
            data = dict(zip(snapshot_cols, row, strict=True))
            fields = Fields(self.name, run_id, f'snapshots row seq={data["seq"]}', data)
            history = await self._history(fields)
            run.snapshots.append(snapshot(fields, history))
        effect_cols = (
            'tool_call_id',
            'tool_name',
            'status',
            'started_at',
            'ended_at',
            'idempotency_key',
            'effect_summary',
        )
        for row in self._query(
            run_id,
            'table tool_effects',
            f'SELECT {self._select("tool_effects", effect_cols)} FROM tool_effects '
            'WHERE run_id = ? ORDER BY rowid',
            (run_id,),
        ):
            data = dict(zip(effect_cols, row, strict=True))
            run.effects.append(
                effect(Fields(self.name, run_id, f'tool_effects row {data["tool_call_id"]!r:.80}', data))
            )
        return run

    async def _history(self, fields: Fields) -> object:
        """The snapshot's history as JSON values: inline, or rebuilt from its message references."""
        text = fields.text('messages')
        marked = MEDIA_MARK in text
        if text.startswith('{'):  # {"stored_messages": N}: each message stored once, referenced in order
            try:
                count = json.loads(text)['stored_messages']
            except (ValueError, KeyError, TypeError):
                raise fields.damaged('messages is neither a history nor a count of stored messages') from None
            if not self._refs:
                raise fields.damaged(
                    'it references stored messages, but the store has no snapshot_messages table'
                )
            stored = self._query(
                fields.run_id,
                fields.where,
                'SELECT m.message FROM snapshot_message_refs r '
                'LEFT JOIN snapshot_messages m ON m.sha256 = r.sha256 '
                'WHERE r.snapshot_seq = ? ORDER BY r.position',
                (fields.data['seq'],),
            )
            found = [row[0] for row in stored if row[0] is not None]
            if not isinstance(count, int) or len(found) != count or len(stored) != count:
                raise fields.damaged(f'{count} stored message(s) referenced, {len(found)} found')
            marked = marked or any(MEDIA_MARK in m for m in found)
            text = '[' + ','.join(found) + ']'
        return await stored_history(text, marked, self, self._media, fields)

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()


class FileStore:
    """A `FileStepStore` directory: per run `run.json`, `events.jsonl`, `tool_effects.jsonl`, `snapshots/`."""

    def __init__(self, root: Path, media_store: Any = None) -> None:
        """Read the run records under `root`."""
        self.root = root
        self.name = f'directory {str(root)!r}'
        self._media_given = media_store
        self._media_made: Any = None
        self._started: dict[str, Any] = {}
        for sub in sorted(root.iterdir()):
            path = sub / 'run.json'
            if not path.is_file():
                continue
            fields = Fields(
                self.name, sub.name, f'{sub.name}/run.json', self._json(sub.name, path, 'run.json')
            )
            record = run_record(fields)
            if record.run_id != sub.name:
                raise fields.damaged(f'it names run {record.run_id!r:.80}, not its directory')
            self._started[sub.name] = record.started_at

    def _json(self, run_id: str, path: Path, where: str) -> dict[str, Any]:
        return self._text_and_json(run_id, path, where)[1]

    def _text_and_json(self, run_id: str, path: Path, where: str) -> tuple[str, dict[str, Any]]:
        try:
            text = path.read_text(encoding='utf-8')
            data = json.loads(text)
        except (OSError, ValueError) as exc:
            raise damaged(self.name, run_id, where, f'not readable JSON ({exc})') from None
        if not isinstance(data, dict):
            raise damaged(self.name, run_id, where, 'not a JSON object')
        return text, data

    def run_ids(self) -> list[str]:
        """Every run id, by `started_at` then run id."""
        return sorted(self._started, key=lambda r: (self._started[r], r))

    def _lines(self, run_id: str, name: str) -> Iterator[Fields]:
        path = self.root / run_id / name
        if not path.exists():
            return
        try:
            text = path.read_text(encoding='utf-8')
        except (OSError, ValueError) as exc:
            raise damaged(self.name, run_id, name, f'not readable ({exc})') from None
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f'{name} line {number}'
            try:
                data = json.loads(line)
            except ValueError as exc:
                raise damaged(self.name, run_id, where, f'not JSON ({exc})') from None
            if not isinstance(data, dict):
                raise damaged(self.name, run_id, where, 'not a JSON object')
            yield Fields(self.name, run_id, where, data)

    def _media(self) -> Any:
        if self._media_given is not None:
            return self._media_given
        if self._media_made is None:
            from pydantic_ai_harness.media import DiskMediaStore

            self._media_made = DiskMediaStore(self.root / 'media')
        return self._media_made

    async def read_run(self, run_id: str) -> ReferenceRun:
        """The run with its events, snapshots (media restored) and every ledger record, in file order."""
        run_dir = self.root / run_id
        data = self._json(run_id, run_dir / 'run.json', 'run.json')
        run = ReferenceRun(run_record(Fields(self.name, run_id, 'run.json', data)))
        run.events = [event(fields) for fields in self._lines(run_id, 'events.jsonl')]
        run.effects = [effect(fields) for fields in self._lines(run_id, 'tool_effects.jsonl')]
        snap_dir = run_dir / 'snapshots'
        numbered = sorted(
            (int(p.stem), p)
            for p in (snap_dir.glob('*.json') if snap_dir.is_dir() else ())
            if p.stem.isdigit()
        )
        for number, path in numbered:
            where = f'snapshots/{number}.json'
            text, data = self._text_and_json(run_id, path, where)
            fields = Fields(self.name, run_id, where, data)
            history = fields.data.get('messages')
            if history is None:
                raise fields.damaged('it has no messages')
            if MEDIA_MARK in text:
                history = await restore_media(history, self, self._media, fields)
            run.snapshots.append(snapshot(fields, history))
        return run

    def close(self) -> None:
        """Nothing to release."""
