"""docs/analytics.md's DuckDB queries, each run on a Parquet export of real agent runs and its answer checked.

The runs: an orchestrator (gpt-4o) delegates to a researcher (gpt-4o-mini), which searches, calls a
flaky tool that asks for a retry once, and delegates to a fetcher on a model with no known price; a
publisher (gpt-4o) is cancelled inside its tool, leaving an effect unknown. Pydantic AI prices the
gpt-4o responses itself (genai-prices), as it would a real provider's.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import defaultdict
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.dataset as ds
import pytest
from aiokafka.structs import TopicPartition
from pydantic_ai import Agent, ModelRetry, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage
from test_cli import cli

from stepstream import Settings
from stepstream.analytics import export_filesystem
from stepstream.producer import EventLog, StepPersistence, annotate_tool_effect
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader, continue_run
from stepstream.topics import log_end_offsets, murmur2_partition

pytestmark = pytest.mark.broker

DOC = Path(__file__).parent.parent / 'docs' / 'analytics.md'


def queries() -> dict[str, str]:
    """The doc's SQL blocks, by the name in their `-- query:` line."""
    blocks = re.findall(r'```sql\n-- query: (\w+)\n(.*?)```', DOC.read_text(), flags=re.S)
    return dict(blocks)


def scripted(model_name: str, provider: str | None, turns: list[str]) -> FunctionModel:
    """A model that calls the tool named by each turn in order, then answers."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = sum(isinstance(m, ModelResponse) for m in messages)
        usage = RequestUsage(input_tokens=800 + 10 * turn, output_tokens=40 + turn, cache_read_tokens=100)
        if turn < len(turns):
            call = ToolCallPart(turns[turn], {}, tool_call_id=f'{turns[turn]}-{turn}')
            return ModelResponse(parts=[call], usage=usage, provider_name=provider, finish_reason='tool_call')
        return ModelResponse(parts=[TextPart(f'{model_name} done')], usage=usage, provider_name=provider)

    return FunctionModel(model, model_name=model_name)


async def write_runs(log: EventLog) -> dict[str, Any]:
    """The runs the queries answer about; returns what the test expects of them."""
    responses: dict[str, list[ModelResponse]] = defaultdict(list)

    def persisted(name: str, model: FunctionModel) -> Agent[None, str]:
        return Agent(model, capabilities=[StepPersistence(log=log, agent_name=name)])

    fetcher = persisted('fetcher', scripted('local-llama', None, []))
    researcher = persisted(
        'researcher', scripted('gpt-4o-mini', 'openai', ['search', 'flaky', 'flaky', 'fetch'])
    )
    orchestrator = persisted('orchestrator', scripted('gpt-4o', 'openai', ['research']))
    publisher = persisted('publisher', scripted('gpt-4o', 'openai', ['publish']))
    flaky_calls = 0

    @researcher.tool_plain
    def search() -> str:
        return 'three sources'

    @researcher.tool_plain
    def flaky() -> str:
        nonlocal flaky_calls
        flaky_calls += 1
        if flaky_calls == 1:
            raise ModelRetry('rate limited, try again')
        return 'ok'

    @researcher.tool_plain
    async def fetch() -> str:
        result = await fetcher.run('fetch the page about tides')
        responses['fetcher'] += [m for m in result.all_messages() if isinstance(m, ModelResponse)]
        return result.output

    @orchestrator.tool_plain
    async def research() -> str:
        result = await researcher.run('research tides')
        responses['researcher'] += [m for m in result.all_messages() if isinstance(m, ModelResponse)]
        return result.output

    entered = asyncio.Event()

    @publisher.tool
    async def publish(ctx: RunContext[None]) -> str:
        await annotate_tool_effect(ctx, idempotency_key='post:tides', effect_summary='posts the article')
        entered.set()
        await asyncio.Event().wait()  # cancelled here: the post may or may not have gone out
        return 'never'

    result = await orchestrator.run('write about tides', conversation_id='conv-tides')
    responses['orchestrator'] += [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    task = asyncio.create_task(publisher.run('publish it', conversation_id='conv-tides'))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return {
        'cost': {
            name: sum((r.usage.cost or Decimal(0) for r in rs), Decimal(0)) for name, rs in responses.items()
        },
        'requests': {name: len(rs) for name, rs in responses.items()},
    }


def quantile_cont(values: list[int], q: float) -> float:
    """DuckDB's `quantile_cont`: linear interpolation between the closest ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def test_every_query_in_analytics_md_answers_on_a_real_export(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path, tmp_path: Path
) -> None:
    expected = await write_runs(event_log)
    await projector.wait_for(await event_log.flush())
    reader = ProjectionReader.of(projector)
    runs = {r.agent_name: r for r in await reader.list_runs()}
    assert set(runs) == {'orchestrator', 'researcher', 'fetcher', 'publisher'}

    out = tmp_path / 'analytics'
    code, stdout, stderr = await cli(settings, db_path, 'export', '--format', 'parquet', '--out', str(out))
    assert code == 0, stderr
    assert 'exported 4 runs' in stdout
    assert {p.name for p in (out / 'runs').iterdir()} == {f'date={runs["orchestrator"].started_at:%Y-%m-%d}'}

    sql = queries()
    assert set(sql) == {
        'views',
        'cost_per_agent_per_day',
        'p95_latency_by_model',
        'tool_failure_rate',
        'unknown_effects',
        'delegation_depth',
        'conversation_text',
        'who_decided',
    }
    db = duckdb.connect()
    db.execute(sql['views'].replace("'analytics/", f"'{out}/"))

    def rows(name: str, **params: object) -> list[dict[str, Any]]:
        cursor = db.execute(sql[name], params or None)
        columns = [c[0] for c in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]

    # Cost per agent per day: Pydantic AI's own prices, summed exactly; the fetcher's model has none.
    cost: dict[str, Decimal | None] = defaultdict(Decimal)
    requests: dict[str, int] = defaultdict(int)
    for row in rows('cost_per_agent_per_day'):
        requests[row['agent_name']] += row['requests']
        if row['cost_usd'] is None:
            cost[row['agent_name']] = None
            assert row['unpriced'] == row['requests']
        else:
            cost[row['agent_name']] += row['cost_usd']  # type: ignore[operator]
    for name in ('orchestrator', 'researcher'):
        assert cost[name] == expected['cost'][name] > 0
        assert requests[name] == expected['requests'][name]
    assert cost['fetcher'] is None and requests['fetcher'] == 1
    assert cost['publisher'] == Decimal(
        runs['publisher'].usage.cost_usd or 'NaN'
    )  # the cancelled run's one request

    # p95 latency by model: what the events' durations give.
    durations: dict[str, list[int]] = defaultdict(list)
    for run in runs.values():
        for event in await reader.list_events(run.run_id):
            if event.kind == 'model_request_completed':
                assert event.usage is not None and event.duration_us is not None
                durations[event.usage.model_name or ''].append(event.duration_us)
    latency = {row['model_name']: row for row in rows('p95_latency_by_model')}
    assert set(latency) == {'gpt-4o', 'gpt-4o-mini', 'local-llama'}
    for model, values in durations.items():
        assert latency[model]['requests'] == len(values)
        assert float(latency[model]['p95_ms']) == pytest.approx(quantile_cont(values, 0.95) / 1000, abs=0.001)

    # Tool failure rate: the retry is a failure; the publisher's open call is not counted.
    rates = {
        row['tool_name']: (row['calls'], row['failures'], float(row['failure_rate']))
        for row in rows('tool_failure_rate')
    }
    assert rates == {
        'flaky': (2, 1, 0.5),
        'search': (1, 0, 0.0),
        'fetch': (1, 0, 0.0),
        'research': (1, 0, 0.0),
    }

    # Runs left with unknown effects: the cancelled publisher's post, with its annotation.
    [unknown] = rows('unknown_effects')
    assert unknown['run_id'] == runs['publisher'].run_id and unknown['run_status'] == 'cancelled'
    assert (unknown['tool_name'], unknown['idempotency_key']) == ('publish', 'post:tides')

    # Delegation depth: orchestrator -> researcher -> fetcher; the publisher alone.
    depth = {row['root_run_id']: row for row in rows('delegation_depth')}
    orchestrator, publisher = runs['orchestrator'].run_id, runs['publisher'].run_id
    assert set(depth) == {orchestrator, publisher}
    assert (depth[orchestrator]['max_depth'], depth[orchestrator]['descendants']) == (2, 2)
    assert (
        depth[orchestrator]['tree_cost_usd']
        == expected['cost']['orchestrator'] + expected['cost']['researcher']
    )
    assert (depth[publisher]['max_depth'], depth[publisher]['descendants']) == (0, 0)

    # A conversation read back from the messages table, replayed from the log's deltas.
    conversation = rows('conversation_text', run_id=runs['fetcher'].run_id)
    assert [r['kind'] for r in conversation] == ['request', 'response']
    assert 'fetch the page about tides' in conversation[0]['contents']
    assert conversation[1]['contents'] == ['local-llama done']

    # Nothing was resolved or decided yet: the table is there, empty.
    assert rows('who_decided') == []

    # An operator answers the unknown effect; the next export says so and the query no longer lists it.
    code, _, stderr = await cli(
        settings,
        db_path,
        'resolve',
        unknown['run_id'],
        unknown['tool_call_id'],
        '--did-not-happen',
        '--note',
        'not on the blog',
    )
    assert code == 0, stderr
    home = murmur2_partition(unknown['run_id'].encode(), settings.topics.partitions)
    ends = await log_end_offsets(settings.kafka, {(settings.topics.tool_effects_topic, home): 0})
    await projector.wait_for(
        {TopicPartition(topic, partition): end for (topic, partition), end in ends.items()}
    )
    code, _, stderr = await cli(settings, db_path, 'export', '--out', str(out))
    assert code == 0, stderr
    assert rows('unknown_effects') == []
    resolved = db.execute("SELECT resolution, resolution_note FROM tool_effects WHERE tool_name = 'publish'")
    assert resolved.fetchall() == [('did_not_happen', 'not on the blog')]
    # The resolution is a row of `resolutions` too, as the call's ledger keeps it.
    effect = await reader.get_tool_effect(unknown['run_id'], unknown['tool_call_id'])
    assert effect is not None and effect.resolution is not None
    [entry] = rows('who_decided')
    assert (entry['resolved_by'], entry['resolution'], entry['answers'], entry['history_only']) == (
        effect.resolution.resolved_by,
        'did_not_happen',
        1,
        0,
    )
    assert entry['first_at'] == entry['last_at'] == effect.resolution.resolved_at
    ledger = db.execute(
        'SELECT run_id, agent_name, tool_call_id, tool_name, resolves_seq, note, writer_id, applied, '
        'args, result, error FROM resolutions'
    )
    assert ledger.fetchall() == [
        (
            unknown['run_id'],
            'publisher',
            unknown['tool_call_id'],
            'publish',
            effect.resolution.resolves_seq,
            'not on the blog',
            effect.resolution.writer_id,
            True,
            None,
            None,
            None,
        )
    ]


async def test_the_export_goes_to_s3_with_hive_paths_and_reads_the_topics_too(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path, tmp_path: Path
) -> None:
    await write_runs(event_log)
    await projector.wait_for(await event_log.flush())
    target = f's3://{settings.media.s3_bucket}/exports/{settings.topics.topic_prefix}'
    code, from_projection, stderr = await cli(settings, db_path, 'export', '--out', target)
    assert code == 0, stderr
    fs, base = export_filesystem(target, settings)
    runs = ds.dataset(f'{base}/runs', filesystem=fs, format='parquet', partitioning='hive').to_table()
    assert sorted(runs.column('agent_name').to_pylist()) == [
        'fetcher',
        'orchestrator',
        'publisher',
        'researcher',
    ]
    assert {str(d) for d in runs.column('date').to_pylist()} == {
        (await ProjectionReader.of(projector).list_runs())[0].started_at.strftime('%Y-%m-%d')  # type: ignore[union-attr]
    }
    requests = ds.dataset(f'{base}/model_requests', filesystem=fs, format='parquet', partitioning='hive')
    assert requests.count_rows() == 2 + 5 + 1 + 1  # orchestrator, researcher, fetcher, publisher

    # Since itself, into itself: the mark is read from the bucket, nothing changed, nothing is added.
    events = ds.dataset(f'{base}/events', filesystem=fs, format='parquet').count_rows()
    assert f'{events} events' in from_projection
    code, since, stderr = await cli(settings, db_path, 'export', '--out', target, '--since', target)
    assert code == 0, stderr
    assert 'exported 0 runs, 0 events, 0 model_requests, 0 tool_effects, 0 resolutions, 0 messages' in since
    assert ds.dataset(f'{base}/events', filesystem=fs, format='parquet').count_rows() == events

    # Straight from the topics (no projection at --db-path): the same rows.
    elsewhere = tmp_path / 'no-projection-here'
    elsewhere.mkdir()
    code, from_topics, stderr = await cli(
        settings, elsewhere / 'projection', 'export', '--from-topics', '--out', str(tmp_path / 'from-topics')
    )
    assert code == 0, stderr
    assert from_topics.replace(str(tmp_path / 'from-topics'), 'X') == from_projection.replace(target, 'X')
    assert not (elsewhere / 'projection').exists()


def views(db: duckdb.DuckDBPyConnection, glob: str) -> None:
    """The doc's views over the exports `glob` names (one export's directory, or several by a pattern)."""
    db.execute(queries()['views'].replace("'analytics/", f"'{glob}/"))


def table(db: duckdb.DuckDBPyConnection, name: str, key: str) -> list[tuple[Any, ...]]:
    """A view's rows without `export_seq` (which says which export wrote a row, not what it holds)."""
    cursor = db.execute(f'SELECT * FROM {name} ORDER BY {key}')
    columns = [c[0] for c in cursor.description]
    keep = [i for i, c in enumerate(columns) if c != 'export_seq']
    return [tuple(row[i] for i in keep) for row in cursor.fetchall()]


def answers(db: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every query of the doc, answered over the views in `db`."""
    return {
        name: db.execute(sql, {'run_id': run_id} if '$run_id' in sql else None).fetchall()
        for name, sql in queries().items()
        if name != 'views'
    }


KEYS = {
    'runs': 'run_id',
    'events': 'run_id, seq',
    'model_requests': 'run_id, seq',
    'tool_effects': 'run_id, tool_call_id',
    'resolutions': 'run_id, tool_call_id, resolved_at',
    'messages': 'run_id, message_index',
}


async def test_an_export_since_an_earlier_one_adds_each_event_once_and_each_runs_newest_state(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path, tmp_path: Path
) -> None:
    await write_runs(event_log)
    # A run still going when the first export is made: it finishes after, so its state rows change.
    go, entered = asyncio.Event(), asyncio.Event()
    editor = Agent(
        scripted('gpt-4o', 'openai', ['review']),
        capabilities=[StepPersistence(log=event_log, agent_name='editor')],
    )

    @editor.tool_plain
    async def review() -> str:
        entered.set()
        await go.wait()
        return 'approved'

    editing = asyncio.create_task(editor.run('review the tides article', conversation_id='conv-edit'))
    await entered.wait()
    await projector.wait_for(await event_log.flush())
    reader = ProjectionReader.of(projector)
    [running] = await reader.list_runs(agent_name='editor')
    assert running.status == 'running'

    exports = tmp_path / 'exports'
    exports.mkdir()  # an export's folder is made in one that exists (a typo in its path is refused)
    base, later = exports / '0-base', exports / '1-since'
    code, stdout, stderr = await cli(settings, db_path, 'export', '--out', str(base))
    assert code == 0, stderr
    # A second base: the later export is appended into its directory rather than written beside it.
    appended = tmp_path / 'appended'
    code, _, stderr = await cli(settings, db_path, 'export', '--out', str(appended))
    assert code == 0, stderr

    # After it: the editor finishes, a follow-up run continues its history, the publisher's unknown
    # effect is resolved by an operator (a state change with no new step event), a new run starts.
    go.set()
    await editing
    await projector.wait_for(await event_log.flush())
    history = await continue_run(reader, run_id=running.run_id)
    await editor.run('one more pass', message_history=history, conversation_id='conv-edit')
    await write_runs(event_log)
    await projector.wait_for(await event_log.flush())
    [publisher, *_] = await reader.list_runs(agent_name='publisher')
    [effect] = await reader.list_unresolved_tool_effects(publisher.run_id)
    code, _, stderr = await cli(
        settings,
        db_path,
        'resolve',
        publisher.run_id,
        effect.tool_call_id,
        '--happened',
        '--note',
        'it went out',
    )
    assert code == 0, stderr
    home = murmur2_partition(publisher.run_id.encode(), settings.topics.partitions)
    ends = await log_end_offsets(settings.kafka, {(settings.topics.tool_effects_topic, home): 0})
    await projector.wait_for({TopicPartition(t, p): end for (t, p), end in ends.items()})
    assert (await reader.get_tool_effect(publisher.run_id, effect.tool_call_id)).status == 'resolved'  # type: ignore[union-attr]

    code, stdout, stderr = await cli(settings, db_path, 'export', '--out', str(later), '--since', str(base))
    assert code == 0, stderr
    assert f'(export 1, since {base})' in stdout
    # What an export that failed half-way into the same directory left there (no mark names it).
    written = next((appended / 'events').glob('*/part-*.parquet'))
    stray = written.with_name('part-0badc0ffee00-0-0.parquet')
    stray.write_bytes(written.read_bytes())
    mark = str(appended / '_stepstream_export.json')
    code, _, stderr = await cli(settings, db_path, 'export', '--out', str(appended), '--since', mark)
    assert code == 0, stderr
    assert not stray.exists()
    fresh = tmp_path / 'fresh'
    code, _, stderr = await cli(settings, db_path, 'export', '--out', str(fresh))
    assert code == 0, stderr

    everything = await reader.list_runs()
    assert len(everything) == 4 + 2 + 4  # the first four, the editor's two, the second four
    in_base = {row[0] for row in duckdb.sql(f"SELECT run_id FROM '{base}/runs/**/*.parquet'").fetchall()}
    changed = {r.run_id for r in everything} - in_base | {running.run_id, publisher.run_id}
    assert len(changed) == 2 + 1 + 4  # the editor's two runs, the resolved publisher, the new four
    incremental = duckdb.connect()
    # Only what changed is in the later export: its runs rows are the changed runs, once each.
    later_runs = incremental.execute(f"SELECT run_id, export_seq FROM '{later}/runs/**/*.parquet'").fetchall()
    assert sorted(later_runs) == sorted((run_id, 1) for run_id in changed)

    for glob in (f'{exports}/*', str(appended)):
        db, full = duckdb.connect(), duckdb.connect()
        views(db, glob)
        views(full, str(fresh))
        # Each event once: the base and the later export never both hold one.
        raw = db.execute(
            f"SELECT run_id, seq, count(*) FROM read_parquet('{glob}/events/**/*.parquet') "
            'GROUP BY ALL HAVING count(*) > 1'
        ).fetchall()
        assert raw == []
        # The editor's first run has two runs rows (running, then completed); the view keeps the newest.
        versions = db.execute(
            f"SELECT status, export_seq FROM read_parquet('{glob}/runs/**/*.parquet') "
            f"WHERE run_id = '{running.run_id}' ORDER BY export_seq"
        ).fetchall()
        assert versions == [('running', 0), ('completed', 1)]
        for name, key in KEYS.items():
            assert table(db, name, key) == table(full, name, key), name
        assert db.execute('SELECT count(*) FROM runs').fetchone() == (len(everything),)
        assert answers(db, running.run_id) == answers(full, running.run_id)
        assert [
            row[0]
            for row in db.execute(
                'SELECT status FROM tool_effects WHERE run_id = $r', {'r': publisher.run_id}
            ).fetchall()
        ] == ['resolved']

    # Nothing changed since: an export since the later one writes no rows at all.
    code, stdout, stderr = await cli(
        settings, db_path, 'export', '--out', str(exports / '2-since'), '--since', str(later)
    )
    assert code == 0, stderr
    assert 'exported 0 runs, 0 events, 0 model_requests, 0 tool_effects, 0 resolutions, 0 messages' in stdout
    code, stdout, stderr = await cli(
        settings,
        db_path,
        'export',
        '--from-topics',
        '--out',
        str(exports / '3-topics'),
        '--since',
        str(later),
    )
    assert code == 0, stderr
    assert 'exported 0 runs, 0 events, 0 model_requests, 0 tool_effects, 0 resolutions, 0 messages' in stdout


async def test_an_export_since_a_mark_that_is_not_one_of_this_log_exits_2(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path, tmp_path: Path
) -> None:
    await write_runs(event_log)
    await projector.wait_for(await event_log.flush())
    base = tmp_path / 'base'
    code, _, stderr = await cli(settings, db_path, 'export', '--out', str(base))
    assert code == 0, stderr
    manifest = base / '_stepstream_export.json'
    original = json.loads(manifest.read_text())

    async def since(mark: Path, expected: str) -> None:
        code, stdout, stderr = await cli(
            settings, db_path, 'export', '--out', str(tmp_path / 'next'), '--since', str(mark)
        )
        assert code == 2, (stdout, stderr)
        assert expected in stderr, stderr
        assert not (tmp_path / 'next').exists()  # refused before anything was written

    # Not an export at all, or an export with no mark.
    await since(tmp_path / 'nowhere', 'no _stepstream_export.json')
    elsewhere = tmp_path / 'old' / '_stepstream_export.json'
    elsewhere.parent.mkdir()
    elsewhere.write_text(json.dumps({k: v for k, v in original.items() if k != 'mark'}))
    await since(elsewhere, 'holds no export mark')
    # Another log's export: another topic prefix.
    elsewhere.write_text(json.dumps({**original, 'mark': {**original['mark'], 'topic_prefix': 'other'}}))
    await since(elsewhere, "of topic prefix 'other'")
    # Or a mark past what this projection applied (a log with more in it).
    ahead = {tp: offset + 1000 for tp, offset in original['mark']['offsets'].items()}
    elsewhere.write_text(json.dumps({**original, 'mark': {**original['mark'], 'offsets': ahead}}))
    await since(elsewhere, 'had applied more of')
