"""`stepstream audit verify|checkpoint|key`: the trail, verified from the topics alone (docs/audit.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

from stepstream.cli._common import EXIT_FAILED, EXIT_OK, Declare
from stepstream.cli._paths import existing, to_make
from stepstream.errors import UsageError
from stepstream.settings import Settings


def add_commands(command: Declare, sub: Any) -> None:
    """Declare `audit verify`, `audit checkpoint` and `audit key`."""
    audit = sub.add_parser(
        'audit',
        help='Verify the log from the topics alone: chains, signatures, checkpoints (verify|checkpoint|key).',
        description='Prove that every run in the log is exactly what its writers wrote, or name the first '
        'place where it is not. Reads only the topics (at any --topic-prefix), the trusted public keys '
        'and checkpoints; never the projection.',
    )
    audit_sub = audit.add_subparsers(metavar='ACTION', required=True)
    verify = command(
        'verify',
        _verify,
        'Check integrity (chains, order, signatures) and completeness (against checkpoints) of runs. '
        'Exit 0 when everything verifies, 1 on any violation, 2 on bad usage.',
        parent=audit_sub,
    )
    which = verify.add_mutually_exclusive_group()
    which.add_argument('--run', metavar='RUN', help='verify one run')
    which.add_argument('--conversation', metavar='ID', help="verify a conversation's runs")
    which.add_argument('--all', action='store_true', help='verify every run and every partition')
    verify.add_argument(
        '--trusted-keys',
        metavar='PATH',
        help="the writers' Ed25519 public keys (a PEM file, or a directory of .pem files): every record "
        'must then be covered by a head signed by one of them. Without it, signatures are not checked',
    )
    verify.add_argument(
        '--checkpoint',
        metavar='FILE',
        help='a checkpoint (`audit checkpoint`): the log must still hold exactly what it saw. Its '
        'signature is checked against --trusted-keys',
    )
    verify.add_argument('--json', action='store_true', help='print the report as JSON')
    checkpoint = command(
        'checkpoint',
        _checkpoint,
        'Write a signed statement of what the log holds now (per partition: offsets, count, digest; per '
        "run: its newest record), signed with STEPSTREAM_SIGNING_KEY. Keep it where the cluster's "
        'administrator cannot reach.',
        parent=audit_sub,
    )
    checkpoint.add_argument(
        '--out', metavar='FILE', required=True, help='the file to write (never overwritten)'
    )
    checkpoint.add_argument(
        '--s3',
        action='store_true',
        help='also put it in the S3 bucket under audit/checkpoints/ (never over an existing object; '
        "object lock is the bucket's default retention)",
    )
    key = command(
        'key',
        _key,
        'Print the public key (PEM) of STEPSTREAM_SIGNING_KEY, what auditors are given; with --new FILE, '
        'make a new private key there first.',
        parent=audit_sub,
    )
    key.add_argument('--new', metavar='FILE', help='write a new Ed25519 private key (PEM, mode 600) to FILE')


async def _verify(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.audit import Checkpoint, audit_log
    from stepstream.signing import TrustedKeys

    if not (args.run or args.conversation or args.all):
        raise UsageError('say which runs to verify: --run RUN, --conversation ID or --all')
    if args.trusted_keys:
        existing(
            '--trusted-keys',
            args.trusted_keys,
            'file or folder',
            "give the writers' Ed25519 public keys: a PEM file, or a folder of .pem files "
            "(`stepstream audit key` prints a writer's)",
        )
    if args.checkpoint:
        existing(
            '--checkpoint',
            args.checkpoint,
            'file',
            'give a file `stepstream audit checkpoint --out FILE` wrote',
        )
    keys = TrustedKeys.load(args.trusted_keys) if args.trusted_keys else None
    checkpoint = None
    if args.checkpoint:
        if keys is None:
            raise UsageError(
                '--checkpoint needs --trusted-keys: a checkpoint is trusted only by its signature'
            )
        checkpoint = Checkpoint.load(args.checkpoint, keys)
    report = await audit_log(
        settings, keys=keys, checkpoint=checkpoint, run_id=args.run, conversation_id=args.conversation
    )
    if args.json:
        print(json.dumps(report.as_json(), indent=1))
    else:
        print(_report_text(report, keys_count=len(keys.keys) if keys is not None else 0))
    return EXIT_OK if report.integrity_ok and report.completeness_ok else EXIT_FAILED


def _report_text(report: Any, *, keys_count: int) -> str:
    """The report for a terminal: both verdicts, each violation, the open runs."""
    lines = []
    runs = [r for r in report.runs if r.integrity is not None]
    signed = (
        f'signatures checked against {keys_count} trusted key(s)'
        if report.signatures_checked
        else 'signatures not checked'
    )
    lines.append(
        f'integrity: {"ok" if report.integrity_ok else "VIOLATED"} '
        f'({len(runs)} runs, {report.records} records; {signed})'
    )
    unchained = sum(1 for r in runs if r.integrity.chain == 'unchained')
    if unchained:
        lines.append(f'  {unchained} run(s) unchained (written before the hash chain)')
    for u in report.unreadable:
        lines.append(f'  {u.topic}/{u.partition} offset {u.offset}: inserted: {u.detail}')
    for r in runs:
        first = r.integrity.first_break
        if first is not None:
            # Each break at an answer (decision, resolution, mark) is named; the trail's first only.
            named = [first, *(b for b in r.integrity.answer_breaks if b is not first)]
            more = len(r.integrity.breaks) - len(named)
            for b in named:
                lines.append(
                    f'  run {r.run_id}: {b.problem} at seq {b.seq} '
                    f'({b.topic}/{b.partition} offset {b.offset}): {b.detail}'
                    + (f' (+{more} more)' if b is first and more else '')
                )
    if report.checkpoint_answers is False:
        lines.append(
            '  the checkpoint (format 1) lists no decisions or resolutions: they are not checked against it'
        )
    against = f'against the checkpoint of {report.checkpoint}' if report.checkpoint else 'no checkpoint given'
    lines.append(f'completeness: {"ok" if report.completeness_ok else "VIOLATED"} ({against})')
    for p in report.partitions:
        if p.verdict != 'complete':
            lines.append(f'  {p.topic}/{p.partition}: {p.verdict}: {p.detail}')
    for r in report.runs:
        if r.completeness not in ('complete', 'open'):
            lines.append(f'  run {r.run_id}: {r.completeness}: {r.detail}')
    open_runs = [r.run_id for r in report.runs if r.completeness == 'open']
    if open_runs:
        shown = ', '.join(open_runs[:5]) + (f' and {len(open_runs) - 5} more' if len(open_runs) > 5 else '')
        lines.append(f'  {len(open_runs)} run(s) open, without an end record: {shown}')
    return '\n'.join(lines)


async def _checkpoint(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.audit import put_checkpoint_s3, take_checkpoint
    from stepstream.signing import Signer

    if settings.security.signing_key is None:
        raise UsageError('a checkpoint is signed: set STEPSTREAM_SIGNING_KEY or STEPSTREAM_SIGNING_KEY_FILE')
    out = to_make('--out', args.out, 'file', 'give a new file for the checkpoint')
    checkpoint = await take_checkpoint(settings, Signer.from_secret(settings.security.signing_key))
    await asyncio.to_thread(_write_new, out, checkpoint.to_json())
    records = sum(p.count for p in checkpoint.partitions)
    answers = sum(len(a) for a in (checkpoint.answers or {}).values())
    print(
        f'checkpoint of {records} records, {len(checkpoint.runs)} runs, '
        f'{answers} answers (decisions, resolutions, marks), signed by {checkpoint.signing_key}: {out}'
    )
    if args.s3:
        key = await put_checkpoint_s3(settings, checkpoint)
        print(f'and s3://{settings.media.s3_bucket}/{key}')
    return EXIT_OK


def _write_new(path: Path, text: str) -> None:
    """Write a new file; `FileExistsError` rather than overwrite one."""
    with path.open('x') as file:
        file.write(text)


async def _key(args: argparse.Namespace, settings: Settings) -> int:
    from stepstream.signing import Signer, public_pem

    if args.new:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        to_make('--new', args.new, 'file', 'give a new file for the private key')
        pem = Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        fd = os.open(args.new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, 'wb') as file:
            file.write(pem)
        signer = Signer.from_pem(pem)
    elif settings.security.signing_key is not None:
        signer = Signer.from_secret(settings.security.signing_key)
    else:
        raise UsageError('no key: set STEPSTREAM_SIGNING_KEY (or its _FILE), or make one with --new FILE')
    print(public_pem(signer).decode(), end='')
    return EXIT_OK
