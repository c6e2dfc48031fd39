"""`stepstream import` from a reference `PostgresStepStore`, on a PostgreSQL server the tests start.

Broker tier (it starts a server process), run once: nothing here touches a broker; the log and
projection are the in-memory ones (tests/memory_projection.py). Each store is filled by
pydantic-ai-harness's own `StepPersistence` on its `PostgresStepStore` over an asyncpg pool, in a
database of its own; the import is compared run by run with what the reference store returns
(`assert_imported`), a second import writes nothing, a damaged row is named, nothing is ever written
into the store's database, and a property writes generated stores through the reference's methods.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from pydantic_ai_harness.step_persistence import PostgresStepStore
from test_importer_writers import _write_reference, runs

from stepstream.errors import UsageError
from stepstream.importer import DamagedStore, ImportReport, import_store, import_writer_id, open_postgres
from stepstream.media import DiskMediaStore
from stepstream.producer import InMemoryLog, Redaction

from memory_projection import MemoryProjection
from postgres_server import postgres_server
from reference_stores import assert_imported, make_runs

pytestmark = [pytest.mark.broker, pytest.mark.once]

_numbers = itertools.count()


@pytest.fixture(scope='module')
def server() -> Iterator[str]:
    """The DSN of the server's `postgres` database, for the module."""
    with postgres_server() as dsn:
        yield dsn


async def _database(server: str) -> str:
    """A new, empty database on `server`; its DSN."""
    import asyncpg

    name = f'store_{next(_numbers)}'
    conn = await asyncpg.connect(server)
    try:
        await conn.execute(f'CREATE DATABASE {name}')
    finally:
        await conn.close()
    return server.rsplit('/', 1)[0] + f'/{name}'


@pytest.fixture
async def dsn(server: str) -> str:
    """A database of the test's own."""
    return await _database(server)


@pytest.fixture
async def store(dsn: str) -> AsyncIterator[Any]:
    """An empty reference `PostgresStepStore` (default prefix and media table) over an asyncpg pool."""
    import asyncpg

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        yield PostgresStepStore(pool)
    finally:
        await pool.close()


async def _import(log: InMemoryLog, projection: MemoryProjection, dsn: str, **options: Any) -> ImportReport:
    prefix = options.pop('prefix', None)
    source = await open_postgres(dsn, prefix=prefix)
    try:
        report = await import_store(
            source, log, projection.reader(), media_store=projection.media_store, **options
        )
    finally:
        source.close()
    await projection.wait_for()
    return report


def _setup(tmp_path: Path) -> tuple[InMemoryLog, MemoryProjection]:
    log = InMemoryLog()
    return log, MemoryProjection(log, DiskMediaStore(tmp_path / 'media'))


async def _fetch(dsn: str, sql: str, *params: Any) -> list[Any]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql, *params))
    finally:
        await conn.close()


async def test_every_run_reads_back_as_the_reference_store_returns_it(
    tmp_path: Path, dsn: str, store: Any
) -> None:
    await make_runs(store)
    log, projection = _setup(tmp_path)

    report = await _import(log, projection, dsn)

    assert await assert_imported(store, projection.reader()) == 5
    assert report.runs_read == report.runs_written == 5 and projection.dead == []
    assert (
        report.store.startswith("Postgres 'postgresql://postgres@") and 'step_persistence_*' in report.store
    )
    # The long answer and the image were in the reference's media table, and are in stepstream's store.
    (count,) = (await _fetch(dsn, 'SELECT count(*) FROM step_persistence_media'))[0]
    assert count == 2 and len(list((tmp_path / 'media').iterdir())) >= 2
    for ref in await store.list_runs():
        ours = await projection.reader().get_run(ref.run_id)
        assert ours is not None and ours.registration_id == import_writer_id(ref.run_id, ref.started_at)


async def test_a_second_import_writes_nothing(tmp_path: Path, dsn: str, store: Any) -> None:
    await make_runs(store)
    log, projection = _setup(tmp_path)
    first = await _import(log, projection, dsn)
    written = len(log.records)

    again = await _import(log, projection, dsn)

    assert len(log.records) == written
    assert (again.records_read, again.records_written, again.runs_already_imported) == (
        first.records_read,
        0,
        5,
    )


async def test_a_snapshot_whose_messages_do_not_validate_names_the_run_and_the_row(
    tmp_path: Path, dsn: str, store: Any
) -> None:
    await make_runs(store)
    first, second = [r.run_id for r in await store.list_runs()][:2]
    (seq, refs) = (
        await _fetch(
            dsn,
            'SELECT seq, messages FROM step_persistence_snapshots WHERE run_id = $1 ORDER BY seq LIMIT 1',
            second,
        )
    )[0]
    sha = refs.split('"')[3]  # {"message_refs": ["<sha256>", ...]}
    await _fetch(
        dsn, 'UPDATE step_persistence_messages SET message = $1 WHERE sha256 = $2', '{"kind": "letter"}', sha
    )
    log, projection = _setup(tmp_path)

    with pytest.raises(DamagedStore, match='do not validate') as caught:
        await _import(log, projection, dsn)

    assert f'run {second!r}, step_persistence_snapshots row seq={seq}' in str(caught.value)
    assert not any(r.record.run_id == second for r in log.records)
    assert any(r.record.run_id == first for r in log.records)
    assert caught.value.report.runs_written == 1  # type: ignore[attr-defined]


async def test_a_database_without_the_store_is_refused_and_left_as_it_was(dsn: str) -> None:
    with pytest.raises(DamagedStore, match='has no table step_persistence_runs, step_persistence_events'):
        await open_postgres(dsn)
    with pytest.raises(DamagedStore, match='has no table other_runs'):
        await open_postgres(dsn, prefix='other')
    assert await _fetch(dsn, "SELECT 1 FROM information_schema.tables WHERE table_schema = 'public'") == []
    with pytest.raises(UsageError, match='not a PostgresStepStore table prefix'):
        await open_postgres(dsn, prefix='Bad-Prefix')
    with pytest.raises(UsageError, match='cannot connect to'):
        await open_postgres(dsn.rsplit('/', 1)[0] + '/no_such_database')


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(generated=runs)
async def test_any_postgres_store_reads_back_as_it_returns_it(
    tmp_path: Path, server: str, generated: list[Any]
) -> None:
    import asyncpg

    prefix = f'gen_{next(_numbers)}'  # a store of its own in the server's database: the reference's `table`
    pool = await asyncpg.create_pool(server, min_size=1, max_size=2)
    try:
        store = PostgresStepStore(pool, table=prefix)
        await _write_reference(store, generated)
        log = InMemoryLog()
        projection = MemoryProjection(log, DiskMediaStore(tmp_path / prefix))
        await _import(log, projection, server, prefix=prefix, redaction=Redaction.off())
        assert projection.dead == []
        assert await assert_imported(store, projection.reader()) == len(generated)
        written = len(log.records)
        await _import(log, projection, server, prefix=prefix, redaction=Redaction.off())
        assert len(log.records) == written and projection.dead == []
    finally:
        await pool.close()
