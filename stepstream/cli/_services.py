"""The long-running services: `projector` (one process or a group member) and `serve` (the read service)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from stepstream.cli._common import EXIT_FAILED, EXIT_OK, Declare
from stepstream.errors import UsageError
from stepstream.projector import ProjectorObserver
from stepstream.readmodel import ProjectionReader
from stepstream.settings import Settings

if TYPE_CHECKING:
    from stepstream.metrics import ProbeServer
    from stepstream.projector import Projector


def add_commands(command: Declare) -> None:
    """Declare `projector` and `serve`."""
    projector = command('projector', projector_service, 'Run the projector service until SIGTERM or Ctrl-C.')
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
        '--metrics-port',
        type=int,
        metavar='PORT',
        help='serve /metrics, /healthz and /readyz on this port (0: any free one; default: off)',
    )
    projector.add_argument(
        '--metrics-host', default='127.0.0.1', help='address for --metrics-port (0.0.0.0: every interface)'
    )
    _member_arguments(projector)

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
    _member_arguments(serve)


def _member_arguments(parser: argparse.ArgumentParser) -> None:
    """A group member's checkpoint interval and session timeout (`projector` and `serve`)."""
    parser.add_argument(
        '--checkpoint-interval',
        type=float,
        default=60.0,
        metavar='SECONDS',
        help='with --group: upload each owned shard to S3 this often (0: never), restore from there',
    )
    parser.add_argument(
        '--session-timeout',
        type=float,
        default=10.0,
        metavar='SECONDS',
        help='with --group: how long the group waits for a silent member before moving its partitions',
    )
    parser.add_argument(
        '--max-lag',
        type=int,
        default=10_000,
        metavar='RECORDS',
        help='projector, serve --group: /readyz answers 503 while more than this many records behind the log',
    )


async def projector_service(args: argparse.Namespace, settings: Settings) -> int:
    """`stepstream projector`: apply the log to the projection until SIGTERM or Ctrl-C."""
    import asyncio
    import contextlib
    import logging
    import signal

    from stepstream.kafka_client import broker_answers
    from stepstream.projector import GroupMember, Projector
    from stepstream.service_log import BrokerLossLog
    from stepstream.storage import Checkpoints

    loss = BrokerLossLog(settings.kafka.bootstrap_servers)
    for handler in logging.getLogger().handlers:
        handler.addFilter(loss)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
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

    member = None
    if args.group is not None:
        checkpoints = None
        if args.checkpoint_interval > 0:
            checkpoints = Checkpoints.from_settings(
                settings, group=args.group, interval_s=args.checkpoint_interval
            )
        member = GroupMember(
            group=args.group,
            session_timeout_ms=int(args.session_timeout * 1000),
            on_assignment=tell,
            checkpoints=checkpoints,
        )
    async with Projector(
        settings,
        member=member,
        max_batch_records=args.max_batch_records,
        max_snapshots_per_run=args.max_snapshots_per_run,
    ) as projector:
        of_group = f' (member of {args.group})' if args.group else ''
        print(f'projector: {settings.kafka.bootstrap_servers} -> {projector.db_path}{of_group}', flush=True)
        probes = _probe_server(args, projector)
        stopping = asyncio.create_task(stop.wait())
        running = asyncio.create_task(projector.join())
        while not (stopping.done() or running.done()):
            await asyncio.wait([stopping, running], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if loss.pending:
                loss.checked(await broker_answers(settings.kafka))
        if running.done():  # the loop ended without being asked to: it failed, and leaving the
            stopping.cancel()  # `async with` raises its error, which main() prints (exit code 1)
            return EXIT_FAILED
        away = loss.summary()
        print(
            f'projector: stopping after {projector.records_applied} records' + (f' ({away})' if away else ''),
            flush=True,
        )
        if probes is not None:
            probes.stop()
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    return EXIT_OK


def _probe_server(args: argparse.Namespace, projector: Projector) -> ProbeServer | None:
    """`--metrics-port`: the projector's `/metrics`, `/healthz` and `/readyz`, started (None: not asked)."""
    import asyncio

    from stepstream.metrics import ProbeServer

    if args.metrics_port is None:
        return None
    observer = ProjectorObserver(projector, ProjectionReader.of(projector), max_lag=args.max_lag)
    try:
        server = ProbeServer(
            observer.registry,
            observer,
            asyncio.get_running_loop(),
            host=args.metrics_host,
            port=args.metrics_port,
        )
    except (OSError, OverflowError) as exc:  # taken, an unknown host, a port out of range
        where = f'{args.metrics_host}:{args.metrics_port}'
        raise UsageError(f'--metrics-port: cannot listen on {where}: {exc}') from None
    print(f'projector: metrics at {server.url}/metrics (probes /healthz, /readyz)', flush=True)
    return server.start()


async def _serve(args: argparse.Namespace, settings: Settings) -> int:
    """`stepstream serve`: the JSON API and the run explorer over the projection."""
    import asyncio
    import signal

    try:
        from stepstream.serve import app_for, check_binding, running
    except ImportError as exc:
        raise UsageError(
            f"stepstream serve needs its extra: pip install 'stepstream[serve]' ({exc})"
        ) from None

    check_binding(args.host, settings.serve)
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
    import asyncio
    import signal

    from stepstream.projector import GroupMember, Membership, Projector
    from stepstream.serve import app_for, listen, running, url_of
    from stepstream.storage import Checkpoints

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
        member=GroupMember(
            group=args.group,
            session_timeout_ms=int(args.session_timeout * 1000),
            membership=membership,
            checkpoints=checkpoints,
        ),
    )
    async with (
        member,
        running(
            app_for(
                settings,
                reader=ProjectionReader.of(member),
                membership=membership,
                observer=ProjectorObserver(member, ProjectionReader.of(member), max_lag=args.max_lag),
            ),
            sock=sock,
        ) as served,
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
