"""`stepstream` command line: the demo, the projector service, topics, and read-only views.

Every command takes its settings from `STEPSTREAM_*` variables or the matching flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from stepstream.errors import (
    MediaUnavailable,
    NotFound,
    SchemaRegistryError,
    StepStreamError,
    StepStreamUnavailable,
    UsageError,
)
from stepstream.settings import Settings

if TYPE_CHECKING:
    from stepstream.projector import ProjectionReader
    from stepstream.schemas import RunRecord

Command = Callable[[argparse.Namespace, Settings], Awaitable[int]]
T = TypeVar('T')

RUN_STATUSES = ('running', 'stale', 'completed', 'failed', 'cancelled')


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `stepstream` command; returns the exit code (see `EXIT_*`)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's usage and the closest flag, not the top-level usage
        _unknown(getattr(args, 'subparser', parser), extra)
    if not hasattr(args, 'command'):
        parser.print_help()
        return EXIT_USAGE
    # Our errors say what a client library would log on the way (connection refused, ...);
    # the projector service configures its own logging.
    logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(levelname)s %(name)s: %(message)s')
    if args.command is not _projector:
        logging.getLogger('aiokafka').setLevel(logging.CRITICAL)
    try:
        from stepstream.cli.stack import stack_environ

        settings = Settings.from_args(args, stack_environ(args.stack_dir))
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


def _parser() -> argparse.ArgumentParser:
    from stepstream.cli.stack import DEFAULT_STACK_DIR

    parser = argparse.ArgumentParser(
        prog='stepstream',
        allow_abbrev=False,
        description=__doc__,
        epilog=(
            'Exit codes: 0 ok; 1 not found, different, behind or failed; 2 usage error; '
            '3 Kafka or S3 unavailable; 130 interrupted; 141 output pipe closed.'
        ),
    )
    parser.add_argument('--version', action='version', version=f'%(prog)s {_version()}')
    sub = parser.add_subparsers(metavar='COMMAND')

    def command(name: str, fn: Command, help_text: str, *, parent: Any = sub) -> argparse.ArgumentParser:
        # No abbreviations: a prefix must never pass for a longer flag.
        p = parent.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        Settings.add_arguments(p)
        p.add_argument(
            '--stack-dir',
            default=DEFAULT_STACK_DIR,
            metavar='DIR',
            help='read settings from the stack running there (`stepstream stack up`); '
            f'flags and STEPSTREAM_* variables win (default: {DEFAULT_STACK_DIR})',
        )
        p.set_defaults(command=fn, subparser=p)
        return p

    demo = command('demo', _demo, 'Run the multi-agent demo on the embedded stack (started if it is not up).')
    demo.add_argument(
        '--serve',
        action='store_true',
        help='kept for old scripts: the stack serves the run explorer already (its URL is printed)',
    )

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
    command('down', _stack_down, 'Stop the stack; its log and projection stay on disk.', parent=stack_sub)
    command('env', _stack_env, 'Print `export STEPSTREAM_...` lines for the running stack.', parent=stack_sub)

    projector = command('projector', _projector, 'Run the projector service until SIGTERM or Ctrl-C.')
    projector.add_argument(
        '--max-batch-records', type=int, default=5000, help='most records applied in one RocksDB batch'
    )
    projector.add_argument(
        '--max-snapshots-per-run',
        type=int,
        default=None,
        help='keep the newest N snapshots of each run readable (and the newest complete)',
    )
    projector.add_argument(
        '--group',
        metavar='NAME',
        help='join this consumer group as a member: own the shards of the partitions it assigns',
    )
    projector.add_argument(
        '--checkpoint-interval',
        type=float,
        default=60.0,
        metavar='SECONDS',
        help='with --group: upload each owned shard to S3 this often (0: never), restore from there',
    )
    projector.add_argument(
        '--session-timeout',
        type=float,
        default=10.0,
        metavar='SECONDS',
        help='with --group: how long the group waits for a silent member before moving its partitions',
    )

    rebuild = command(
        'rebuild', _rebuild, 'Replay both topics from offset zero into a new projection directory.'
    )
    rebuild.add_argument(
        '--into', required=True, help='a new or empty directory, or an unfinished rebuild to resume'
    )
    rebuild.add_argument(
        '--max-snapshots-per-run', type=int, default=None, help='as for `stepstream projector`'
    )
    rebuild.add_argument('--like', metavar='PATH', help='copy the options of the projection at PATH')
    rebuild.add_argument('--jobs', type=int, default=1, metavar='N', help='rebuild the shards in N processes')

    verify = command('verify', _verify, 'Compare two projections; print the first difference.')
    verify.add_argument('left', help='a projection directory')
    verify.add_argument('right', help='another projection directory')

    status = command(
        'status', _status, 'Per-partition lag, records applied per second, DLQ count (exit 1 if behind).'
    )
    status.add_argument(
        '--max-lag',
        type=int,
        default=None,
        metavar='N',
        help='exit 1 when more than N records are not applied yet (a health check)',
    )

    export = command(
        'export',
        _export,
        'Write the projection as Parquet tables (runs, events, model_requests, tool_effects, messages), '
        'partitioned by date, for DuckDB and friends.',
    )
    export.add_argument('--format', choices=['parquet'], default='parquet', help='the file format (Parquet)')
    export.add_argument(
        '--out', required=True, help="a directory, or s3://BUCKET/PREFIX in the settings' S3 endpoint"
    )
    export.add_argument(
        '--from-topics',
        action='store_true',
        help='read the topics from offset zero (a rebuild into a temporary projection), not --db-path',
    )
    export.add_argument(
        '--since',
        metavar='PATH_OR_MARK',
        help='an earlier export (its directory, s3://BUCKET/PREFIX or _stepstream_export.json): write only '
        'what changed after it (into that same --out: adds files; elsewhere: just the new rows)',
    )

    topics = command('topics', _topics, 'Create the topics (idempotent) and check they are co-partitioned.')
    topics.add_argument('action', choices=['ensure'], help='ensure: create what is missing, then check')

    schemas = command(
        'schemas',
        _schemas,
        'Register every committed schema version, in order, in the schema registry (registry mode).',
    )
    schemas.add_argument(
        'action',
        choices=['register'],
        help="register: set each topic subject's compatibility, then register its versions oldest first",
    )
    schemas.add_argument(
        '--compatibility',
        default='FULL_TRANSITIVE',
        help="the subjects' compatibility level (default FULL_TRANSITIVE: every version reads every other)",
    )

    runs = command('runs', _runs, 'List runs, in the order they started.')
    runs.add_argument('--conversation-id', help='only runs of this conversation')
    runs.add_argument('--parent-run-id', help='only direct children of this run')
    runs.add_argument('--status', choices=RUN_STATUSES, help='only runs in this status')
    runs.add_argument('--agent-name', help='only runs of this agent')

    tree = command('tree', _tree, 'Show a run and all its descendants.')
    tree.add_argument('run_id', help='the root of the tree')
    events = command('events', _events, "List a run's events in seq order.")
    events.add_argument('run_id', help='the run')
    snapshot = command('snapshot', _snapshot, "Show a run's latest snapshot.")
    snapshot.add_argument('run_id', help='the run')
    snapshot.add_argument(
        '--include-interrupted', action='store_true', help='the latest of any state, not the latest complete'
    )
    effects = command(
        'effects', _effects, "List a run's tool-effect ledger: each call's status and every resolution."
    )
    effects.add_argument('run_id', help='the run')
    unresolved = command(
        'unresolved',
        _unresolved,
        'List tool calls that have not ended: in_flight (run live) or unknown_after_crash, with run status.',
    )
    unresolved.add_argument('run_id', nargs='?', help='only this run (default: every run)')
    conflicts = command('conflicts', _conflicts, 'List run ids claimed by more than one writer.')

    resolve = command(
        'resolve',
        _resolve,
        'Resolve an unknown_after_crash tool effect: say whether its side effect happened, and why.',
    )
    resolve.add_argument('run_id', help='the run')
    resolve.add_argument('tool_call_id', help='the tool call whose effect is unknown_after_crash')
    answer = resolve.add_mutually_exclusive_group(required=True)
    answer.add_argument(
        '--happened',
        dest='resolution',
        action='store_const',
        const='happened',
        help='the side effect happened',
    )
    answer.add_argument(
        '--did-not-happen',
        dest='resolution',
        action='store_const',
        const='did_not_happen',
        help='the side effect did not happen',
    )
    resolve.add_argument(
        '--note', required=True, help='why: what you checked (kept in the log with your name)'
    )
    resolve.add_argument(
        '--force',
        action='store_true',
        help='resolve a call still in flight (its run is live): only when you know its process is gone',
    )

    retention = _retention_commands(command)

    for p in (runs, tree, events, snapshot, effects, unresolved, conflicts, status, resolve, retention):
        p.add_argument('--json', action='store_true', help='machine-readable output')

    # -- forget (erasure by crypto-shredding, decision 0033) --
    forget = command(
        'forget',
        _forget,
        "Erase a conversation's content and media: destroy its keys (the log's structure stays).",
    )
    forget.add_argument('--conversation', required=True, metavar='ID', help='the conversation to erase')
    forget.add_argument('--json', action='store_true', help='machine-readable output')

    serve = command('serve', _serve, 'Serve the projection over HTTP: a JSON API and the run explorer.')
    serve.add_argument(
        '--host', default='127.0.0.1', help='address to bind (beyond loopback: needs STEPSTREAM_SERVE_TOKEN)'
    )
    serve.add_argument('--port', type=int, default=8321, help='port to listen on')
    serve.add_argument(
        '--group',
        metavar='NAME',
        help='also be a projector member of this consumer group: serve its shards and answer for '
        "the other members' (each a `stepstream serve --group NAME`)",
    )
    serve.add_argument(
        '--advertise',
        metavar='URL',
        help='with --group: the URL the other members reach this one at (default: http://HOST:PORT)',
    )
    serve.add_argument(
        '--checkpoint-interval',
        type=float,
        default=60.0,
        metavar='SECONDS',
        help='as for `stepstream projector`',
    )
    serve.add_argument(
        '--session-timeout', type=float, default=10.0, metavar='SECONDS', help='as for `stepstream projector`'
    )
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version('stepstream')
    except PackageNotFoundError:
        return 'unknown'


async def _demo(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.demo import run_demo
    from stepstream.cli.stack import stack_environ, stack_up

    running = await asyncio.to_thread(stack_up, args.stack_dir, broker=None, quiet=True)
    # As every command: flags, then variables, then the stack's settings (now that it is up).
    demo_settings = Settings.from_args(args, stack_environ(args.stack_dir))
    await run_demo(demo_settings, stack_dir=args.stack_dir)
    if running.explorer_url is not None:
        print(f'\nRun explorer (served by the stack): {running.explorer_url}')
    return EXIT_OK


async def _stack_up(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.stack import running_stack, stack_up

    with contextlib.suppress(UsageError):
        print(f'already running: {running_stack(args.stack_dir).describe()}')
        return EXIT_OK
    running = await asyncio.to_thread(stack_up, args.stack_dir, broker=args.broker)
    print(running.describe())
    return EXIT_OK


async def _stack_down(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.stack import stack_down

    print(await asyncio.to_thread(stack_down, args.stack_dir))
    return EXIT_OK


async def _stack_env(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.stack import running_stack

    print(running_stack(args.stack_dir).export_lines())
    return EXIT_OK


async def _projector(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.kafka_client import broker_answers
    from stepstream.projector import Checkpoints, Projector
    from stepstream.service_log import BrokerLossLog

    loss = BrokerLossLog(settings.bootstrap_servers)
    for handler in logging.getLogger().handlers:
        handler.addFilter(loss)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    checkpoints = None
    if args.group is not None and args.checkpoint_interval > 0:
        checkpoints = Checkpoints.from_settings(
            settings, group=args.group, interval_s=args.checkpoint_interval
        )
    projector_settings = {
        'max_batch_records': args.max_batch_records,
        'max_snapshots_per_run': args.max_snapshots_per_run,
        'group': args.group,
        'checkpoints': checkpoints,
        'session_timeout_ms': int(args.session_timeout * 1000),
    }
    told: set[int] = set()

    def tell(owned: list[int]) -> None:
        for partition, records in sorted(projector.restored_from_checkpoint.items()):
            if partition not in told:
                told.add(partition)
                print(
                    f'projector: restored shard {partition} from a checkpoint of {records} records',
                    flush=True,
                )
        print(f'projector: owns partitions {owned}', flush=True)

    async with Projector(settings, **projector_settings, on_assignment=tell) as projector:
        member = f' (member of {args.group})' if args.group else ''
        print(f'projector: {settings.bootstrap_servers} -> {projector.db_path}{member}', flush=True)
        stopping = asyncio.create_task(stop.wait())
        running = asyncio.create_task(projector.join())
        while not (stopping.done() or running.done()):
            await asyncio.wait([stopping, running], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if loss.pending:
                loss.checked(await broker_answers(settings))
        if running.done():  # the loop ended without being asked to: it failed, and leaving the
            stopping.cancel()  # `async with` raises its error, which main() prints (exit code 1)
            return EXIT_FAILED
        away = loss.summary()
        print(
            f'projector: stopping after {projector.records_applied} records' + (f' ({away})' if away else ''),
            flush=True,
        )
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    return EXIT_OK


async def _serve(args: argparse.Namespace, settings: Settings) -> int:
    try:
        from stepstream.serve import app_for, check_binding, running
    except ImportError as exc:
        raise UsageError(
            f"stepstream serve needs its extra: pip install 'stepstream[serve]' ({exc})"
        ) from None

    check_binding(args.host, settings)
    if args.group is not None:
        return await _serve_member(args, settings)
    async with running(app_for(settings), host=args.host, port=args.port) as served:
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, served.stop)
        print(
            f'stepstream serve: explorer at {served.url}/ (API under /api, its docs at /docs)',
            flush=True,
        )
        await served.wait()
    return EXIT_OK


async def _serve_member(args: argparse.Namespace, settings: Settings) -> int:
    """`serve --group`: a projector member that serves its shards and answers for the group."""
    from stepstream.projector import Checkpoints, Membership, Projector
    from stepstream.serve import app_for, listen, running, url_of

    if args.advertise is None and args.host in ('0.0.0.0', '::', '[::]'):
        raise UsageError(f'--host {args.host} is no address another member can reach: give --advertise URL')
    sock = listen(args.host, args.port)
    membership = Membership(endpoint=args.advertise or url_of(sock))
    checkpoints = None
    if args.checkpoint_interval > 0:
        checkpoints = Checkpoints.from_settings(
            settings, group=args.group, interval_s=args.checkpoint_interval
        )
    member = Projector(
        settings,
        group=args.group,
        membership=membership,
        checkpoints=checkpoints,
        session_timeout_ms=int(args.session_timeout * 1000),
    )
    async with (
        member,
        running(app_for(settings, reader=member.reader(), membership=membership), sock=sock) as served,
    ):
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, served.stop)
        print(
            f'stepstream serve: explorer at {served.url}/ (member of {args.group}, '
            f'advertised as {membership.endpoint})',
            flush=True,
        )
        serving = asyncio.create_task(served.wait())
        consuming = asyncio.create_task(member.join())
        await asyncio.wait([serving, consuming], return_when=asyncio.FIRST_COMPLETED)
        if consuming.done():  # the member failed: its error leaves the `async with` (exit 1)
            served.stop()
            await serving
            consuming.result()
            return EXIT_FAILED
        consuming.cancel()
    return EXIT_OK


async def _rebuild(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.projector import progress_bar, rebuild

    end = await rebuild(
        settings,
        args.into,
        max_snapshots_per_run=args.max_snapshots_per_run,
        like=args.like,
        on_progress=progress_bar(),
        jobs=args.jobs,
    )
    print(f'rebuilt {sum(end.values())} records into {args.into}')
    return EXIT_OK


async def _export(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.analytics import export_parquet, read_mark
    from stepstream.projector import progress_bar, rebuild

    mark = read_mark(args.since, settings) if args.since else None  # a bad mark fails before any work
    with tempfile.TemporaryDirectory(prefix='stepstream-export-') as scratch:
        if args.from_topics:  # the one replay of the log there is, into a projection thrown away after
            settings = settings.replace(db_path=str(Path(scratch) / 'projection'))
            await rebuild(settings, settings.db_path, on_progress=progress_bar())
        async with _reader(settings) as reader:
            report = await export_parquet(reader, args.out, settings, since=mark)
    counts = ', '.join(f'{rows} {table}' for table, rows in report.rows.items())
    since = f' (export {report.export_seq}, since {args.since})' if mark is not None else ''
    print(f'exported {counts} to {args.out}{since}')
    if report.unreadable_histories:
        print(
            f'{len(report.unreadable_histories)} run(s) have no messages rows: their snapshots cannot be '
            f'replayed (a gap in the log): {", ".join(report.unreadable_histories[:10])}',
            file=sys.stderr,
        )
    if report.erased_histories:
        print(f'{len(report.erased_histories)} run(s) have no messages rows: their content was erased')
    if report.sealed_histories:
        first = next(iter(report.sealed_histories.values()))
        key = (
            'STEPSTREAM_ERASURE_KEY is not set'
            if settings.erasure_key is None
            else 'STEPSTREAM_ERASURE_KEY is not the key-encryption key their writers used'
        )
        print(
            f'the export is incomplete: {len(report.sealed_histories)} run(s) have no messages rows because '
            f"their content is sealed and {key} ({first}). Export again with the writers' "
            'STEPSTREAM_ERASURE_KEY',
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


async def _verify(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.projector import verify_paths

    equal, difference = await asyncio.to_thread(verify_paths, args.left, args.right)
    if difference is not None:
        print(f'projections differ after {equal} equal items; {difference}')
        return EXIT_FAILED
    print(f'projections are identical ({equal} items)')
    return EXIT_OK


async def _status(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.render import status_json, status_text
    from stepstream.topics import ensure_topics, log_end_offsets

    async with _reader(settings) as reader:
        status = await reader.status()
    layout = await ensure_topics(settings, create=False)
    applied = {
        (topic, p): status.offsets.get((topic, p), 0)
        for topic in (settings.step_events_topic, settings.tool_effects_topic)
        for p in range(layout.partitions)
    }
    ends = await log_end_offsets(settings, applied)
    print(status_json(status, applied, ends) if args.json else status_text(status, applied, ends, settings))
    lag = sum(max(ends[tp] - offset, 0) for tp, offset in applied.items())
    if args.max_lag is not None and lag > args.max_lag:
        print(
            f'stepstream: the projection is {lag} records behind (more than --max-lag {args.max_lag})',
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


async def _topics(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.topics import ensure_topics

    layout = await ensure_topics(settings)
    print(
        f'{settings.step_events_topic}, {settings.tool_effects_topic}, {settings.dlq_topic}: '
        f'{layout.partitions} partitions each'
    )
    if settings.erasure_key is not None:  # erasure on: the compacted key topic too (decision 0033)
        from stepstream.erasure import ensure_key_topic, key_topic

        await ensure_key_topic(settings)
        print(f'{key_topic(settings)}: compacted, the conversation keys')
    return EXIT_OK


async def _schemas(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.schema_registry import SchemaRegistry
    from stepstream.schemas import STEP_EVENT_SCHEMA, TOOL_EFFECT_SCHEMA, load_schema_versions, subject_of

    if settings.schema_registry_url is None:
        raise UsageError('no schema registry: set STEPSTREAM_SCHEMA_REGISTRY_URL (--schema-registry-url)')
    versions = load_schema_versions()
    topics = {settings.step_events_topic: STEP_EVENT_SCHEMA, settings.tool_effects_topic: TOOL_EFFECT_SCHEMA}
    async with SchemaRegistry(settings) as registry:
        for topic, newest in topics.items():
            subject = subject_of(topic)
            ids = await registry.register_history(subject, versions[newest.name], args.compatibility)
            listed = ', '.join(f'v{v.version}={i}' for v, i in zip(versions[newest.name], ids, strict=True))
            print(f'{subject} ({args.compatibility}): {listed}')
    return EXIT_OK


@contextlib.asynccontextmanager
async def _reader(settings: Settings) -> AsyncIterator[ProjectionReader]:
    from stepstream.media import S3MediaStore
    from stepstream.projector import ProjectionReader as Reader

    keys = None
    if settings.erasure_key is not None:  # erasure on: sealed content opens with the key topic's keys
        from stepstream.erasure import KeyRing

        keys = KeyRing(settings)
    reader = Reader.open(
        settings.db_path,
        media_store=S3MediaStore.from_settings(settings),
        stale_after_s=settings.stale_after_s,
        keys=keys,
    )
    try:
        yield reader
    finally:
        reader.close()
        if keys is not None:
            await keys.close()


async def _known_run(reader: ProjectionReader, run_id: str, settings: Settings) -> RunRecord:
    """The run, or `NotFound`: every view of one run fails the same way for an unknown id."""
    run = await reader.get_run(run_id)
    if run is None:
        started = await reader.expired(run_id)
        if started is not None:
            raise NotFound(
                f'run {run_id!r} (started {started.isoformat()}) ended long ago and was dropped by the '
                f'retention policy of {settings.db_path} (`stepstream retention`); the log may still hold it'
            )
        raise NotFound(f'no run {run_id!r} in the projection at {settings.db_path}')
    return run


async def _show(
    args: argparse.Namespace,
    settings: Settings,
    fetch: Callable[[ProjectionReader], Awaitable[T]],
    render: Callable[[T], str],
    *,
    run_id: str | None = None,
) -> int:
    """Run one query on the projection and print it as a table, or as JSON with --json.

    With `run_id`, an unknown run is `NotFound` (exit 1) rather than an empty view.
    """
    from stepstream.cli.render import to_json

    async with _reader(settings) as reader:
        if run_id is not None:
            await _known_run(reader, run_id, settings)
        value = await fetch(reader)
    print(to_json(value) if args.json else render(value))
    return EXIT_OK


async def _runs(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.render import runs_table

    def fetch(reader: ProjectionReader) -> Awaitable[list[RunRecord]]:
        return reader.list_runs(
            conversation_id=args.conversation_id,
            parent_run_id=args.parent_run_id,
            status=args.status,
            agent_name=args.agent_name,
        )

    return await _show(args, settings, fetch, runs_table)


async def _tree(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.render import tree

    return await _show(args, settings, lambda r: r.run_tree(args.run_id), tree, run_id=args.run_id)


async def _events(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.render import events_table

    return await _show(args, settings, lambda r: r.list_events(args.run_id), events_table, run_id=args.run_id)


async def _snapshot(args: argparse.Namespace, settings: Settings) -> int:
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    async with _reader(settings) as reader:
        await _known_run(reader, args.run_id, settings)
        snap = await reader.latest_snapshot(args.run_id, include_interrupted=args.include_interrupted)
    if snap is None:
        which = 'snapshot' if args.include_interrupted else 'complete snapshot (try --include-interrupted)'
        raise NotFound(f'run {args.run_id!r} has no {which} in the projection at {settings.db_path}')
    if snap.erased and args.json:
        erased = {
            'run_id': snap.run_id,
            'snapshot_seq': snap.snapshot_seq,
            'state': snap.state,
            'step_index': snap.step_index,
            'erased': True,
            'messages': [],
        }
        print(json.dumps(erased, indent=2))
    elif snap.erased:
        print(
            f'snapshot {snap.snapshot_seq} of {snap.run_id}: {snap.state}, step {snap.step_index}, '
            'content erased'
        )
    elif args.json:
        print(ModelMessagesTypeAdapter.dump_json(snap.messages, indent=2).decode())
    else:
        from stepstream.cli.render import messages_text

        print(
            f'snapshot {snap.snapshot_seq} of {snap.run_id}: {snap.state}, step {snap.step_index}, '
            f'{len(snap.messages)} messages'
        )
        print(messages_text(snap.messages))
    return EXIT_OK


async def _effects(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.render import ledger

    return await _show(args, settings, lambda r: r.list_tool_effects(args.run_id), ledger, run_id=args.run_id)


async def _unresolved(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.render import UnresolvedEffect, unresolved_table

    async def fetch(reader: ProjectionReader) -> list[UnresolvedEffect]:
        effects = await reader.list_unresolved_tool_effects(args.run_id)
        statuses: dict[str, str] = {}
        for effect in effects:
            if effect.run_id not in statuses:
                run = await reader.get_run(effect.run_id)
                statuses[effect.run_id] = run.status if run is not None else 'unknown'
        return [UnresolvedEffect(effect, statuses[effect.run_id]) for effect in effects]

    return await _show(args, settings, fetch, unresolved_table, run_id=args.run_id)


async def _resolve(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.render import to_json
    from stepstream.producer import EventLog, resolve_tool_effect, resolver_id

    async with _reader(settings) as reader:
        await _known_run(reader, args.run_id, settings)
        effect = await reader.get_tool_effect(args.run_id, args.tool_call_id)
    if effect is None:
        raise NotFound(
            f'run {args.run_id!r} has no tool call {args.tool_call_id!r} '
            f'in the projection at {settings.db_path}'
        )
    async with EventLog(settings, create_topics=False) as log:
        record = await resolve_tool_effect(
            log,
            effect,
            resolution=args.resolution,
            note=args.note,
            operator=settings.operator_name,
            writer_id=resolver_id('cli'),
            force=args.force,
        )
    if args.json:
        print(to_json(record))
    else:
        print(
            f'resolved {record.tool_call_id} of {record.run_id} as {record.resolution} '
            f'by {record.resolved_by} '
            f'(written to {settings.tool_effects_topic}; views show it once the projector applies it)'
        )
    return EXIT_OK


async def _forget(args: argparse.Namespace, settings: Settings) -> int:
    """`stepstream forget --conversation ID` (decision 0033)."""
    from stepstream.cli.render import to_json
    from stepstream.forget import forget_conversation
    from stepstream.media import S3MediaStore

    async with _reader(settings) as reader:
        report = await forget_conversation(
            settings, args.conversation, reader=reader, media_store=S3MediaStore.from_settings(settings)
        )
    if not report.keys_destroyed and not report.runs:
        raise NotFound(
            f'conversation {args.conversation!r} has no key on {settings.topic_prefix}.conversation-keys '
            f'and no run in the projection at {settings.db_path}: nothing to forget'
        )
    if args.json:
        print(to_json(report))
    else:
        print(
            f'forgot conversation {report.conversation_id!r}: {len(report.keys_destroyed)} key(s) destroyed, '
            f'{len(report.runs)} run(s) keep their structure, {len(report.media_deleted)} media payload(s) '
            f'deleted, {len(report.media_kept)} not. Readers show its content as erased from their next '
            'read; on Apache Kafka, compaction removes the key records (see '
            'docs/decisions/0033-erasure-by-crypto-shredding.md)'
        )
        for uri in report.media_deleted:
            print(f'  deleted  {uri}')
        for uri, reason in sorted(report.media_kept.items()):
            print(f'  kept     {uri}: {reason}')
    return EXIT_FAILED if report.failed else EXIT_OK


async def _conflicts(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.render import table

    def render(runs: list[RunRecord]) -> str:
        rows = [(r.run_id, r.registration_id, ', '.join(r.conflicting_writers)) for r in runs]
        return table(['run_id', 'registered_by', 'conflicting_writers'], rows)

    return await _show(args, settings, lambda reader: reader.list_conflicts(), render)


# -- retention (docs/retention.md, decision 0032) ----------------------------------------------


def _retention_commands(command: Callable[..., argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """`stepstream retention [show|sweep-media]`: the policy, what it keeps and dropped; the media sweep."""
    retention = command(
        'retention',
        _retention,
        'Show the retention policy (STEPSTREAM_RETAIN_ENDED_DAYS) and, per shard, its log clock, cut-off, '
        'ended runs kept and runs dropped; or sweep-media: delete payloads no kept run references.',
    )
    retention.add_argument(
        'action',
        nargs='?',
        choices=['show', 'sweep-media'],
        default='show',
        help='show (default) or sweep-media',
    )
    retention.add_argument(
        '--grace-hours',
        type=float,
        default=24.0,
        metavar='HOURS',
        help='sweep-media: delete only payloads older than this (default 24; more than 1)',
    )
    retention.add_argument('--dry-run', action='store_true', help='sweep-media: list, delete nothing')
    retention.add_argument(
        '--preview-days',
        type=float,
        metavar='DAYS',
        help='show: what a policy of DAYS would drop from this projection now (before rebuilding with it)',
    )
    retention.add_argument(
        '--catch-up-timeout',
        type=float,
        default=120.0,
        metavar='SECONDS',
        help='sweep-media: how long to wait for the projection to apply the log up to its current end',
    )
    return retention


async def _retention(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.cli.render import preview_text, retention_text, to_json

    async with _reader(settings) as reader:
        if args.action == 'sweep-media':
            return await _sweep_media(args, settings, reader)
        if args.preview_days is not None:
            if not args.preview_days > 0:
                raise UsageError(f'--preview-days must be a positive number of days, got {args.preview_days}')
            preview = await reader.retention_preview(round(args.preview_days * 86_400_000_000))
            print(to_json(preview) if args.json else preview_text(args.preview_days, preview))
            return EXIT_OK
        policy, shards = await reader.retention()
    print(
        to_json({'retain_ended_us': policy, 'shards': shards})
        if args.json
        else retention_text(policy, shards)
    )
    return EXIT_OK


async def _sweep_media(args: argparse.Namespace, settings: Settings, reader: ProjectionReader) -> int:
    from datetime import timedelta

    from stepstream.cli.render import sweep_text, to_json
    from stepstream.media import S3MediaStore
    from stepstream.projector._sweep import sweep_media
    from stepstream.topics import ensure_topics, log_end_offsets

    layout = await ensure_topics(settings, create=False)
    applied = await _applied(reader, settings, layout.partitions)
    ends = await log_end_offsets(settings, applied)
    deadline = asyncio.get_running_loop().time() + args.catch_up_timeout
    while any(applied[tp] < end for tp, end in ends.items()):
        if asyncio.get_running_loop().time() > deadline:
            behind = sum(max(end - applied[tp], 0) for tp, end in ends.items())
            print(
                f'stepstream: the projection at {settings.db_path} is {behind} records behind the log '
                f'after {args.catch_up_timeout:g}s, and a sweep needs every record written before it '
                'applied: is the projector running? Nothing was deleted',
                file=sys.stderr,
            )
            return EXIT_FAILED
        await asyncio.sleep(0.5)
        applied = await _applied(reader, settings, layout.partitions)
    report = await sweep_media(
        reader,
        S3MediaStore.from_settings(settings),
        grace=timedelta(hours=args.grace_hours),
        dry_run=args.dry_run,
    )
    print(to_json(report) if args.json else sweep_text(report))
    return EXIT_OK


async def _applied(
    reader: ProjectionReader, settings: Settings, partitions: int
) -> dict[tuple[str, int], int]:
    offsets = (await reader.status()).offsets
    topics = (settings.step_events_topic, settings.tool_effects_topic)
    return {(t, p): offsets.get((t, p), 0) for t in topics for p in range(partitions)}
