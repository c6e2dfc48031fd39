"""A projection knows what it is: refused paths, topics and options, in-use directories,
resumable rebuilds, and errors a person can act on (exit code 2 for usage errors)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from test_cli import cli, cli_env, orchestrate
from test_hostile_log import start_projector

from stepstream import ProjectionInUse, ProjectionMismatch, Settings, UsageError
from stepstream.producer import EventLog
from stepstream.projector import Projector, rebuild, verify_paths
from stepstream.readmodel import ProjectionReader
from stepstream.storage import read_projection_identity

pytestmark = pytest.mark.broker


async def test_paths_that_are_not_projections_are_refused_and_left_alone(
    settings: Settings, tmp_path: Path
) -> None:
    a_file = tmp_path / 'notes.txt'
    a_file.write_text('mine')
    code, _, err = await cli(settings, a_file, 'runs')
    assert code == 2 and 'is a file, not a projection directory' in err
    with pytest.raises(UsageError, match='is a file'):
        Projector(settings, db_path=a_file)

    someone_elses = tmp_path / 'photos'
    someone_elses.mkdir()
    (someone_elses / 'cat.jpg').write_bytes(b'\xff\xd8')
    code, _, err = await cli(settings, someone_elses, 'projector')
    assert code == 2 and 'is not empty and is not a projection' in err
    assert sorted(p.name for p in someone_elses.iterdir()) == ['cat.jpg']  # nothing written

    code, _, err = await cli(settings, tmp_path, 'verify', str(tmp_path / 'nope'), str(tmp_path / 'nada'))
    assert code == 2 and f'verify LEFT {tmp_path / "nope"}: no such folder' in err and 'Traceback' not in err


async def test_a_second_projector_is_told_who_holds_the_directory(settings: Settings, tmp_path: Path) -> None:
    db_path = tmp_path / 'busy'
    service = await start_projector(settings, db_path)
    try:
        code, _, err = await cli(settings, db_path, 'projector')
        assert code == 2 and f'in use by another projector (pid {service.pid})' in err
        with pytest.raises(ProjectionInUse, match=str(service.pid)):
            Projector(settings, db_path=db_path)
    finally:
        service.send_signal(signal.SIGTERM)
        assert await service.wait() == 0


async def test_a_projection_refuses_other_topics_and_other_options(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    db_path = tmp_path / 'proj'
    async with Projector(settings, db_path=db_path, max_snapshots_per_run=2) as projector:
        await orchestrate(event_log, 'conv-id')
        await projector.wait_for(await event_log.flush())

    other = settings.replace(topic_prefix=settings.topics.topic_prefix + '-other')
    with pytest.raises(
        ProjectionMismatch, match=rf'built from the topics {settings.topics.topic_prefix}\.\*'
    ):
        async with Projector(other, db_path=db_path):
            pass
    with pytest.raises(ProjectionMismatch, match='max_snapshots_per_run=2, not 5'):
        async with Projector(settings, db_path=db_path, max_snapshots_per_run=5):
            pass
    async with Projector(settings, db_path=db_path) as projector:  # the stored option is kept
        assert projector.max_snapshots_per_run == 2
    code, _, err = await cli(other, db_path, 'projector')
    assert code == 2 and 'STEPSTREAM_TOPIC_PREFIX' in err

    # rebuild takes the same options, or copies them with --like; verify compares them first.
    await rebuild(settings, tmp_path / 'plain')
    _, difference = verify_paths(db_path, tmp_path / 'plain')
    assert difference is not None and 'built differently' in difference.key
    assert "'max_snapshots_per_run': 2" in str(difference.left)
    code, out, _ = await cli(settings, db_path, 'verify', str(db_path), str(tmp_path / 'plain'))
    assert code == 1 and 'built differently' in out
    code, _, err = await cli(
        settings, db_path, 'rebuild', '--into', str(tmp_path / 'like'), '--like', str(db_path)
    )
    assert code == 0, err
    code, out, _ = await cli(settings, db_path, 'verify', str(db_path), str(tmp_path / 'like'))
    assert code == 0 and 'identical' in out


async def test_a_killed_rebuild_says_it_is_incomplete_and_resumes(
    settings: Settings, event_log: EventLog, tmp_path: Path
) -> None:
    for i in range(4):
        await orchestrate(event_log, f'conv-resume-{i}')
    await event_log.flush()
    target = tmp_path / 'rebuilding'
    env = {**cli_env(settings, tmp_path / 'unused'), 'PYTHONUNBUFFERED': '1'}
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        '-c',
        'import asyncio, os, signal, sys\n'
        'from stepstream import Settings\n'
        'from stepstream.projector import rebuild\n'
        'def progress(done, total):\n'
        '    if done > 0:\n'
        '        print("applied", flush=True)\n'
        '        os.kill(os.getpid(), signal.SIGKILL)\n'
        f'asyncio.run(rebuild(Settings.from_env(), {str(target)!r}, on_progress=progress))\n',
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await child.communicate()
    assert child.returncode == -signal.SIGKILL and b'applied' in out
    identity = read_projection_identity(target)
    assert identity is not None and identity.state == 'rebuilding'
    reader = ProjectionReader.open(target)
    try:
        assert (await reader.status()).state == 'rebuilding'
    finally:
        reader.close()
    code, out, _ = await cli(settings, target, 'status')
    assert code == 0 and 'unfinished rebuild' in out
    _, difference = verify_paths(target, target)
    assert difference is not None and 'unfinished rebuild' in str(difference.left)

    await rebuild(settings, target)  # resumes where it was killed
    identity = read_projection_identity(target)
    assert identity is not None and identity.state == 'rebuilt'
    await rebuild(settings, tmp_path / 'fresh')
    assert verify_paths(target, tmp_path / 'fresh')[1] is None
    with pytest.raises(UsageError, match='not empty'):
        await rebuild(settings, target)
    assert os.path.exists(target / 'shard-0000' / 'CURRENT')
