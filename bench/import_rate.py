"""The importer's rate: runs and records per second, against reading the reference store alone.

    .venv/bin/python -m bench.import_rate [RUNS] [--stack]

Makes a pydantic-ai-harness `SqliteStepStore` of RUNS runs (default 10,000), each a copy of one
run its `StepPersistence` recorded of a real agent (`FunctionModel`: a tool call, its answer; two
snapshots, the ledger's `started` and `completed`), written through the store's own methods in one
transaction. Then, on that file:

- **read**: every run read and checked as the importer reads it (`open_store`, `read_run`: the
  rows, each snapshot's history rebuilt from its stored messages and validated);
- **import, in memory**: `import_store` into an `InMemoryLog` (the records built, redacted,
  chained, encoded and kept: the importer's own cost, no broker);
- **import, stack** (`--stack`): the same into the embedded stack's broker, as `stepstream import`
  does (each run acknowledged at its end, 16 runs at a time).

The reference records a run as 12 records of its own (a run record, 8 events, 2 snapshots, one
ledger row); stepstream writes it as 12 records (the events, 2 `snapshot_saved` and the ledger's 2
transitions). Rates are wall time, on whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sqlite3
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai_harness.step_persistence import InMemoryStepStore, SqliteStepStore, StepPersistence

from bench.common import fresh_topics, say
from stepstream.importer import import_store, open_store
from stepstream.media import DiskMediaStore
from stepstream.producer import InMemoryLog


def _model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    if any(isinstance(p, ToolReturnPart) for m in messages for p in getattr(m, 'parts', ())):
        return ModelResponse(parts=[TextPart('order 7 ships on Monday')])
    return ModelResponse(parts=[ToolCallPart('lookup', {'order': 7}, tool_call_id='call-1')])


async def template() -> tuple[Any, list[Any], list[Any], list[Any]]:
    """One run as the reference's capability records it: run record, events, snapshots, ledger."""
    store = InMemoryStepStore()
    agent = Agent(FunctionModel(_model), capabilities=[StepPersistence(store=store, agent_name='support')])

    @agent.tool_plain
    def lookup(order: int) -> str:
        return f'order {order}: packed'

    await agent.run('where is order 7?', conversation_id='conv-0')
    (run,) = await store.list_runs()
    events = await store.list_events(run_id=run.run_id)
    snapshots = await store.list_snapshots(run_id=run.run_id, include_interrupted=True)
    effects = [e for e in store._tool_effects.values() if e.run_id == run.run_id]
    return run, events, snapshots, effects


async def make_store(path: Path, runs: int) -> int:
    """A SQLite reference store of `runs` copies of the template run; how many records it holds."""
    run, events, snapshots, effects = await template()
    conn = sqlite3.connect(path, check_same_thread=False)
    store = SqliteStepStore(connection=conn)
    for i in range(runs):
        shift = timedelta(milliseconds=i)
        run_id = f'bench-{i:06d}'

        def moved(record: Any, *times: str, run_id: str = run_id, shift: timedelta = shift) -> Any:
            changes = {n: getattr(record, n) + shift for n in times if getattr(record, n) is not None}
            return dataclasses.replace(record, run_id=run_id, **changes)

        await store.register_run(moved(run, 'started_at'))
        for event in events:
            await store.append_event(moved(event, 'timestamp'))
        for snapshot in snapshots:
            await store.save_snapshot(moved(snapshot, 'timestamp'))
        for effect in effects:
            await store.record_tool_effect(moved(effect, 'started_at', 'ended_at'))
    conn.commit()
    conn.close()
    return runs * (1 + len(events) + len(snapshots) + len(effects))


async def read_all(path: Path) -> tuple[int, int]:
    """Every run read and checked as the importer reads it; (runs, records)."""
    store = open_store(path)
    runs = records = 0
    try:
        for run_id in store.run_ids():
            run = await store.read_run(run_id)
            runs += 1
            records += run.records
    finally:
        store.close()
    return runs, records


async def import_into(path: Path, log: Any, media: Any) -> tuple[int, int]:
    """`import_store` of the whole store into `log` (no projection: every run is new); (runs, records)."""
    store = open_store(path)
    try:
        report = await import_store(store, log, None, media_store=media)
    finally:
        store.close()
    return report.runs_written, report.records_written


async def timed(what: str, work: Any) -> dict[str, Any]:
    started = time.perf_counter()
    runs, records = await work
    seconds = time.perf_counter() - started
    say(f'{what}: {runs:,} runs, {records:,} records in {seconds:.1f} s')
    return {'what': what, 'runs': runs, 'records': records, 'seconds': seconds}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('runs', nargs='?', type=int, default=10_000)
    parser.add_argument('--stack', action='store_true', help="also import into the embedded stack's broker")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / 'reference.db'
        say(f'making a reference SQLite store of {args.runs:,} runs ...')
        started = time.perf_counter()
        stored = await make_store(path, args.runs)
        size = path.stat().st_size / 1e6
        say(f'{stored:,} records, {size:.1f} MB, in {time.perf_counter() - started:.1f} s')
        rows = [await timed('read', read_all(path))]
        media = DiskMediaStore(Path(tmp) / 'media')
        rows.append(await timed('import, in memory', import_into(path, InMemoryLog(), media)))
        if args.stack:
            from stepstream.embedded import EmbeddedStack
            from stepstream.media import S3MediaStore
            from stepstream.producer import EventLog

            async with EmbeddedStack() as stack:
                settings = await fresh_topics(stack.settings, 'import')
                async with EventLog(settings) as log:
                    media = S3MediaStore.from_settings(settings.media)
                    rows.append(await timed(f'import, stack ({stack.broker})', import_into(path, log, media)))
    print(f'| {args.runs:,} runs | runs/s | records/s | seconds | vs read |')
    print('| --- | --- | --- | --- | --- |')
    for row in rows:
        rate = row['runs'] / row['seconds']
        print(
            f'| {row["what"]} | {rate:,.0f} | {row["records"] / row["seconds"]:,.0f} | {row["seconds"]:.1f} '
            f'| {rows[0]["seconds"] / row["seconds"]:.2f} |'
        )


if __name__ == '__main__':
    asyncio.run(main())
