"""What every command module shares: exit codes, how a command is declared, how the projection is opened.

A command is an `async def name(args, settings) -> int` registered by its module's
`add_commands(command)`, where `command(name, fn, help)` makes its parser with the settings'
flags and `--stack-dir`. The views open the projection one way, `open_reader`; an unknown run
fails as everywhere else, through `ProjectionReader.require_run`.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from stepstream.errors import UsageError
from stepstream.settings import Settings

if TYPE_CHECKING:
    from stepstream.readmodel import ProjectionReader

Command = Callable[[argparse.Namespace, Settings], Awaitable[int]]
"""A subcommand: its parsed arguments and settings in, its exit code out."""

EXIT_OK = 0
EXIT_FAILED = 1
"""Not found, projections differ, lag above `--max-lag`, or any other stepstream error."""
EXIT_USAGE = 2
"""A flag, path or value used wrongly: the message says what to change."""
EXIT_UNAVAILABLE = 3
"""Kafka or S3 did not answer (or refused): the message says which and why."""
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
"""The reader of stdout went away (`stepstream runs --json | head`): 128 + SIGPIPE, like other tools."""


class Declare(Protocol):
    """Declares one subcommand (`_main._parser`'s `command`): its parser, with the settings' flags."""

    def __call__(
        self, name: str, fn: Command, help_text: str, *, parent: argparse._SubParsersAction | None = None
    ) -> argparse.ArgumentParser:
        """The parser of subcommand `name`, which runs `fn` (under `parent`: a nested action)."""
        ...


def add_json(*parsers: argparse.ArgumentParser) -> None:
    """Give each view its `--json` flag."""
    for parser in parsers:
        parser.add_argument('--json', action='store_true', help='machine-readable output')


def add_wide(*parsers: argparse.ArgumentParser) -> None:
    """Give each table view its `--wide` flag: every column, ids in full (default: 120 columns)."""
    for parser in parsers:
        parser.add_argument(
            '--wide',
            action='store_true',
            help='every column, each id and time in full (default: 120 columns)',
        )


@contextlib.asynccontextmanager
async def open_reader(settings: Settings) -> AsyncIterator[ProjectionReader]:
    """`ProjectionReader.from_settings`, imported only by the commands that read the projection.

    With no projection at the default `--db-path` (no flag, no variable, no stack running here),
    `UsageError` says that it is the default, and how to point elsewhere.
    """
    from stepstream.cli._paths import check_projection
    from stepstream.readmodel import ProjectionReader as Reader

    check_default_projection(settings)
    check_projection(settings)
    async with Reader.from_settings(settings) as reader:
        yield reader


def check_default_projection(settings: Settings) -> None:
    """`UsageError` when the projection is looked for at the default path, and is not there."""
    from pathlib import Path

    from stepstream.settings import ProjectionSettings

    where = settings.projection.db_path
    if where != ProjectionSettings().db_path or Path(where).exists():
        return
    raise UsageError(
        f'no projection at {where}, the default --db-path (under {Path.cwd()}), and no stack is running '
        'here: start one with `stepstream stack up` (or `make run` in a checkout), give the folder of a '
        'running stack with --stack-dir DIR, or point at a projection with --db-path DIR (or '
        'STEPSTREAM_DB_PATH)'
    )


def program(argv0: str | None = None, path: str | None = None) -> str:
    """How to type this very `stepstream` here, for the commands a command prints.

    `stepstream` when the PATH finds this program (an activated venv, an installed tool); else its
    path, relative to the working folder when it is under it (`.venv/bin/stepstream` after
    `make run` in a checkout), so that a printed command works when pasted as printed. Run as
    `python -m stepstream.cli` (no program of that name): `stepstream`.
    """
    import os
    import shutil
    import sys
    from pathlib import Path

    me = Path(sys.argv[0] if argv0 is None else argv0)
    if me.name != 'stepstream' or not me.exists():
        return 'stepstream'
    found = shutil.which('stepstream', path=path)
    if found is not None and Path(found).resolve() == me.resolve():
        return 'stepstream'
    mine = me.absolute()
    if not mine.is_relative_to(Path.cwd()):
        return str(mine)
    relative = str(mine.relative_to(Path.cwd()))
    return relative if os.sep in relative else f'.{os.sep}{relative}'
