"""`stepstream` command line: the demo, the projector service, topics, and read-only views.

Every command takes its settings from `STEPSTREAM_*` variables or the matching flags.
"""

# This module parses and dispatches; each command group lives in its own module (`_stack_commands`,
# `_services`, `_log_commands`, `_views`, `_operator`, `_decide`), declared there with its flags.

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from stepstream.cli import (
    _audit,
    _conversations,
    _decide,
    _import,
    _log_commands,
    _operator,
    _replay,
    _services,
    _stack_commands,
    _views,
)
from stepstream.cli._common import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Command,
)
from stepstream.cli._help import SETTINGS_GROUP, ShortUsage, add_help
from stepstream.errors import (
    MediaUnavailable,
    NotFound,
    SchemaRegistryError,
    StepStreamError,
    StepStreamUnavailable,
    UsageError,
)
from stepstream.settings import Settings


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `stepstream` command; returns the exit code (see `EXIT_*`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's usage and the closest flag, not the top-level usage
        _unknown(getattr(args, 'subparser', parser), extra)
    if hasattr(args, 'helper'):  # `stepstream help ...`: no settings read, no stack looked for
        return int(args.helper(args.topic, main))
    if not hasattr(args, 'command'):
        parser.print_help()
        return EXIT_USAGE
    try:
        from stepstream.cli._paths import check_setting_files
        from stepstream.cli.stack import running_stack, stack_environ

        named = any(word == '--stack-dir' or word.startswith('--stack-dir=') for word in argv)
        if named and not getattr(args, 'makes_stack', False):
            running_stack(args.stack_dir)  # a folder given is a running stack, or exit 2 saying so
        settings = Settings.from_args(args, stack_environ(args.stack_dir))
        check_setting_files(settings)  # a TLS or CA file named is there, or exit 2 saying which
        asks = getattr(args, 'view', None) is not None and not getattr(
            args, 'all', False
        )  # --all streams here
        if asks and (answered := _ask_service(args, settings)) is not None:
            return answered
        import asyncio
        import logging

        # Our errors say what a client library would log on the way (connection refused, ...);
        # the projector service configures its own logging.
        logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(levelname)s %(name)s: %(message)s')
        if args.command is not _services.projector_service:
            logging.getLogger('aiokafka').setLevel(logging.CRITICAL)
        return asyncio.run(args.command(args, settings))
    except (UsageError, ValueError) as exc:
        return _fail(exc, EXIT_USAGE)
    except SchemaRegistryError as exc:  # a refusal is no outage: 1, not 3
        return _fail(exc, EXIT_FAILED if exc.refused else EXIT_UNAVAILABLE)
    except (StepStreamUnavailable, MediaUnavailable) as exc:
        return _fail(exc, EXIT_UNAVAILABLE)
    except (StepStreamError, LookupError) as exc:
        return _fail(exc, EXIT_FAILED)
    except BrokenPipeError:
        # Nothing more can be written; point stdout at /dev/null so the interpreter's final
        # flush does not raise again.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _ask_service(args: argparse.Namespace, settings: Settings) -> int | None:
    """A console view answered by the read service (`_remote`), or None to read the projection here."""
    from stepstream.cli import _remote
    from stepstream.console import ViewArgs

    url = _remote.service_url(args.stack_dir, settings)
    if url is None:
        return None
    answer = _remote.ask(url, args.view, ViewArgs.of(args).query(), settings.serve)
    if answer is None:
        return None
    if not answer.ok:
        return _fail(NotFound(answer.text), EXIT_FAILED)
    print(answer.text)
    return EXIT_OK


def _unknown(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exit 2 naming what was not understood, in the subcommand's usage, with the closest flag."""
    import difflib

    flags = [flag for action in parser._actions for flag in action.option_strings]
    hints = []
    for word in extra:
        if word.startswith('-'):
            close = difflib.get_close_matches(word.split('=', 1)[0], flags, n=1, cutoff=0.6)
            if close:
                hints.append(f'{word}: did you mean {close[0]}?')
    parser.error(f'unrecognized arguments: {" ".join(extra)}' + (f' ({"; ".join(hints)})' if hints else ''))


def _fail(exc: BaseException, code: int) -> int:
    print(f'stepstream: {exc}', file=sys.stderr)
    return code


def _parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; given the `argv` it will parse, only what that needs of it.

    Each command's settings flags, with their help from `Settings`' docstrings, are what a parser
    costs; with `argv`, only the command it names gets them, and their help only with `--help`.
    """
    from stepstream.cli.stack import DEFAULT_STACK_DIR

    wanted = next((word for word in argv if not word.startswith('-')), None) if argv is not None else None
    documented = argv is None or any(word in ('-h', '--help') for word in argv)

    parser = argparse.ArgumentParser(
        prog='stepstream',
        allow_abbrev=False,
        description=__doc__,
        epilog=(
            'Exit codes: 0 ok; 1 not found, different, behind or failed; 2 usage error; '
            '3 Kafka or S3 unavailable; 130 interrupted; 141 output pipe closed.'
        ),
    )
    parser.add_argument('--version', action=_Version, nargs=0, help="show the program's version and exit")
    sub = parser.add_subparsers(metavar='COMMAND')

    def command(name: str, fn: Command, help_text: str, *, parent: Any = None) -> argparse.ArgumentParser:
        # No abbreviations: a prefix must never pass for a longer flag.
        p = (parent or sub).add_parser(
            name, help=help_text, description=help_text, allow_abbrev=False, formatter_class=ShortUsage
        )
        if wanted is None or name == wanted or parent is not None:
            Settings.add_arguments(p, documented=documented, title=SETTINGS_GROUP)
        p.add_argument(
            '--stack-dir',
            default=DEFAULT_STACK_DIR,
            metavar='DIR',
            help='read settings from the stack running there (`stepstream stack up`); '
            f'flags and STEPSTREAM_* variables win (default: {DEFAULT_STACK_DIR})',
        )
        p.set_defaults(command=fn, subparser=p)
        return p

    _stack_commands.add_commands(command, sub)
    _services.add_commands(command)
    _log_commands.add_commands(command)
    _views.add_commands(command)
    _conversations.add_commands(command, sub)
    _operator.add_commands(command)
    _decide.add_commands(command)
    _import.add_commands(command)
    _audit.add_commands(command, sub)
    _replay.add_commands(command)
    add_help(sub)
    return parser


class _Version(argparse.Action):
    """`--version`: the installed distribution's version, looked up only when asked for."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version('stepstream')
        except PackageNotFoundError:
            found = 'unknown'
        print(f'{parser.prog} {found}')
        parser.exit()
