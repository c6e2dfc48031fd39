"""docs/benchmarks.md: its "Current figures" are rendered from docs/benchmarks/current.json, and agree.

Standard library only: bench/current.py is loaded by its path, without the benchmarks' dependencies.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / 'docs'


def _load_current() -> ModuleType:
    spec = importlib.util.spec_from_file_location('bench_current', REPO / 'bench' / 'current.py')
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


current = _load_current()

SMALL: dict[str, Any] = {
    'areas': [
        {
            'id': 'producer',
            'title': 'Producer throughput',
            'about': 'Simulated runs against raw aiokafka.',
            'figures': [
                {
                    'id': 'producer.bench_eventlog_32',
                    'figure': '`EventLog`, 32 concurrent runs',
                    'value': 16181,
                    'unit': 'records/s',
                    'ceiling': 'raw aiokafka 35,667 records/s, same run',
                    'ratio': 0.4537,
                    'target': '>= 0.8 of raw aiokafka',
                    'met': False,
                    'date': '2026-12-02 05:39 UTC',
                    'commit': '4ef0023',
                    'commit_recorded': True,
                    'command': 'python -m bench --no-plot',
                    'source': {
                        'file': 'history/issue-27.md',
                        'section': 'Issue 27, fourth pass: the hand-over',
                    },
                    'note': 'One sample | noisy.',
                },
                {
                    'id': 'producer.ack',
                    'figure': 'ack round trip',
                    'value': 'p50 0.32 ms, p99 0.58 ms',
                    'date': '2026-11-30 11:08 UTC',
                    'commit': 'e46f618',
                    'command': 'make bench',
                },
                {
                    'id': 'producer.bytes',
                    'figure': 'bytes',
                    'value': 0.4,
                    'unit': 'MB',
                    'digits': 3,
                    'ratio': 'about 1',
                    'target': '<= 0.455 MB',
                    'met': True,
                    'date': '2026-12-01',
                    'commit': 'abc1234',
                    'command': 'make bench',
                },
            ],
        },
        {'id': 'empty', 'title': 'An area', 'figures': []},
    ],
    'plots': [
        {
            'area': 'producer',
            'path': 'plot.png',
            'title': 'a plot',
            'date': 'd',
            'commit': 'c',
            'command': 'x',
        }
    ],
}


def test_each_area_renders_as_a_table_with_ratio_target_date_commit_and_command() -> None:
    text = current.render(SMALL)
    lines = text.splitlines()
    assert '### Producer throughput' in lines and '### An area' in lines
    assert 'Simulated runs against raw aiokafka.' in lines
    assert lines.count('| figure | value | ceiling or reference | ratio | target | measured | command |') == 2
    row = next(line for line in lines if 'concurrent runs' in line and line.startswith('|'))
    cells = [c.strip() for c in row.strip('|').split(' | ')]
    assert cells == [
        '[`EventLog`, 32 concurrent runs](benchmarks/history/issue-27.md#issue-27-fourth-pass-the-hand-over)',
        '16,181 records/s',
        'raw aiokafka 35,667 records/s, same run',
        '0.45',
        '>= 0.8 of raw aiokafka: missed',
        '2026-12-02 05:39 UTC, `4ef0023`†',
        '`python -m bench --no-plot`',
    ]
    ack = '| ack round trip | p50 0.32 ms, p99 0.58 ms |  |  |  | 2026-11-30 11:08 UTC, `e46f618` |'
    assert f'{ack} `make bench` |' in lines
    assert (
        '| bytes | 0.400 MB |  | about 1 | <= 0.455 MB: met | 2026-12-01, `abc1234` | `make bench` |' in lines
    )
    assert '- `EventLog`, 32 concurrent runs: One sample | noisy.' in lines  # notes are not table cells
    assert '![a plot](plot.png)' in lines


def test_the_tables_go_between_the_markers_and_nowhere_else() -> None:
    doc = f'# Title\n\nbefore\n\n{current.START}\nold tables\n{current.END}\n\nafter\n'
    spliced = current.splice(doc, current.render(SMALL))
    assert spliced.startswith('# Title\n\nbefore\n\n')
    assert spliced.endswith(f'{current.END}\n\nafter\n')
    assert 'old tables' not in spliced
    assert current.current_tables(spliced) == current.render(SMALL)
    assert current.splice(spliced, current.render(SMALL)) == spliced
    with pytest.raises(ValueError, match='markers'):
        current.splice('# no markers\n', 'x')


def test_docs_benchmarks_md_shows_the_figures_of_current_json() -> None:
    assert current.in_sync(DOCS / 'benchmarks.md', DOCS / 'benchmarks' / 'current.json'), (
        'docs/benchmarks.md is not in sync with docs/benchmarks/current.json: '
        'run .venv/bin/python -m bench.current'
    )


def _headings(path: Path) -> set[str]:
    return {current.slug(m) for m in re.findall(r'^#{1,6} (.+)$', path.read_text(), re.M)}


def test_every_figure_has_its_date_commit_command_and_notes_that_exist() -> None:
    data = current.load(DOCS / 'benchmarks' / 'current.json')
    ids = [f['id'] for area in data['areas'] for f in area['figures']]
    assert len(ids) == len(set(ids))
    for area in data['areas']:
        assert area['figures'], area['id']
        for figure in area['figures']:
            for key in ('figure', 'value', 'date', 'commit', 'command'):
                assert figure.get(key) not in (None, ''), (figure['id'], key)
            assert re.match(r'\d{4}-\d{2}-\d{2}', figure['date']), figure['id']
            if figure.get('met') is not None:
                assert figure.get('target'), figure['id']
            source = figure.get('source')
            if source:
                notes = DOCS / 'benchmarks' / source['file']
                assert notes.is_file(), (figure['id'], source['file'])
                assert current.slug(source['section']) in _headings(notes), (figure['id'], source['section'])
    for plot in data.get('plots', []):
        assert (DOCS / plot['path']).is_file(), plot['path']
        assert plot['area'] in {area['id'] for area in data['areas']}


def test_relative_links_of_the_report_and_its_history_resolve() -> None:
    pages = [DOCS / 'benchmarks.md', *sorted((DOCS / 'benchmarks' / 'history').glob('*.md'))]
    assert len(pages) > 2
    for page in pages:
        for target in re.findall(r'\]\(([^)\s]+)\)', page.read_text()):
            if re.match(r'[a-z]+:', target):
                continue
            path, _, anchor = target.partition('#')
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), (page.name, target)
            if anchor and resolved.suffix == '.md':
                assert anchor in _headings(resolved), (page.name, target)


def _bench_run() -> tuple[dict[str, Any], dict[str, Any]]:
    """A `python -m bench` run's summary and raw results, with every workload, as `from_run` reads them."""

    def cell(added: float, stored: float) -> dict[str, Any]:
        return {'added_ms': added, 'bytes': stored, 'record_bytes': stored * 1.8}

    summary = {
        'per_step': {
            'stepstream': {50: cell(4.111, 131_000), 200: cell(4.567, 377_123), 1000: cell(7.2, 1.9e6)},
            'stepstream-no-projector': {200: cell(1.987, 376_000)},
            'harness-sqlite': {200: cell(57.59, 9.118e6)},
            'harness-file': {200: cell(170.78, 42e6)},
        }
    }
    raw = {
        'producer': {
            'raw_aiokafka': {'records_per_s': 40_000.4},
            'eventlog_32_runs': {'records_per_s': 20_000.0, 'runs': 32},
            'eventlog_256_runs': {'records_per_s': 33_000.0, 'runs': 256},
            'eventlog_256_runs_linger0': {'records_per_s': 11_000.0, 'runs': 256},
            'eventlog_append_only': {'records_per_s': 25_000.0},
            'agent_runs': {'records_per_s': 600.2},
            'ack_round_trip': {'p50_ms': 0.31, 'p99_ms': 0.6},
        },
        'projector': {
            'rebuild': {
                'records': 1_000_035,
                'seconds': 40.04,
                'records_per_s': 24_976.0,
                'projection_bytes': 1.17e8,
            },
            'decode': {'fastavro_records_per_s': 95_000.0, 'stepstream_decode_records_per_s': 60_000.0},
            'raw_consume': {'records_per_s': 150_000.0},
            'rocksdb': {'records_per_s': 500_000.0},
        },
        'freshness': {'p50_ms': 15.0, 'p99_ms': 60.0, 'samples': 590, 'background_records_per_s': 1000.0},
        'freshness_raw': {'p99_ms': 40.0},
        'partitioned': {
            'rebuild': [
                {'jobs': 1, 'records': 1_000_035, 'seconds': 50.0},
                {'jobs': 2, 'records': 1_000_035, 'seconds': 30.0},
            ],
            'members': [
                {'members': 1, 'records': 1_000_035, 'records_per_s': 15_000.0, 'cpu_seconds': [40.0]},
                {'members': 2, 'records': 1_000_035, 'records_per_s': 21_000.0, 'cpu_seconds': [20.0, 21.0]},
            ],
            'failover': [
                {
                    'checkpoints': False,
                    'trials': 8,
                    'owned_again_s': {'p50': 9.4, 'p99': 9.5},
                    'caught_up_s': {'p50': 10.1, 'p99': 10.3},
                },
                {
                    'checkpoints': True,
                    'trials': 8,
                    'owned_again_s': {'p50': 9.3, 'p99': 9.7},
                    'caught_up_s': {'p50': 9.4, 'p99': 9.9},
                },
            ],
        },
    }
    return summary, raw


def test_a_bench_run_updates_the_figures_it_measured_and_the_doc(tmp_path: Path) -> None:
    data_path, doc_path = tmp_path / 'current.json', tmp_path / 'benchmarks.md'
    data_path.write_text((DOCS / 'benchmarks' / 'current.json').read_text())
    doc_path.write_text((DOCS / 'benchmarks.md').read_text())
    before = current.figures_by_id(current.load(data_path))
    summary, raw = _bench_run()

    ids = current.record_run(
        summary,
        raw,
        date='2027-01-02 03:04 UTC',
        command='make bench',
        doc_path=doc_path,
        data_path=data_path,
    )

    measured = current.from_run(summary, raw)
    assert set(ids) == set(measured) and len(ids) >= 20  # every id `python -m bench` knows is in current.json
    after = current.figures_by_id(current.load(data_path))
    n200 = after['per_step.added_wall_n200']
    assert (n200['value'], n200['ratio'], n200['met']) == (4.57, 2.28, False)
    assert (n200['date'], n200['command']) == ('2027-01-02 03:04 UTC', 'make bench')
    assert re.fullmatch(r'[0-9a-f]{7}(-dirty)?|unknown', n200['commit'])
    assert 'source' not in n200 and 'commit_recorded' not in n200  # the notes were about another measurement
    assert after['per_step.bytes_n200']['ceiling'] == 'harness SqliteStepStore 9.118 MB, same run'
    assert after['producer.bench_eventlog_32']['ratio'] == 0.5
    assert after['freshness.bench_p99']['target'] == '<= 1.1x the ceiling (issue 27): missed; <= 100 ms: met'
    assert after['partitioned.bench_two_members']['ratio'] == 1.4
    for figure_id, figure in before.items():  # what the run did not measure is left as it was
        if figure_id not in measured:
            assert after[figure_id] == figure
    assert current.in_sync(doc_path, data_path)
    assert '| 4.57 ms |' in doc_path.read_text()


def test_an_unknown_figure_is_refused() -> None:
    data = copy.deepcopy(SMALL)
    with pytest.raises(KeyError, match=r'not in current\.json'):
        current.update(data, {'producer.nope': {'value': 1}}, date='d', commit='c', command='x')
    assert json.dumps(data) == json.dumps(SMALL)
