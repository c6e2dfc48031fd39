"""`stepstream import` on the stack: reference stores made by real agents, imported by the command.

A SQLite file, a file directory and a Postgres database (on a server the module starts). The
command runs as a user runs it (a subprocess with the stack's settings), against a real broker
and a projector; each imported run reads back from the projection as the reference store returns
it (media from the stack's S3 bucket), a second import writes nothing (the log's end does not move),
and a rebuild of the projection from the log is identical to the live one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic_ai_harness.step_persistence import PostgresStepStore
from test_cli import cli

from stepstream import Settings
from stepstream.producer import EventLog
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader

from postgres_server import postgres_server
from reference_stores import assert_imported, make_runs, reference_store, store_path

pytestmark = pytest.mark.broker


async def test_import_a_sqlite_store_twice_then_rebuild_and_verify(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path, tmp_path: Path
) -> None:
    store = reference_store('sqlite', tmp_path)
    await make_runs(store)
    await projector.wait_for(await event_log.flush())  # the topics exist, the projection is open
    path = str(store_path('sqlite', tmp_path))

    code, out, err = await cli(settings, db_path, 'import', path, '--json')
    assert code == 0, err
    report = json.loads(out)
    assert (report['runs_read'], report['runs_written'], report['error']) == (5, 5, None), report
    end = await projector.catch_up()
    assert await assert_imported(store, ProjectionReader.of(projector)) == 5

    code, out, err = await cli(settings, db_path, 'import', path)
    assert code == 0, err
    assert 'wrote 0 record(s)' in out and 'skipped 5 run(s) imported before' in out, out
    assert await projector.catch_up() == end  # nothing was written

    code, out, err = await cli(settings, db_path, 'rebuild', '--into', str(tmp_path / 'fresh'))
    assert code == 0, err
    code, out, _ = await cli(settings, db_path, 'verify', str(db_path), str(tmp_path / 'fresh'))
    assert code == 0 and 'identical' in out, out


async def test_a_damaged_store_exits_1_naming_the_run_and_the_line(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path, tmp_path: Path
) -> None:
    store = reference_store('file', tmp_path)
    await make_runs(store)
    await projector.wait_for(await event_log.flush())
    first, second = [r.run_id for r in (await store.list_runs())[:2]]
    (store_path('file', tmp_path) / second / 'tool_effects.jsonl').write_text('not json\n')

    code, out, err = await cli(settings, db_path, 'import', str(store_path('file', tmp_path)), '--json')

    assert code == 1 and 'Traceback' not in err
    assert f"run '{second}', tool_effects.jsonl line 1: not JSON" in err
    assert json.loads(out)['runs_written'] == 1
    await projector.catch_up()
    reader = ProjectionReader.of(projector)
    assert await reader.get_run(first) is not None and await reader.get_run(second) is None


@pytest.fixture(scope='module')
def postgres() -> Iterator[str]:
    """A PostgreSQL server for the module: the DSN of its `postgres` database."""
    with postgres_server() as dsn:
        yield dsn


@pytest.mark.once  # reading Postgres does not depend on the broker; the SQLite import above runs on both
async def test_import_a_postgres_store_by_its_dsn(
    settings: Settings,
    event_log: EventLog,
    projector: Projector,
    db_path: Path,
    postgres: str,
    tmp_path: Path,
) -> None:
    import asyncpg

    pool = await asyncpg.create_pool(postgres, min_size=1, max_size=4)
    try:
        store = PostgresStepStore(pool, table='agents')  # a prefix of its own: `--table`
        await make_runs(store)
        await projector.wait_for(await event_log.flush())

        code, out, err = await cli(settings, db_path, 'import', postgres, '--table', 'agents', '--json')
        assert code == 0, err
        report = json.loads(out)
        assert (report['runs_read'], report['runs_written'], report['error']) == (5, 5, None), report
        assert report['store'].startswith("Postgres 'postgresql://postgres@127.0.0.1:"), report
        end = await projector.catch_up()
        assert await assert_imported(store, ProjectionReader.of(projector)) == 5

        code, out, err = await cli(settings, db_path, 'import', postgres, '--table', 'agents')
        assert code == 0 and 'skipped 5 run(s) imported before' in out, (out, err)
        assert await projector.catch_up() == end  # nothing was written
    finally:
        await pool.close()

    code, out, err = await cli(settings, db_path, 'import', postgres)  # the default prefix: no store there
    assert code == 1 and 'has no table step_persistence_runs' in err and 'Traceback' not in err, err
    code, out, err = await cli(settings, db_path, 'import', str(tmp_path), '--table', 'agents')
    assert code == 2 and '--table is a PostgresStepStore option' in err, err
