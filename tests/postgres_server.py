"""A PostgreSQL server of the tests' own: `initdb` into a temporary directory, `postgres` on a free port.

Trust authentication on 127.0.0.1 and a unix socket in the same directory, no fsync; stopped and
removed at the end. PostgreSQL refuses to run as root, and CI runs as root: then `initdb` and the
server run as `nobody` (`setpriv`, which execs in place, so the process the tests stop is the
server itself), in a directory of their own outside pytest's (root-only) temporary tree.
Tests that need it skip, saying why, when the server's binaries or asyncpg are missing.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from processes import HOST, free_port, running


def binaries() -> Path | None:
    """The directory holding `initdb` and `postgres`, or None when PostgreSQL is not installed."""
    found = shutil.which('postgres')
    if found and shutil.which('initdb'):
        return Path(found).resolve().parent
    for candidate in sorted(glob.glob('/usr/lib/postgresql/*/bin'), reverse=True):
        if (Path(candidate) / 'postgres').exists() and (Path(candidate) / 'initdb').exists():
            return Path(candidate)
    return None


def _as_server_user() -> tuple[list[str], int | None, int | None]:
    """The command prefix that drops root (empty when not root), and the uid and gid it drops to."""
    if os.geteuid() != 0:
        return [], None, None
    nobody = pwd.getpwnam('nobody')
    prefix = ['setpriv', f'--reuid={nobody.pw_uid}', f'--regid={nobody.pw_gid}', '--clear-groups', '--']
    return prefix, nobody.pw_uid, nobody.pw_gid


@contextmanager
def postgres_server() -> Iterator[str]:
    """A running server until the block ends; yields the DSN of its `postgres` database (user `postgres`)."""
    pytest.importorskip('asyncpg', reason='asyncpg is not installed (pip install -e ".[dev]")')
    bin_dir = binaries()
    if bin_dir is None:
        pytest.skip('PostgreSQL server binaries (initdb, postgres) are not installed')
    prefix, uid, gid = _as_server_user()
    root = Path(tempfile.mkdtemp(prefix='stepstream-pg-'))
    try:
        if uid is not None and gid is not None:
            os.chown(root, uid, gid)
        data = root / 'data'
        initdb = [*prefix, str(bin_dir / 'initdb'), '-D', str(data)]
        made = subprocess.run(
            [*initdb, '-A', 'trust', '-U', 'postgres', '-E', 'UTF8', '--no-sync'],
            cwd=root,
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            raise RuntimeError(
                f'initdb exited with {made.returncode}: {made.stdout[-2000:]}{made.stderr[-2000:]}'
            )
        port = free_port()
        command = [*prefix, str(bin_dir / 'postgres'), '-D', str(data), '-p', str(port), '-h', HOST]
        command += ['-k', str(root), '-c', 'fsync=off', '-c', 'full_page_writes=off']
        with running(command, root / 'server.log', port=port):
            yield f'postgresql://postgres@{HOST}:{port}/postgres'
    finally:
        shutil.rmtree(root, ignore_errors=True)
