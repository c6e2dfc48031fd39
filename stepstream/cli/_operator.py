"""Operator commands: `resolve` an unknown effect, `forget` (0033), `retention` and its sweep (0032)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from stepstream.cli._common import EXIT_FAILED, EXIT_OK, Declare, add_json, open_reader
from stepstream.errors import NotFound, UsageError
from stepstream.settings import Settings

if TYPE_CHECKING:
    from stepstream.readmodel import ProjectionReader


def add_commands(command: Declare) -> None:
    """Declare `resolve`, `retention` and `forget`."""
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
    add_json(resolve, _retention_commands(command))

    forget = command(
        'forget',
        _forget,
        "Erase a conversation's content and media: destroy its keys (the log's structure stays).",
    )
    forget.add_argument('--conversation', required=True, metavar='ID', help='the conversation to erase')
    add_json(forget)


async def _resolve(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.console import to_json
    from stepstream.producer import EventLog, resolve_tool_effect, resolver_id

    async with open_reader(settings) as reader:
        await reader.require_run(args.run_id)
        effect = await reader.get_tool_effect(args.run_id, args.tool_call_id)
    if effect is None:
        raise NotFound(
            f'run {args.run_id!r} has no tool call {args.tool_call_id!r} '
            f'in the projection at {settings.projection.db_path}'
        )
    async with EventLog(settings, create_topics=False) as log:
        record = await resolve_tool_effect(
            log,
            effect,
            resolution=args.resolution,
            note=args.note,
            operator=settings.serve.operator_name,
            writer_id=resolver_id('cli'),
            force=args.force,
        )
    if args.json:
        print(to_json(record))
    else:
        print(
            f'resolved {record.tool_call_id} of {record.run_id} as {record.resolution} '
            f'by {record.resolved_by} '
            f'(written to {settings.topics.tool_effects_topic}; views show it once the projector applies it)'
        )
    return EXIT_OK


async def _forget(args: argparse.Namespace, settings: Settings) -> int:
    """`stepstream forget --conversation ID` (decision 0033)."""
    from stepstream.console import to_json
    from stepstream.forget import forget_conversation
    from stepstream.media import S3MediaStore

    async with open_reader(settings) as reader:
        report = await forget_conversation(
            settings, args.conversation, reader=reader, media_store=S3MediaStore.from_settings(settings.media)
        )
    if not report.keys_destroyed and not report.runs:
        raise NotFound(
            f'conversation {args.conversation!r} has no key on '
            f'{settings.topics.topic_prefix}.conversation-keys '
            f'and no run in the projection at {settings.projection.db_path}: nothing to forget'
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


def _retention_commands(command: Declare) -> argparse.ArgumentParser:
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
    from stepstream.console import preview_text, retention_text, to_json

    async with open_reader(settings) as reader:
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
    import asyncio
    from datetime import timedelta

    from stepstream.console import sweep_text, to_json
    from stepstream.media import S3MediaStore
    from stepstream.readmodel import sweep_media
    from stepstream.topics import ensure_topics, log_end_offsets

    layout = await ensure_topics(settings, create=False)
    applied = await _applied(reader, settings, layout.partitions)
    ends = await log_end_offsets(settings.kafka, applied)
    deadline = asyncio.get_running_loop().time() + args.catch_up_timeout
    while any(applied[tp] < end for tp, end in ends.items()):
        if asyncio.get_running_loop().time() > deadline:
            behind = sum(max(end - applied[tp], 0) for tp, end in ends.items())
            print(
                f'stepstream: the projection at {settings.projection.db_path} is {behind} records '
                'behind the log '
                f'after {args.catch_up_timeout:g}s, and a sweep needs every record written before it '
                'applied: is the projector running? Nothing was deleted',
                file=sys.stderr,
            )
            return EXIT_FAILED
        await asyncio.sleep(0.5)
        applied = await _applied(reader, settings, layout.partitions)
    report = await sweep_media(
        reader,
        S3MediaStore.from_settings(settings.media),
        grace=timedelta(hours=args.grace_hours),
        dry_run=args.dry_run,
    )
    print(to_json(report) if args.json else sweep_text(report))
    return EXIT_OK


async def _applied(
    reader: ProjectionReader, settings: Settings, partitions: int
) -> dict[tuple[str, int], int]:
    offsets = (await reader.status()).offsets
    topics = (settings.topics.step_events_topic, settings.topics.tool_effects_topic)
    return {(t, p): offsets.get((t, p), 0) for t in topics for p in range(partitions)}
