"""The commands that start things for a user: `demo` and `stack up|down|env` (decision 0030)."""

from __future__ import annotations

import argparse
from typing import Any

from stepstream.cli._common import EXIT_OK, Declare
from stepstream.errors import UsageError
from stepstream.settings import Settings


def add_commands(command: Declare, sub: Any) -> None:
    """Declare `demo` and `stack up|down|env`."""
    demo = command('demo', _demo, 'Run the multi-agent demo on the embedded stack (started if it is not up).')
    demo.add_argument(
        '--serve',
        action='store_true',
        help='kept for old scripts: the stack serves the run explorer already (its URL is printed)',
    )
    demo.set_defaults(makes_stack=True)  # `--stack-dir` names where it starts one

    stack = sub.add_parser(
        'stack',
        help='Keep an embedded Kafka + S3 running in the background (`stack up|down|env`).',
        description='An embedded Tansu (or Apache Kafka) + SeaweedFS stack that outlives the command, '
        'under --stack-dir; every stepstream command run here picks up its settings.',
    )
    stack_sub = stack.add_subparsers(metavar='ACTION', required=True)
    up = command(
        'up', _stack_up, 'Start the stack in the background (or report the one running).', parent=stack_sub
    )
    up.add_argument(
        '--broker', choices=['tansu', 'kafka'], default=None, help='the embedded broker (default: tansu)'
    )
    down = command(
        'down', _stack_down, 'Stop the stack; its log and projection stay on disk.', parent=stack_sub
    )
    for managing in (up, down):  # they say themselves what is or is not under `--stack-dir`
        managing.set_defaults(makes_stack=True)
    command('env', _stack_env, 'Print `export STEPSTREAM_...` lines for the running stack.', parent=stack_sub)


async def _demo(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    from stepstream.cli.demo import run_demo
    from stepstream.cli.stack import stack_environ, stack_up

    _stack_place(args.stack_dir)
    running = await asyncio.to_thread(stack_up, args.stack_dir, broker=None, quiet=True)
    # As every command: flags, then variables, then the stack's settings (now that it is up).
    demo_settings = Settings.from_args(args, stack_environ(args.stack_dir))
    await run_demo(demo_settings, stack_dir=args.stack_dir, explorer_url=running.explorer_url)
    return EXIT_OK


async def _stack_up(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio
    import contextlib

    from stepstream.cli.stack import running_stack, stack_up

    _stack_place(args.stack_dir)
    with contextlib.suppress(UsageError):
        print(f'already running: {running_stack(args.stack_dir).describe()}')
        return EXIT_OK
    running = await asyncio.to_thread(stack_up, args.stack_dir, broker=args.broker)
    print(running.describe())
    return EXIT_OK


def _stack_place(stack_dir: str) -> None:
    """The folder a stack is started in: in a folder that exists, and not a file (exit 2 otherwise)."""
    from stepstream.cli._paths import to_make

    to_make('--stack-dir', stack_dir, 'folder', 'give a folder to keep the stack in (default: .stepstream)')


async def _stack_down(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    from stepstream.cli.stack import stack_down

    print(await asyncio.to_thread(stack_down, args.stack_dir))
    return EXIT_OK


async def _stack_env(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.stack import running_stack

    print(running_stack(args.stack_dir).export_lines())
    return EXIT_OK
