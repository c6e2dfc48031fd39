"""`make run`: `stack up`, the demo twice, the replay and the fork it prints pasted as printed, then
the operator's commands against its log, all through the installed command, as a new user types them."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
import pyarrow.dataset as ds
import pytest
from prometheus_client.parser import text_string_to_metric_families

from waits import until_sync

# `make run` on the embedded default (Tansu): what it shows does not depend on the broker, and
# test_embedded runs a stack on each.
pytestmark = [pytest.mark.broker, pytest.mark.once]

STEPSTREAM = str(Path(sys.executable).parent / 'stepstream')


def user_env() -> dict[str, str]:
    """No STEPSTREAM_* variables: the commands find the stack through ./.stepstream alone.

    Only the liveness window is shorter than the default (20 s), so the demo's wait for its killed
    publisher to read stale takes 2 s, not 20.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith('STEPSTREAM_') or k.endswith('_BROKER')}
    return env | {'STEPSTREAM_HEARTBEAT_INTERVAL_S': '0.2', 'STEPSTREAM_STALE_AFTER_S': '2'}


def stepstream(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = user_env()
    done = subprocess.run([STEPSTREAM, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


ATTACHED_AGENT = """
import asyncio
from pydantic_ai import Agent
from pydantic_ai.models.test import TestModel
from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.readmodel import ProjectionReader, continue_run

async def main():
    settings = Settings.from_env()
    async with EventLog(settings) as log:
        librarian = Agent(TestModel(), capabilities=[StepPersistence(log=log, agent_name='librarian')])
        await librarian.run('find X', conversation_id='conv-1')
        await log.flush()
        reader = ProjectionReader.open(settings.projection.db_path)  # beside the stack's projector
        runs = []
        while not runs or runs[-1].status != 'completed':  # the stack's projector applies it
            runs = await reader.list_runs(conversation_id='conv-1')
            await asyncio.sleep(0.05)
        history = await continue_run(reader, run_id=runs[-1].run_id)
        await librarian.run('follow up', message_history=history, conversation_id='conv-1')
        reader.close()
        print('attached', runs[-1].run_id, len(history))

asyncio.run(main())
"""
"""docs/getting-started.md's "Attach your own agent", with a model that needs no network."""


class _Links(HTMLParser):
    """The `href` and `src` of every tag of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found += [value for name, value in attrs if name in ('href', 'src') and value]


def crawl(http: httpx.Client, limit: int = 2000) -> tuple[set[str], list[str]]:
    """Follow every same-origin link from `/`: the paths reached, and those that failed."""
    queue, seen, failures = ['/'], {'/'}, []
    while queue and len(seen) < limit:
        path = queue.pop(0)
        answer = http.get(path)
        if answer.status_code != 200 or 'Internal Server Error' in answer.text:
            failures.append(f'{path}: {answer.status_code}')
            continue
        if not answer.headers.get('content-type', '').startswith('text/html'):
            continue
        links = _Links()
        links.feed(answer.text)
        for found in links.found:
            target = urljoin(path, found).split('#', 1)[0]
            if target.startswith('/') and not target.startswith('//') and target not in seen:
                seen.add(target)
                queue.append(target)
    return seen, failures


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith('STEPSTREAM_')}


def _export(line: str) -> tuple[str, str]:
    name, _, value = line.removeprefix('export ').partition('=')
    return name, shlex.split(value)[0] if value else ''


def status_json(cwd: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(stepstream(cwd, 'status', '--json').stdout)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f'/proc/{pid}').exists() and 'Z' not in Path(f'/proc/{pid}/stat').read_text().split()[2]


def pasted(cwd: Path, line: str) -> subprocess.CompletedProcess[str]:
    """`line` run by a shell, as a user pastes it (the PATH as it is: the line names its program)."""
    return subprocess.run(
        line, shell=True, cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=300
    )


def replay_and_fork(cwd: Path, out: str) -> None:
    """The demo's last lines replay its orchestrator run and fork it at step 2, as printed."""
    *_, heading, replay, fork = out.rstrip().splitlines()
    assert heading.startswith('Replay its orchestrator run')
    found = re.fullmatch(r'  (\S+) replay (orchestrator-\S+) --agent stepstream\.demo:orchestrator', replay)
    assert found is not None, replay
    program, run_id = found.groups()
    assert program in ('stepstream', STEPSTREAM)  # as the shell finds this very program
    assert f'== events of {run_id} (orchestrator, completed)' in out  # this demo's orchestrator run
    assert fork == f'{replay} --from-step 2 --model stepstream.demo:cautious_model'

    replayed = pasted(cwd, replay.strip())
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    assert replayed.stdout == f'{run_id}: matched after 3 step(s), tools recorded\n'

    forked = pasted(cwd, fork.strip())
    assert forked.returncode == 0, forked.stderr[-3000:]
    head = f'{run_id}: forked after 1 step(s), tools recorded: forked at step 2 into '
    assert forked.stdout.startswith(head), forked.stdout
    fork_id = forked.stdout.removeprefix(head).strip()
    assert fork_id.startswith('orchestrator-') and fork_id != run_id

    # The fork is a run on the log: it names where it came from, and its model did not publish.
    def applied() -> dict[str, Any] | None:
        runs = json.loads(stepstream(cwd, 'runs', '--json').stdout)
        return next((r for r in runs if r['run_id'] == fork_id and r['status'] == 'completed'), None)

    run = until_sync(applied, 'the stack to apply the fork', 120)
    metadata = run['metadata']
    assert (metadata['stepstream.forked_from'], metadata['stepstream.forked_at_step']) == (run_id, '2')
    assert run['conversation_id'] == 'release-demo'
    assert 'tool_call_started' not in stepstream(cwd, 'events', fork_id).stdout  # no tool ran
    answer = stepstream(cwd, 'snapshot', fork_id).stdout.rstrip().splitlines()[-1]
    assert "text: researched: the release adds delta snapshots (3 documents match 'changelog')" in answer
    assert answer.endswith('; not publishing until a person has read the notes')


def test_demo_then_status_rebuild_verify_and_stack_down(tmp_path: Path) -> None:
    children: list[int] = []
    try:
        up = stepstream(tmp_path, 'stack', 'up').stdout
        assert 'stack up (pid' in up and 'stepstream stack down' in up
        assert (tmp_path / '.stepstream').stat().st_mode & 0o777 == 0o700
        assert (tmp_path / '.stepstream' / 'stack.env').stat().st_mode & 0o777 == 0o600
        pid_line = next(line for line in up.splitlines() if line.startswith('stack up (pid'))
        assert stepstream(tmp_path, 'stack', 'up').stdout.startswith(f'already running: {pid_line}')
        url = up.split('run explorer: ')[1].split()[0]
        assert url.startswith('http://127.0.0.1:')
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get('/').status_code == 200  # the stack serves the explorer at the printed URL

            first = stepstream(tmp_path, 'demo').stdout
            assert '1 orchestrator run(s)' in first
            answer = first.split('orchestrator answered: ')[1].splitlines()[0]
            assert 'publishing was interrupted' in answer and 'killed' in answer  # not "published"
            lineage = first.split('== lineage')[1].split('== this demo')[0]
            assert '[orchestrator, completed]' in lineage
            assert '├── researcher-' in lineage and '[researcher, completed]' in lineage
            assert '└── publisher-' in lineage and '[publisher, stale]' in lineage  # heartbeats stopped
            assert 'waiting up to 2 s for publisher-' in first
            costs = first.split("== this demo's runs")[1].split('== events')[0]
            assert costs.count('$0.0') == 3  # the demo model has a price: every run shows a cost
            assert 'tool_call_failed         search_docs' in first  # one tool fails, and shows so
            unresolved = first.split('== unresolved tool effects')[1]
            assert 'send_announcement' in unresolved and 'unknown_after_crash' in unresolved
            assert 'announce:#releases' in unresolved
            assert f'Run explorer (served by the stack): {url}' in first
            # A call waited for an approval; the demo approved it on the log and resumed its run.
            approval = first.split('== an approval: ')[1].split('\n\n')[0]
            waited = approval.split()[0]
            assert waited.startswith('release-manager-') and 'an approval of tag_release(' in approval
            assert "demo-approver approved it on the log ('the release notes are checked')" in approval
            resumed = approval.split('resumed as ')[1].split()[0]
            assert resumed.startswith('release-manager-') and resumed != waited
            assert 'in conversation release-demo: tagged v1.4.0' in approval
            assert f'stepstream effects {waited}' in first

            # The stack's projector serves its metrics and probes where `stack up` said: ready, and
            # the demo's interrupted announcement counts as a tool call in doubt.
            metrics_url = up.split('projector metrics: ')[1].split()[0]
            assert metrics_url.startswith('http://127.0.0.1:') and metrics_url.endswith('/metrics')
            with httpx.Client(timeout=30) as ops:
                until_sync(
                    lambda: ops.get(metrics_url.replace('/metrics', '/readyz')).status_code == 200, 'ready'
                )
                scraped = {
                    (s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in text_string_to_metric_families(ops.get(metrics_url).text)
                    for s in family.samples
                }
            assert scraped[('stepstream_effects_unresolved', (('state', 'unknown_after_crash'),))] >= 1
            assert scraped[('stepstream_projector_shards_owned', ())] == 3

            # The stack's projector applies every partition; kill it and the stack starts another.
            writers = status_json(tmp_path)['writers']
            assert len(writers) == 3 and None not in writers.values() and len(set(writers.values())) == 1
            [projector] = set(writers.values())
            children += [projector]
            os.kill(projector, signal.SIGKILL)
            restarted = until_sync(
                lambda: (
                    w
                    if None not in (w := status_json(tmp_path)['writers']).values()
                    and projector not in w.values()
                    else None
                ),
                'a new projector',
                120,
            )
            children += list(set(restarted.values()))

            # `make run` twice works with the stack's projector and serve running.
            second = stepstream(tmp_path, 'demo').stdout
            assert '2 orchestrator run(s)' in second
            first_orchestrator = lineage.splitlines()[1].split()[0]
            assert first_orchestrator.startswith('orchestrator-') and first_orchestrator in second
            unresolved_rows = second.split('== unresolved tool effects')[1].split('\n\n')[0].splitlines()[3:]
            assert len(unresolved_rows) == 2 and all('unknown_after_crash' in row for row in unresolved_rows)

            # serve reads what the new projector applied: its status is current, every shard applied.
            served = until_sync(
                lambda: ((s := http.get('/api/status').json())['total_lag'] == 0 and s) or None,
                "serve's status to catch up",
                120,
            )
            assert all(p['projector_pid'] in restarted.values() for p in served['partitions'])
            runs = http.get('/api/runs').json()['runs']
            assert (
                len(runs) == 10
            )  # per demo: the orchestrator, its 2 delegates, a run that waited, its resumption
            # The decision is on the waiting run's call, and the resumed run names the run it resumes.
            [call] = http.get(f'/api/runs/{waited}/tool-effects').json()
            assert (call['tool_name'], call['status']) == ('tag_release', 'resolved')
            [decision] = call['resolutions']
            assert (decision['resolution'], decision['resolved_by'], decision['applied']) == (
                'approved',
                'demo-approver',
                True,
            )
            assert decision['note'] == 'the release notes are checked'
            [resuming] = [r for r in runs if r['metadata'].get('stepstream.resumes') == waited]
            assert (resuming['run_id'], resuming['conversation_id']) == (resumed, 'release-demo')
            assert resuming['status'] == 'completed'
            assert http.get('/api/deferred').json()['calls'] == []  # the demo's approvals decided every call

            # Every link of the stack's explorer answers (the browser crawler in test_explorer.py
            # does this over more kinds of runs; this one reads what `make run` made).
            pages, failures = crawl(http)
            assert not failures, failures
            assert sum('/snapshots/' in p for p in pages) >= 12 and any('/diff' in p for p in pages)

            # docs/getting-started.md, "Attach your own agent": an agent on the running stack by `stack env`.
            exported = stepstream(tmp_path, 'stack', 'env').stdout
            assert 'export STEPSTREAM_BOOTSTRAP_SERVERS=127.0.0.1:' in exported
            attached = subprocess.run(
                [sys.executable, '-c', ATTACHED_AGENT],
                env={**clean_env(), **dict(_export(line) for line in exported.splitlines())},
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert attached.returncode == 0, attached.stderr[-3000:]
            librarian = attached.stdout.split()[1]

            def both_runs() -> list[dict[str, Any]] | None:  # the run and its follow-up, newest first
                runs = http.get('/api/runs', params={'agent_name': 'librarian'}).json()['runs']
                return runs if len(runs) == 2 and all(r['status'] == 'completed' for r in runs) else None

            listed = until_sync(both_runs, 'the explorer to list the attached agent', 120)
            assert listed[-1]['run_id'] == librarian

        # The demo model's price reaches the analytics export: each of its 9 requests per demo has a cost.
        assert 'exported ' in stepstream(tmp_path, 'export', '--out', 'exported').stdout
        requests = ds.dataset(tmp_path / 'exported' / 'model_requests', format='parquet', partitioning='hive')
        demo = [r for r in requests.to_table().to_pylist() if r['model_name'] == 'demo-scripted']
        assert len(demo) == 2 * 9 and all(r['cost_usd'] is not None and r['cost_usd'] > 0 for r in demo)
        # `stepstream effects` shows the approval: who decided, and why.
        effects = stepstream(tmp_path, 'effects', waited).stdout
        assert 'approved by demo-approver' in effects and 'the release notes are checked' in effects

        # The demo's last lines: a replay and a fork of its orchestrator run, pasted as printed.
        replay_and_fork(tmp_path, second)

        # What the demo's last lines suggest, without any Python.
        status = json.loads(stepstream(tmp_path, 'status', '--json', '--max-lag', '0').stdout)
        assert status['total_lag'] == 0 and sum(p['applied'] for p in status['partitions']) > 0
        assert 'rebuilt' in stepstream(tmp_path, 'rebuild', '--into', 'rebuilt').stdout
        verified = stepstream(tmp_path, 'verify', str(tmp_path / '.stepstream' / 'projection'), 'rebuilt')
        assert 'identical' in verified.stdout
    finally:
        down = stepstream(tmp_path, 'stack', 'down', check=False)
    assert down.returncode == 0 and 'stopped the stack' in down.stdout, down.stderr
    assert not (tmp_path / '.stepstream' / 'stack.env').exists()
    assert not any(alive(pid) for pid in children)  # `stack down` stopped its projector
    gone = stepstream(tmp_path, 'stack', 'env', check=False)
    assert gone.returncode == 2 and 'no stack is running' in gone.stderr
