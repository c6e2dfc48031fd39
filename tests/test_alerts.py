"""The shipped alerts and dashboard (compose/prometheus, compose/grafana) against the catalogue and promtool.

The fast tests read the files: every metric an alert or a panel queries is a sample of
`stepstream.metrics.CATALOGUE` (or Prometheus's own `up`), every alert says how bad it is, what it
means and which section of docs/operations.md is its runbook, and the dashboard is one Grafana
loads. The promtool tests build the promtool of Prometheus v3.16 once (`go install`, into
~/.cache/stepstream/promtool/) and run it: the rules and the Prometheus configuration are valid,
the dashboard's queries parse, and alerts.test.yml (`promtool test rules`) makes every alert fire
on the failure it names and stay quiet on the look-alikes that are none.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepstream.embedded.apache_kafka import locked
from stepstream.metrics import CATALOGUE

yaml = pytest.importorskip('yaml', reason='PyYAML is needed to read the rule files (dev extra)')

COMPOSE = Path(__file__).resolve().parent.parent / 'compose'
PROMETHEUS = COMPOSE / 'prometheus'
ALERTS = PROMETHEUS / 'alerts.yml'
ALERT_TESTS = PROMETHEUS / 'alerts.test.yml'
CONFIG = PROMETHEUS / 'prometheus.yml'
DASHBOARD = COMPOSE / 'grafana' / 'dashboards' / 'stepstream.json'
DATASOURCES = COMPOSE / 'grafana' / 'provisioning' / 'datasources' / 'prometheus.yml'

RUNBOOK = 'docs/operations.md'
ANCHORS = (
    'projector-behind',
    'dlq-growing',
    'effects-in-doubt',
    'approvals-stuck',
    'stale-runs-rising',
    'member-without-shards',
    'partitions-unowned',
    'no-checkpoint',
    'projector-down',
)
"""The runbook sections of docs/operations.md an alert may point at; each has one at least."""
SEVERITIES = {'warning', 'critical'}
BUILT_IN = {'up'}
"""Series Prometheus makes itself, which a query may name besides the catalogue's."""

PROMTOOL_VERSION = 'v0.316.0'
"""The Go module version of Prometheus v3.16.0, the compose image's (`prom/prometheus:v3.16.0`)."""
PROMTOOL_PACKAGE = 'github.com/prometheus/prometheus/cmd/promtool'
BUILD_TIMEOUT_S = 900
"""A first build compiles Prometheus (minutes on two cores); later ones find the binary."""


# -- what a PromQL expression queries --------------------------------------------------------------

NOT_NAMES = {'by', 'without', 'on', 'ignoring', 'group_left', 'group_right', 'and', 'or', 'unless'}
NOT_NAMES |= {'bool', 'offset', 'atan2', 'inf', 'nan'}


def metric_names(expr: str) -> set[str]:
    """The series names `expr` selects: no functions, keywords, labels, durations or strings."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    text = re.sub(r'\{[^}]*\}', ' ', text)  # label matchers
    text = re.sub(r'\[[^\]]*\]', ' ', text)  # ranges and subqueries ($__rate_interval too)
    text = re.sub(r'\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)', ' ', text)
    names = set()
    for token in re.finditer(r'[A-Za-z_:][\w:]*', text):
        before = text[token.start() - 1] if token.start() else ' '
        if before.isdigit() or before in '.$':  # 15m, 1e3, a Grafana variable
            continue
        if text[token.end() :].lstrip().startswith('(') or token.group().lower() in NOT_NAMES:
            continue
        names.add(token.group())
    return names


@pytest.mark.fast
def test_metric_names_reads_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, route) (rate(a_bucket{route!="/x"}[$__rate_interval])))'
        ' > 0.5 or max without (instance) (b) - on (job) group_left (c) sum(c_total offset 15m) '
        'and delta(d[30m:1m]) > 1e3 unless up{job="stepstream-projector"} == bool 0'
    )
    assert metric_names(expr) == {'a_bucket', 'b', 'c_total', 'd', 'up'}


KNOWN = {sample for metric in CATALOGUE.values() for sample in metric.samples} | BUILT_IN


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())['groups']
    return [rule for group in groups for rule in group['rules']]


def dashboard_targets() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query of the dashboard, rows' panels included."""
    for panel in dashboard_panels():
        for target in panel.get('targets', []):
            yield panel, target


def dashboard_panels() -> list[dict[str, Any]]:
    panels = json.loads(DASHBOARD.read_text())['panels']
    return [p for top in panels for p in (top, *top.get('panels', []))]


# -- fast: by structure -------------------------------------------------------------------------


@pytest.mark.fast
def test_every_alert_queries_the_catalogue_and_names_its_runbook() -> None:
    rules = alert_rules()
    assert rules and all('alert' in rule for rule in rules), 'alerts.yml holds alerts only'
    names = [rule['alert'] for rule in rules]
    assert len(names) == len(set(names)), 'alert names are unique'
    pointed = set()
    for rule in rules:
        name = rule['alert']
        unknown = metric_names(rule['expr']) - KNOWN
        assert not unknown, f'{name} queries what the catalogue does not have: {sorted(unknown)}'
        assert metric_names(rule['expr']), name
        assert re.fullmatch(r'\d+[smh]', str(rule.get('for', ''))), f'{name}: no `for:`'
        assert rule.get('labels', {}).get('severity') in SEVERITIES, f'{name}: severity'
        annotations = rule.get('annotations', {})
        assert annotations.get('summary') and annotations.get('description'), f'{name}: summary, description'
        page, _, anchor = annotations.get('runbook_url', '').partition('#')
        assert page == RUNBOOK and anchor in ANCHORS, f'{name}: runbook_url {annotations.get("runbook_url")}'
        pointed.add(anchor)
    assert pointed == set(ANCHORS), f'runbook sections no alert points at: {set(ANCHORS) - pointed}'


@pytest.mark.fast
def test_every_runbook_anchor_is_a_section_of_the_runbook() -> None:
    """Each anchor an alert links to is a heading of docs/operations.md (GitHub's anchor of it)."""
    text = (Path(__file__).resolve().parent.parent / RUNBOOK).read_text()
    headings = {
        re.sub(r'[^a-z0-9 -]', '', line.lstrip('#').strip().lower()).replace(' ', '-')
        for line in text.splitlines()
        if line.startswith('### ')
    }
    assert set(ANCHORS) <= headings, f'no runbook section for {sorted(set(ANCHORS) - headings)}'


@pytest.mark.fast
def test_every_alert_has_a_unit_test_where_it_fires() -> None:
    """alerts.test.yml runs alerts.yml, and expects each alert firing once at least (promtool runs it)."""
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    assert tests['rule_files'] == [ALERTS.name]
    cases = [case for test in tests['tests'] for case in test['alert_rule_test']]
    fired = {case['alertname'] for case in cases if case['exp_alerts']}
    quiet = {case['alertname'] for case in cases if not case['exp_alerts']}
    names = {rule['alert'] for rule in alert_rules()}
    assert fired == names, f'alerts never seen firing: {names - fired}; unknown: {fired - names}'
    assert quiet == names, f'alerts never seen quiet: {names - quiet}'


@pytest.mark.fast
def test_prometheus_loads_the_alerts_and_scrapes_the_projector() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    assert config['rule_files'] == [ALERTS.name]  # beside it, in the container as here
    jobs = {job['job_name'] for job in config['scrape_configs']}
    assert 'stepstream-projector' in jobs
    for rule in alert_rules():  # the job the alerts name is one Prometheus scrapes
        for job in re.findall(r'job="([^"]+)"', rule['expr']):
            assert job in jobs, (rule['alert'], job)


@pytest.mark.fast
def test_the_dashboard_queries_the_catalogue_on_the_provisioned_prometheus() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard['uid'] and dashboard['title'] and 36 <= dashboard['schemaVersion'] <= 41
    panels = dashboard_panels()
    ids = [panel['id'] for panel in panels]
    assert len(ids) == len(set(ids)), 'panel ids are unique'
    (source,) = yaml.safe_load(DATASOURCES.read_text())['datasources']
    shown = set()
    for panel in panels:
        grid = panel['gridPos']
        assert grid['x'] + grid['w'] <= 24 and grid['w'] > 0 and grid['h'] > 0, panel['title']
        if panel['type'] == 'row':
            continue
        assert panel['title'] and panel['targets'], f'panel {panel["id"]} has no query'
        assert panel['datasource'] == {'type': 'prometheus', 'uid': source['uid']}, panel['title']
        for target in panel['targets']:
            assert target['datasource']['uid'] == source['uid'], panel['title']
            names = metric_names(target['expr'])
            assert names and not names - KNOWN, f'{panel["title"]}: not in the catalogue: {names - KNOWN}'
            shown |= names
    missing = {m.name for m in CATALOGUE.values() if not set(m.samples) & shown}
    assert not missing, f'metrics of the catalogue no panel shows: {sorted(missing)}'


# -- with promtool ---------------------------------------------------------------------------------


def promtool_dir() -> Path:
    return Path.home() / '.cache' / 'stepstream' / 'promtool' / PROMTOOL_VERSION


@pytest.fixture(scope='module')
def promtool() -> Path:
    """promtool PROMTOOL_VERSION, built with `go install` the first time; skips without Go or a build."""
    cache = promtool_dir()
    binary = cache / 'promtool'
    cache.mkdir(parents=True, exist_ok=True)
    with locked(cache.parent / f'{PROMTOOL_VERSION}.lock'):
        if binary.exists():
            return binary
        go = shutil.which('go')
        if go is None:
            pytest.skip(f'no `go` on PATH to build promtool ({PROMTOOL_PACKAGE}@{PROMTOOL_VERSION})')
        command = [go, 'install', f'{PROMTOOL_PACKAGE}@{PROMTOOL_VERSION}']
        try:
            done = subprocess.run(
                command,
                env={**os.environ, 'GOBIN': str(cache)},
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            pytest.skip(f'`{" ".join(command[1:])}` did not finish within {BUILD_TIMEOUT_S} s')
        if done.returncode != 0 or not binary.exists():
            tail = '\n'.join((done.stdout + done.stderr).strip().splitlines()[-10:])
            pytest.skip(f'`go install` could not build promtool (exit {done.returncode}):\n{tail}')
    return binary


def run(promtool: Path, *args: str | Path) -> str:
    done = subprocess.run(
        [str(promtool), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=PROMETHEUS
    )
    assert done.returncode == 0, f'promtool {" ".join(map(str, args))}:\n{done.stdout}{done.stderr}'
    return done.stdout + done.stderr


@pytest.mark.broker
@pytest.mark.once
@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_promtool_checks_the_rules_the_config_and_the_dashboard_queries(
    promtool: Path, tmp_path: Path
) -> None:
    rules = len(alert_rules())
    assert f'SUCCESS: {rules} rules found' in run(
        promtool, 'check', 'rules', '--lint=all', '--lint-fatal', ALERTS
    )
    assert 'SUCCESS' in run(promtool, 'check', 'config', '--lint=all', '--lint-fatal', CONFIG)

    # The dashboard's queries, as recording rules: promtool parses them as Prometheus would.
    recorded = [
        {
            'record': f'stepstream:dashboard:panel_{panel["id"]}_{target["refId"]}',
            'expr': target['expr'].replace('$__rate_interval', '1m'),
        }
        for panel, target in dashboard_targets()
    ]
    queries = tmp_path / 'dashboard-queries.yml'
    queries.write_text(yaml.safe_dump({'groups': [{'name': 'dashboard', 'rules': recorded}]}))
    assert f'SUCCESS: {len(recorded)} rules found' in run(promtool, 'check', 'rules', queries)


@pytest.mark.broker
@pytest.mark.once
@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_every_alert_fires_on_its_failure(promtool: Path) -> None:
    """alerts.test.yml: each alert fires on the failure it names and not on its look-alikes."""
    output = run(promtool, 'test', 'rules', ALERT_TESTS)
    assert 'SUCCESS' in output and 'FAILED' not in output, output
