"""What each command's help says of its output, held against the output (issue 51).

Each claim is a phrase of the help (`stepstream COMMAND --help`, read from the parser) and what it
promises: columns, lines, files or an order. The output comes from the functions the commands
print (the views' `show`, `status_text`, `retention_text`, `export_parquet`) over an in-memory
projection of real runs: one waiting on three deferred calls (two decided), one cancelled in its
tool (a call in doubt), one completed later. A help text changed without its claim here fails the
first test; an output that drops what its help promises fails the others.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from pydantic_ai import Agent
from pydantic_ai.models.test import TestModel
from test_timeline import _cancelled_in_its_tool

from stepstream.analytics import export_parquet
from stepstream.cli._main import _parser
from stepstream.console import ViewArgs, retention_text, show, status_text
from stepstream.errors import StepStreamUnavailable
from stepstream.producer import InMemoryLog, StepPersistence, decision_for, resolver_id
from stepstream.readmodel import ProjectionReader
from stepstream.settings import Settings
from stepstream.storage import retention_state
from stepstream.topics import ensure_topics

from deferred_runs import run_until_waiting
from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast


def help_of(command: str) -> str:
    """The description `stepstream COMMAND --help` prints (`audit verify`: a nested one)."""
    parser = _parser()
    for word in command.split():
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[word]
    return ' '.join((parser.description or '').split())


def header(text: str) -> list[str]:
    """A table's column names: its first line, split on the runs of two spaces or more."""
    first = text.splitlines()[0]
    return [name.strip() for name in first.split('  ') if name.strip()]


def rows(text: str) -> list[list[str]]:
    """A table's rows (after the header and its rule), split as `header` splits."""
    return [[c.strip() for c in line.split('  ') if c.strip()] for line in text.splitlines()[2:] if line]


@dataclass
class Projection:
    reader: ProjectionReader
    memory: MemoryProjection
    settings: Settings


@pytest.fixture
async def projection() -> Projection:
    log = InMemoryLog()
    memory = MemoryProjection(log)
    await run_until_waiting(log, 'claims-waiting')
    await _cancelled_in_its_tool(log, 'claims-cancelled')
    agent = Agent(TestModel(), capabilities=[StepPersistence(log=log, agent_name='helper')])
    await agent.run('help', conversation_id='claims-later')
    await memory.wait_for()
    reader = memory.reader()
    refund = await reader.get_tool_effect('claims-waiting', 'call-refund')
    assert refund is not None
    writer = resolver_id('claims')
    first = decision_for(refund, decision='approved', operator='alice', writer_id=writer, note='fine')
    second = decision_for(refund, decision='denied', operator='bob', writer_id=writer, message='late')
    await log.wait_acked([await log.append(first), await log.append(second)])
    await memory.wait_for()
    return Projection(reader, memory, log.settings)


async def view(p: Projection, name: str, **args: object) -> str:
    return await show(name, ViewArgs(**args), p.reader, p.settings)  # type: ignore[arg-type]


def times(column: list[str]) -> list[datetime]:
    return [datetime.fromisoformat(t) for t in column]


async def _runs(p: Projection, out: Path) -> None:
    text = await view(p, 'runs', wide=True)  # (the times whole, to compare)
    found = rows(text)
    started = times([r[header(text).index('started')] for r in found])
    assert len(found) == 3 and started == sorted(started, reverse=True)


async def _events(p: Projection, out: Path) -> None:
    text = await view(p, 'events', run_id='claims-waiting')
    seqs = [int(r[0]) for r in rows(text) if r[0].isdigit()]
    assert seqs and seqs == sorted(seqs)


async def _effects(p: Projection, out: Path) -> None:
    text = await view(p, 'effects', run_id='claims-waiting')
    assert 'status' in header(text)
    calls = {r[0]: r[2] for r in rows(text) if r[0].startswith('call-') and ':' not in r[0]}
    assert set(calls) == {'call-refund', 'call-ask', 'call-export', 'call-lookup'}
    assert calls['call-lookup'] == 'completed'
    decided = [line for line in text.splitlines() if line.startswith('call-refund: resolved')]
    assert [line.split()[2:5] for line in decided] == [['approved', 'by', 'alice'], ['denied', 'by', 'bob']]


async def _unresolved(p: Projection, out: Path) -> None:
    text = await view(p, 'unresolved')
    assert {'run_status', 'status'} <= set(header(text))
    found = rows(text)
    status = header(text).index('status')
    assert [(r[0], r[1], r[status]) for r in found] == [
        ('claims-cancelled', 'cancelled', 'unknown_after_crash')
    ]
    assert 'claims-waiting' not in text  # its deferred calls wait: not in doubt


async def _deferred(p: Projection, out: Path) -> None:
    columns = header(await view(p, 'deferred'))
    assert columns[:5] == ['run_id', 'tool_call_id', 'tool', 'kind', 'agent']
    assert {'waited', 'args'} <= set(columns)  # how long, the arguments
    text = await view(p, 'deferred', wide=True)
    columns = header(text)
    assert {'conversation', 'since'} <= set(columns)
    since = times([r[columns.index('since')] for r in rows(text)])
    assert len(since) == 2 and since == sorted(since)  # the refund is decided: the question and the export


async def _conversations(p: Projection, out: Path) -> None:
    columns = header(await view(p, 'conversations'))
    assert columns[1:7] == ['runs', 'last status', 'live', 'latest run', 'active', 'title']
    text = await view(p, 'conversations', wide=True)
    columns = header(text)
    assert {'writer', 'tokens', 'cost'} <= set(columns)
    active = times([line[columns.index('active')] for line in _aligned(text, 'active')])
    assert len(active) == 3 and active == sorted(active, reverse=True)


def _aligned(text: str, column: str) -> list[list[str]]:
    """Rows cut at the columns' starting positions (a table with empty cells, such as `live`)."""
    lines = text.splitlines()
    names = header(text)
    starts = [lines[0].index(name) for name in names]
    cut = [
        [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)] for line in lines[2:]
    ]
    return [row for row in cut if row[names.index(column)]]


async def _conflicts(p: Projection, out: Path) -> None:
    assert header(await view(p, 'conflicts')) == ['run_id', 'registered_by', 'conflicting_writers']


async def _status(p: Projection, out: Path) -> None:
    topics = (p.settings.topics.step_events_topic, p.settings.topics.tool_effects_topic)
    applied = {(topic, partition): 5 for topic in topics for partition in range(2)}
    ends = {tp: 5 + tp[1] for tp in applied}
    text = status_text(await p.reader.status(), applied, ends, p.settings)
    table = text.split('\n\n')[0]
    assert {'partition', 'lag'} <= set(header(table))
    assert [int(r[header(table).index('lag')]) for r in rows(table)] == [0, 1, 0, 1]  # per partition
    assert 'records/s' in text and 'dead-lettered: 0' in text


async def _retention(p: Projection, out: Path) -> None:
    state = retention_state(p.memory.shard, 0, 86_400_000_000)
    text = retention_text(86_400_000_000, [state])
    table = '\n'.join(text.splitlines()[1:])
    assert {'shard', 'clock', 'cut-off', 'ended kept', 'dropped'} <= set(header(table))


async def _export(p: Projection, out: Path) -> None:
    await export_parquet(p.reader, str(out), p.settings)
    tables = {'runs', 'events', 'model_requests', 'tool_effects', 'resolutions', 'messages'}
    assert {d.name for d in out.iterdir() if d.is_dir()} == tables
    assert all(part.name.startswith('date=') for t in tables for part in (out / t).iterdir())


Check = Callable[[Projection, Path], Awaitable[None]]
CLAIMS: dict[str, tuple[list[str], Check]] = {
    'runs': (['the newest first'], _runs),
    'events': (['in seq order'], _events),
    'effects': (["each call's status and every resolution"], _effects),
    'unresolved': (
        ['in_flight (run live) or unknown_after_crash, with run status', 'a deferred call waits'],
        _unresolved,
    ),
    'deferred': (
        [
            'the longest waiting first: run, call, tool, kind, agent, how long, arguments '
            '(--wide: also the conversation and since when'
        ],
        _deferred,
    ),
    'conversations': (
        [
            'the newest activity first: runs, last status, live, latest run, last active, title '
            '(--wide: also its writer, tokens and cost'
        ],
        _conversations,
    ),
    'conflicts': (['run ids claimed by more than one writer'], _conflicts),
    'status': (['Per-partition lag, records applied per second, DLQ count'], _status),
    'retention': (['per shard, its log clock, cut-off, ended runs kept and runs dropped'], _retention),
    'export': (
        [
            'Parquet tables (runs, events, model_requests, tool_effects, resolutions, messages), '
            'partitioned by date'
        ],
        _export,
    ),
}
"""Each command whose help describes its output: the phrases that do, and the check that keeps them."""


@pytest.mark.parametrize('command', CLAIMS)
def test_the_help_says_what_is_held_here(command: str) -> None:
    said = help_of(command)
    for phrase in CLAIMS[command][0]:
        assert phrase in said, f'`stepstream {command} --help` changed: update its claim here ({said!r})'


@pytest.mark.parametrize('command', CLAIMS)
async def test_the_output_keeps_what_the_help_says(
    command: str, projection: Projection, tmp_path: Path
) -> None:
    await CLAIMS[command][1](projection, tmp_path / 'out')


async def test_the_json_of_a_view_is_its_records(projection: Projection) -> None:
    """`--json` ("machine-readable output"): the records, which a script can read."""
    runs = json.loads(await view(projection, 'runs', json=True))
    assert {r['run_id'] for r in runs} >= {'claims-waiting', 'claims-cancelled'}


async def test_a_check_of_the_topics_says_it_only_checks() -> None:
    """`stepstream status` checks the topics and creates none: its connection error says so."""
    settings = Settings(bootstrap_servers='127.0.0.1:9', ack_timeout_s=1)  # nothing listens there
    with pytest.raises(StepStreamUnavailable) as checking:
        await ensure_topics(settings, create=False)
    assert 'could not connect to check topics' in str(checking.value)
    with pytest.raises(StepStreamUnavailable) as ensuring:
        await ensure_topics(settings)
    assert 'could not connect to create or check topics' in str(ensuring.value)
