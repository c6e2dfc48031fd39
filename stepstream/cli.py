"""`stepstream` command line: the demo, the projector service, topics, and read-only views.

Every command takes its settings from `STEPSTREAM_*` variables or the matching flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from stepstream.errors import StepStreamError, UsageError
from stepstream.settings import Settings

if TYPE_CHECKING:
    from stepstream.projector import ProjectionReader
    from stepstream.schemas import RunRecord

Command = Callable[[argparse.Namespace, Settings], Awaitable[int]]
T = TypeVar('T')


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `stepstream` command."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, 'command'):
        parser.print_help()
        return 2
    try:
        settings = Settings.from_args(args)
        return asyncio.run(args.command(args, settings))
    except UsageError as exc:
        print(f'stepstream: {exc}', file=sys.stderr)
        return 2
    except (StepStreamError, LookupError, ValueError) as exc:
        print(f'stepstream: {exc}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='stepstream', description=__doc__)
    sub = parser.add_subparsers(metavar='COMMAND')

    def command(name: str, fn: Command, help_text: str, *, hidden: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=None if hidden else help_text, description=help_text)
        Settings.add_arguments(p)
        p.set_defaults(command=fn)
        return p

    demo = command(
        'demo', _demo, 'Run the multi-agent demo on a durable embedded stack and show its history.'
    )
    demo.add_argument(
        '--data-dir', default='.stepstream', help='where the stack keeps the log and projection'
    )
    demo.add_argument(
        '--serve', action='store_true', help='then serve the run explorer on 127.0.0.1:8321 until Ctrl-C'
    )

    projector = command('projector', _projector, 'Run the projector service until SIGTERM or Ctrl-C.')
    projector.add_argument('--max-batch-records', type=int, default=5000)
    projector.add_argument('--max-snapshots-per-run', type=int, default=None)
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
    rebuild.add_argument('--max-snapshots-per-run', type=int, default=None)
    rebuild.add_argument('--like', metavar='PATH', help='copy the options of the projection at PATH')
    rebuild.add_argument('--jobs', type=int, default=1, metavar='N', help='rebuild the shards in N processes')

    verify = command('verify', _verify, 'Compare two projections; print the first difference.')
    verify.add_argument('left')
    verify.add_argument('right')

    status = command('status', _status, 'Per-partition lag, records applied per second, DLQ count.')

    topics = command('topics', _topics, 'Create the topics (idempotent) and check they are co-partitioned.')
    topics.add_argument('action', choices=['ensure'])

    runs = command('runs', _runs, 'List runs, in the order they started.')
    runs.add_argument('--conversation-id')
    runs.add_argument('--parent-run-id')
    runs.add_argument('--status', choices=['running', 'completed', 'failed'])
    runs.add_argument('--agent-name')

    tree = command('tree', _tree, 'Show a run and all its descendants.')
    tree.add_argument('run_id')
    events = command('events', _events, "List a run's events in seq order.")
    events.add_argument('run_id')
    snapshot = command('snapshot', _snapshot, "Show a run's latest snapshot.")
    snapshot.add_argument('run_id')
    snapshot.add_argument('--include-interrupted', action='store_true')
    unresolved = command('unresolved', _unresolved, 'List tool effects in unknown_after_crash.')
    unresolved.add_argument('run_id', nargs='?')
    conflicts = command('conflicts', _conflicts, 'List run ids claimed by more than one writer.')

    for p in (runs, tree, events, snapshot, unresolved, conflicts, status):
        p.add_argument('--json', action='store_true', help='machine-readable output')

    serve = command('serve', _serve, 'Serve the projection over HTTP: a JSON API and the run explorer.')
    serve.add_argument(
        '--host', default='127.0.0.1', help='address to bind (beyond loopback: needs STEPSTREAM_SERVE_TOKEN)'
    )
    serve.add_argument('--port', type=int, default=8321)

    delegate = command('_demo-delegate', _demo_delegate, 'internal: the demo child process', hidden=True)
    delegate.add_argument('--run-id', required=True)
    delegate.add_argument('--parent-run-id', required=True)
    return parser


async def _demo(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.demo import run_demo

    await run_demo(args.data_dir, serve_port=8321 if args.serve else None)
    return 0


async def _demo_delegate(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.demo import run_crashing_delegate

    await run_crashing_delegate(settings, run_id=args.run_id, parent_run_id=args.parent_run_id)
    return 0


async def _projector(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.projector import Checkpoints, Projector

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
        await asyncio.wait([stopping, running], return_when=asyncio.FIRST_COMPLETED)
        if running.done():  # the loop ended without being asked to: it failed, and leaving the
            stopping.cancel()  # `async with` raises its error, which main() prints (exit code 1)
            return 1
        print(f'projector: stopping after {projector.records_applied} records', flush=True)
    running.cancel()
    return 0


async def _serve(args: argparse.Namespace, settings: Settings) -> int:
    try:
        from stepstream.serve import app_for, check_binding, running
    except ImportError as exc:
        raise UsageError(
            f"stepstream serve needs its extra: pip install 'stepstream[serve]' ({exc})"
        ) from None

    check_binding(args.host, settings)
    async with running(app_for(settings), host=args.host, port=args.port) as served:
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, served.stop)
        print(
            f'stepstream serve: explorer at {served.url}/ (API under /api, schema at /openapi.json)',
            flush=True,
        )
        await served.wait()
    return 0


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
    return 0


async def _verify(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.projector import verify_paths

    equal, difference = await asyncio.to_thread(verify_paths, args.left, args.right)
    if difference is not None:
        print(f'projections differ after {equal} equal items; {difference}')
        return 1
    print(f'projections are identical ({equal} items)')
    return 0


async def _status(args: argparse.Namespace, settings: Settings) -> int:
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    from stepstream.kafka_client import client_options
    from stepstream.render import table, to_json
    from stepstream.topics import ensure_topics

    async with _reader(settings) as reader:
        status = await reader.status()
    layout = await ensure_topics(settings, create=False)
    partitions = [
        TopicPartition(t, p)
        for t in (settings.step_events_topic, settings.tool_effects_topic)
        for p in range(layout.partitions)
    ]
    consumer = AIOKafkaConsumer(**client_options(settings), enable_auto_commit=False)
    await consumer.start()
    try:
        ends = await consumer.end_offsets(partitions)
    finally:
        await consumer.stop()
    rows = []
    for tp in partitions:
        applied = status.offsets.get((tp.topic, tp.partition), 0)
        rows.append((tp.topic, tp.partition, applied, ends[tp], max(ends[tp] - applied, 0)))
    if args.json:
        keys = ('topic', 'partition', 'applied', 'end', 'lag')
        print(to_json({'partitions': [dict(zip(keys, r, strict=True)) for r in rows], 'status': status}))
        return 0
    print(table(['topic', 'partition', 'applied', 'end', 'lag'], rows))
    print(f'\ntotal lag: {sum(r[4] for r in rows)} records')
    print(f'applied: {status.applied_per_second:g} records/s (as of {status.updated_at or "never"})')
    reasons = ', '.join(f'{reason} {count}' for reason, count in status.dead_lettered_by_reason.items())
    print(f'dead-lettered: {status.dead_lettered}' + (f' ({reasons})' if reasons else ''))
    print(f'runs with conflicting writers: {status.conflicting_runs}')
    if status.parked_records:
        print(f'records waiting for a run_started that has not arrived: {status.parked_records}')
    if status.state == 'rebuilding':
        resume = f'stepstream rebuild --into {settings.db_path}'
        print(f'this projection is an unfinished rebuild: resume it with `{resume}`')
    return 0


async def _topics(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.topics import ensure_topics

    layout = await ensure_topics(settings)
    print(
        f'{settings.step_events_topic}, {settings.tool_effects_topic}, {settings.dlq_topic}: '
        f'{layout.partitions} partitions each'
    )
    return 0


@contextlib.asynccontextmanager
async def _reader(settings: Settings) -> AsyncIterator[ProjectionReader]:
    from stepstream.media import S3MediaStore
    from stepstream.projector import ProjectionReader as Reader

    reader = Reader.open(settings.db_path, media_store=S3MediaStore.from_settings(settings))
    try:
        yield reader
    finally:
        reader.close()


async def _show(
    args: argparse.Namespace,
    settings: Settings,
    fetch: Callable[[ProjectionReader], Awaitable[T]],
    render: Callable[[T], str],
) -> int:
    """Run one query on the projection and print it as a table, or as JSON with --json."""
    from stepstream.render import to_json

    async with _reader(settings) as reader:
        value = await fetch(reader)
    print(to_json(value) if args.json else render(value))
    return 0


async def _runs(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.render import runs_table

    def fetch(reader: ProjectionReader) -> Awaitable[list[RunRecord]]:
        return reader.list_runs(
            conversation_id=args.conversation_id,
            parent_run_id=args.parent_run_id,
            status=args.status,
            agent_name=args.agent_name,
        )

    return await _show(args, settings, fetch, runs_table)


async def _tree(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.render import to_json, tree

    async with _reader(settings) as reader:
        runs = await reader.run_tree(args.run_id)
    if not runs:
        raise LookupError(f'no run {args.run_id!r} in the projection at {settings.db_path}')
    print(to_json(runs) if args.json else tree(runs))
    return 0


async def _events(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.render import events_table

    return await _show(args, settings, lambda reader: reader.list_events(args.run_id), events_table)


async def _snapshot(args: argparse.Namespace, settings: Settings) -> int:
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    async with _reader(settings) as reader:
        snap = await reader.latest_snapshot(args.run_id, include_interrupted=args.include_interrupted)
    if snap is None:
        raise LookupError(f'run {args.run_id!r} has no snapshot in the projection at {settings.db_path}')
    if args.json:
        print(ModelMessagesTypeAdapter.dump_json(snap.messages, indent=2).decode())
    else:
        print(
            f'snapshot {snap.snapshot_seq} of {snap.run_id}: {snap.state}, step {snap.step_index}, '
            f'{len(snap.messages)} messages'
        )
        for i, message in enumerate(snap.messages):
            parts = ', '.join(type(p).__name__ for p in message.parts)
            print(f'  {i:>3} {message.kind:<8} {parts}')
    return 0


async def _unresolved(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.render import effects_table

    return await _show(
        args, settings, lambda reader: reader.list_unresolved_tool_effects(args.run_id), effects_table
    )


async def _conflicts(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.render import table

    def render(runs: list[RunRecord]) -> str:
        rows = [(r.run_id, r.registration_id, ', '.join(r.conflicting_writers)) for r in runs]
        return table(['run_id', 'registered_by', 'conflicting_writers'], rows)

    return await _show(args, settings, lambda reader: reader.list_conflicts(), render)


if __name__ == '__main__':
    sys.exit(main())
