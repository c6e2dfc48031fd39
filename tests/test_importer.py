"""`stepstream import`: reference stores made by real agents read back as their stores return them.

Fast tier: the in-memory log and projection (tests/memory_projection.py). Each reference store is
made by pydantic-ai-harness's own `StepPersistence` on its `SqliteStepStore` or `FileStepStore`
(tests/reference_stores.py); the import is compared run by run, a second import writes nothing, an
interrupted import is finished by the next, a run of another writer is skipped, and a damaged store
stops the import naming the run and the record, with nothing of that run written.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

from stepstream import Settings
from stepstream.errors import StepStreamError
from stepstream.importer import DamagedStore, ImportReport, import_store, import_writer_id, open_store
from stepstream.media import DiskMediaStore
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.schemas import LogRecord, StepEvent

from memory_projection import MemoryProjection
from reference_stores import LONG_ANSWER, assert_imported, make_runs, reference_store, store_path

pytestmark = pytest.mark.fast

KINDS = ('sqlite', 'file')


async def _import(log: InMemoryLog, projection: MemoryProjection, path: Path, **options: Any) -> ImportReport:
    store = open_store(path)
    try:
        report = await import_store(
            store, log, projection.reader(), media_store=projection.media_store, **options
        )
    finally:
        store.close()
    await projection.wait_for()
    return report


def _setup(tmp_path: Path, settings: Settings | None = None) -> tuple[InMemoryLog, MemoryProjection]:
    log = InMemoryLog(settings)
    return log, MemoryProjection(log, DiskMediaStore(tmp_path / 'media'))


@pytest.mark.parametrize('kind', KINDS)
async def test_every_run_reads_back_as_the_reference_store_returns_it(tmp_path: Path, kind: str) -> None:
    store = reference_store(kind, tmp_path)
    await make_runs(store)
    log, projection = _setup(tmp_path)

    report = await _import(log, projection, store_path(kind, tmp_path))

    runs = await assert_imported(store, projection.reader())
    assert runs == 5 and report.runs_read == report.runs_written == runs
    assert report.records_written == len([r for r in log.records if r.record.seq >= 0]) - _signed(log)
    assert projection.dead == []
    # The long answer and the image went to the media stores of both: the reference's, and stepstream's.
    assert _reference_media(kind, tmp_path) == 2 and len(list((tmp_path / 'media').iterdir())) >= 2
    assert not any(LONG_ANSWER.encode()[:2000] in r.value for r in log.records)
    for ref in await store.list_runs():
        ours = await projection.reader().get_run(ref.run_id)
        assert ours is not None and ours.registration_id == import_writer_id(ref.run_id, ref.started_at)
    assert {(await projection.reader().get_run(r.run_id)).status for r in await store.list_runs()} == {  # type: ignore[union-attr]
        'completed',
        'failed',
    }


def _reference_media(kind: str, tmp_path: Path) -> int:
    path = store_path(kind, tmp_path)
    if kind == 'file':
        return len(list((path / 'media').iterdir()))
    with sqlite3.connect(path) as conn:
        return int(conn.execute('SELECT count(*) FROM media').fetchone()[0])


def _signed(log: InMemoryLog) -> int:
    return sum(isinstance(r.record, StepEvent) and r.record.kind == 'chain_signed' for r in log.records)


@pytest.mark.parametrize('kind', KINDS)
async def test_a_second_import_writes_nothing(tmp_path: Path, kind: str) -> None:
    store = reference_store(kind, tmp_path)
    await make_runs(store)
    log, projection = _setup(tmp_path)
    first = await _import(log, projection, store_path(kind, tmp_path))
    written = len(log.records)

    again = await _import(log, projection, store_path(kind, tmp_path))

    assert len(log.records) == written
    assert (again.runs_read, again.records_read) == (first.runs_read, first.records_read)
    assert (again.records_written, again.runs_written, again.runs_already_imported) == (0, 0, first.runs_read)
    assert 'skipped 5 run(s) imported before' in again.text()


class Interrupted(InMemoryLog):
    """A log whose sends fail after `allowed` records: the import's process dying mid-way."""

    def __init__(self, allowed: int) -> None:
        super().__init__()
        self.allowed = allowed

    async def send(self, record: LogRecord, value: bytes) -> Any:
        if self.allowed <= 0:
            raise StepStreamError('the broker went away')
        self.allowed -= 1
        return await super().send(record, value)


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('allowed', [1, 9, 23])
async def test_an_interrupted_import_is_finished_by_the_next(tmp_path: Path, kind: str, allowed: int) -> None:
    store = reference_store(kind, tmp_path)
    await make_runs(store)
    log = Interrupted(allowed)
    projection = MemoryProjection(log, DiskMediaStore(tmp_path / 'media'))
    with pytest.raises(StepStreamError, match='went away'):
        await _import(log, projection, store_path(kind, tmp_path), concurrency=1)
    await projection.wait_for()
    assert len(log.records) == allowed

    log.allowed = 10**9
    report = await _import(log, projection, store_path(kind, tmp_path), concurrency=1)

    assert report.runs_finished == 1 and report.runs_written == 5 - 1 - report.runs_already_imported
    await assert_imported(store, projection.reader())
    assert projection.dead == [] and projection.duplicates_ignored == 0


async def test_a_run_on_the_log_from_another_writer_is_skipped_not_merged(tmp_path: Path) -> None:
    store = reference_store('sqlite', tmp_path)
    await make_runs(store)
    taken = (await store.list_runs())[0].run_id
    log, projection = _setup(tmp_path)
    from pydantic_ai import Agent
    from pydantic_ai.models.test import TestModel

    agent = Agent(
        TestModel(), capabilities=[StepPersistence(log=log, run_id=taken, media_store=projection.media_store)]
    )
    await agent.run('hello')
    await projection.wait_for()
    before = await projection.reader().get_run(taken)
    assert before is not None

    report = await _import(log, projection, store_path('sqlite', tmp_path))

    assert report.skipped == {taken: before.registration_id} and report.runs_written == 4
    assert f'{taken}: written by {before.registration_id}' in report.text()
    after = await projection.reader().get_run(taken)
    assert after == before and projection.dead == []


async def _first_runs(store: Any) -> tuple[str, str]:
    runs = await store.list_runs()
    return runs[0].run_id, runs[1].run_id


def _nothing_of(log: InMemoryLog, run_id: str) -> bool:
    return not any(r.record.run_id == run_id for r in log.records)


async def test_a_file_store_with_a_bad_line_names_the_run_and_the_line(tmp_path: Path) -> None:
    store = reference_store('file', tmp_path)
    await make_runs(store)
    first, second = await _first_runs(store)
    events = store_path('file', tmp_path) / second / 'events.jsonl'
    good = events.read_text()
    events.write_text(good + '{"run_id": "oops", \n')
    log, projection = _setup(tmp_path)

    with pytest.raises(DamagedStore) as caught:
        await _import(log, projection, store_path('file', tmp_path))

    message = str(caught.value)
    assert f'run {second!r}' in message and f'events.jsonl line {len(good.splitlines()) + 1}' in message
    assert caught.value.report.runs_written == 1  # type: ignore[attr-defined]
    assert _nothing_of(log, second) and not _nothing_of(log, first)
    await projection.wait_for()

    events.write_text(good)  # repaired: the next import finishes the store
    report = await _import(log, projection, store_path('file', tmp_path))
    assert report.runs_already_imported == 1 and report.runs_written == 4
    await assert_imported(store, projection.reader())


@pytest.mark.parametrize('kind', KINDS)
async def test_a_snapshot_whose_messages_do_not_validate_names_the_run_and_the_snapshot(
    tmp_path: Path, kind: str
) -> None:
    store = reference_store(kind, tmp_path)
    await make_runs(store)
    _, second = await _first_runs(store)
    path = store_path(kind, tmp_path)
    if kind == 'file':
        snapshot = path / second / 'snapshots' / '0.json'
        data = json.loads(snapshot.read_text())
        data['messages'][0]['kind'] = 'letter'
        snapshot.write_text(json.dumps(data))
        where = 'snapshots/0.json'
    else:
        with sqlite3.connect(path) as conn:
            (seq,) = conn.execute('SELECT min(seq) FROM snapshots WHERE run_id = ?', (second,)).fetchone()
            (sha,) = conn.execute(
                'SELECT sha256 FROM snapshot_message_refs WHERE snapshot_seq = ? AND position = 0', (seq,)
            ).fetchone()
            conn.execute(
                'UPDATE snapshot_messages SET message = ? WHERE sha256 = ?', ('{"kind": "letter"}', sha)
            )
        where = f'snapshots row seq={seq}'
    log, projection = _setup(tmp_path)

    with pytest.raises(DamagedStore, match='do not validate') as caught:
        await _import(log, projection, path)

    assert f'run {second!r}, {where}' in str(caught.value)
    assert _nothing_of(log, second)


async def test_a_truncated_sqlite_file_is_refused_naming_the_store(tmp_path: Path) -> None:
    store = reference_store('sqlite', tmp_path)
    await make_runs(store)
    path = store_path('sqlite', tmp_path)
    damaged = tmp_path / 'truncated.db'
    shutil.copy(path, damaged)
    with damaged.open('r+b') as f:
        f.truncate(damaged.stat().st_size // 3)
    log, projection = _setup(tmp_path)

    with pytest.raises(DamagedStore, match='SQLite cannot read it') as caught:
        await _import(log, projection, damaged)

    message = str(caught.value)
    assert str(damaged) in message
    # Whichever run the damage hit (if the schema survived) was not written, and none after it.
    named = [r.run_id for r in await store.list_runs() if f'run {r.run_id!r}' in message]
    assert all(_nothing_of(log, run_id) for run_id in named)


async def test_a_store_of_another_kind_is_refused(tmp_path: Path) -> None:
    other = tmp_path / 'other.db'
    with sqlite3.connect(other) as conn:
        conn.execute('CREATE TABLE notes (x)')
    with pytest.raises(DamagedStore, match='has no table runs, events, snapshots, tool_effects'):
        open_store(other)
    with pytest.raises(StepStreamError, match='no reference store'):
        open_store(tmp_path / 'missing')


async def test_a_sqlite_store_with_a_bad_row_names_the_run_and_the_row(tmp_path: Path) -> None:
    store = reference_store('sqlite', tmp_path)
    await make_runs(store)
    first, second = await _first_runs(store)
    path = store_path('sqlite', tmp_path)
    with sqlite3.connect(path) as conn:
        (seq,) = conn.execute('SELECT max(seq) FROM events WHERE run_id = ?', (second,)).fetchone()
        conn.execute("UPDATE events SET kind = 'run_paused' WHERE seq = ?", (seq,))
    log, projection = _setup(tmp_path)

    with pytest.raises(DamagedStore) as caught:
        await _import(log, projection, path)

    assert f"run {second!r}, events row seq={seq}: kind 'run_paused' is not one of" in str(caught.value)
    assert _nothing_of(log, second) and not _nothing_of(log, first)


async def test_a_run_the_log_refuses_is_named_and_nothing_of_it_is_written(tmp_path: Path) -> None:
    from pydantic_ai_harness.step_persistence import RunRecord, ToolEffectRecord

    store = reference_store('sqlite', tmp_path)
    await make_runs(store)
    started = (await store.list_runs())[-1].started_at
    await store.register_run(RunRecord(run_id='zz-long-call', agent_name='ok', started_at=started))
    await store.record_tool_effect(
        ToolEffectRecord(tool_call_id='c' * 2000, tool_name='t', run_id='zz-long-call', status='started')
    )
    log, projection = _setup(tmp_path)

    with pytest.raises(DamagedStore, match='the log refuses it') as caught:
        await _import(log, projection, store_path('sqlite', tmp_path))

    assert "run 'zz-long-call', tool_effects row" in str(caught.value)
    assert _nothing_of(log, 'zz-long-call') and caught.value.report.runs_written == 5  # type: ignore[attr-defined]


async def test_runs_the_retention_policy_dropped_are_not_written_again(tmp_path: Path) -> None:
    from datetime import timedelta

    from pydantic_ai_harness.step_persistence import RunRecord
    from pydantic_ai_harness.step_persistence import StepEvent as ReferenceEvent

    from stepstream.projector._apply import Applier

    store = reference_store('sqlite', tmp_path)
    await make_runs(store)
    later = (await store.list_runs())[-1].started_at + timedelta(days=10)
    await store.register_run(RunRecord(run_id='later', started_at=later))
    for kind in ('run_started', 'run_completed'):
        await store.append_event(ReferenceEvent(run_id='later', kind=kind, step_index=0, timestamp=later))
    log, projection = _setup(tmp_path, Settings(partitions=1))  # type: ignore[call-arg]  # one clock
    topics = (log.settings.topics.step_events_topic, log.settings.topics.tool_effects_topic)
    projection.applier = Applier(
        topics, partitions=log.settings.topics.partitions, retain_ended_us=86_400_000_000
    )
    first = await _import(log, projection, store_path('sqlite', tmp_path))
    reader = projection.reader()
    assert first.runs_written == 6 and [r.run_id for r in await reader.list_runs()] == ['later']
    written = len(log.records)

    again = await _import(log, projection, store_path('sqlite', tmp_path))

    assert (again.runs_expired, again.runs_already_imported, len(log.records)) == (5, 1, written)
    assert '5 run(s) the retention policy dropped' in again.text()


async def test_a_postgres_store_without_asyncpg_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from stepstream.importer import is_dsn, open_postgres
    from stepstream.importer._postgres import shown

    monkeypatch.setitem(sys.modules, 'asyncpg', None)  # as if it were not installed
    assert is_dsn('postgresql://app@db:5432/agents') and is_dsn('postgres://db/agents')
    assert not is_dsn('agents.db') and not is_dsn(Path('postgresql:'))
    # How messages and the report name it: never with the password or the options.
    assert shown('postgresql://app:secret@db:5432/agents?password=x') == 'postgresql://app@db:5432/agents'
    with pytest.raises(StepStreamError, match=r'needs asyncpg: pip install "stepstream\[import-postgres\]"'):
        await open_postgres('postgresql://app:secret@db:5432/agents')
