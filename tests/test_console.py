"""The CLI as a client of the read service: a view asked of `serve` prints what reading the shards prints.

Every console view (`runs`, `tree`, `events`, `snapshot`, `effects`, `unresolved`, `conflicts`),
as a table and as JSON, over runs of every shape the served projection holds (delegates, an
offloaded image, a call left `unknown_after_crash`, a dead letter), and for runs it does not
hold: the CLI that asks the service prints exactly what the CLI that opens the projection prints,
with the same exit code and message (but for the service's paths, which it never tells). The
asking CLI is given a projection path that does not exist, so an answer can only have come from
the service; a service that does not answer is no error (the CLI reads the projection itself).
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest
from test_cli import STEPSTREAM

from stepstream import Settings
from stepstream.serve import app_for, running

from served import served_projection

pytestmark = [pytest.mark.broker, pytest.mark.once]


async def run_cli(env: dict[str, str], cwd: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        STEPSTREAM,
        *args,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        return int(probe.getsockname()[1])


async def test_a_view_asked_of_the_service_is_the_view_read_here(settings: Settings, tmp_path: Path) -> None:
    db_path = tmp_path / 'projection'
    own = settings.replace(db_path=str(db_path))
    async with served_projection(own, db_path) as served, running(app_for(own), port=0) as service:
        crashed = await served.add_crashed_run('console-crash')
        runs = [served.orchestrator_run, served.image_run, crashed]  # lineage, media, an unknown effect
        cases: list[tuple[str, ...]] = [
            ('runs',),
            ('runs', '--json'),
            ('runs', '--status', 'cancelled'),
            ('runs', '--agent-name', 'orchestrator', '--json'),
            ('runs', '--parent-run-id', served.orchestrator_run),
            ('runs', '--limit', '1'),
            ('runs', '--wide'),
            ('runs', '--limit', '1', '--after', served.orchestrator_run, '--oldest-first', '--json'),
            ('runs', '--after', 'no-such-run'),
            ('unresolved',),
            ('unresolved', '--json'),
            ('unresolved', crashed, '--json'),
            ('conflicts',),
            ('conflicts', '--json'),
            ('snapshot', served.image_run),
            ('snapshot', served.image_run, '--json'),
            ('snapshot', crashed, '--include-interrupted'),
        ]
        for run_id in runs:
            for view in ('tree', 'events', 'effects'):
                cases += [(view, run_id), (view, run_id, '--json'), (view, run_id, '--wide')]
        for view in ('tree', 'events', 'snapshot', 'effects', 'unresolved'):
            cases.append((view, 'no-such-run'))

        cwd = tmp_path  # no stack of the checkout's `make run` in the way
        here = {**os.environ, **own.to_env()}
        there = {**here, 'STEPSTREAM_DB_PATH': str(tmp_path / 'nowhere'), 'STEPSTREAM_SERVE_URL': service.url}
        nobody = {**here, 'STEPSTREAM_SERVE_URL': f'http://127.0.0.1:{closed_port()}'}
        for case in cases:
            read_here = await run_cli(here, cwd, *case)
            assert read_here[0] in (0, 1), (case, read_here)
            code, out, err = read_here  # the service never names its paths: its directory is withheld
            withheld = err.replace(str(db_path), '[the projection directory]')
            assert await run_cli(there, cwd, *case) == (code, out, withheld), case
        assert (await run_cli(nobody, cwd, *cases[1])) == await run_cli(here, cwd, *cases[1])
        code, _, err = await run_cli(there, cwd, 'tree', 'no-such-run')
        assert code == 1 and "no run 'no-such-run' in the projection at [the projection directory]" in err
        assert str(db_path) not in err
        # Without the service, the path that does not exist is read (and refused): the answers
        # above came from the service.
        refused = await run_cli(
            {**there, 'STEPSTREAM_SERVE_URL': nobody['STEPSTREAM_SERVE_URL']}, cwd, 'runs'
        )
        assert refused[0] != 0 and 'nowhere' in refused[2]
