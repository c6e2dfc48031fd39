"""`stepstream audit verify --all` against the decode ceiling, on the same records, interleaved.

    .venv/bin/python -m bench.audit_verify [RECORDS] [--rounds N] [--signed] [--sign-every K] [--json]

Issue 37 asks for "--all over 1M records at half the decode ceiling or better, measured in bench/".
This fills a fresh topic pair of an embedded stack (Tansu by default) with about RECORDS records of
hash-chained synthetic runs: the 50-step runs of workload 3 (`synthetic.plan_run`), each record
rebuilt with the `prev_hash` of the one before it (docs/decisions/0048-hash-chained-runs.md), and
re-keyed per run by byte replacement of the fixed-width run id and of each fixed-width link, the
links recomputed from the new bodies. With `--signed`, each run also carries a `chain_signed` step
event after every K-th durability point of the plan and after `run_completed`, signed with a key
generated for the occasion, as `RunWriter.sign_head` writes it (seq: the records it covers;
prev_hash: the head; the signature and key id in its metadata); K is 1 (every point, as the writer
does) unless `--sign-every` says otherwise. RECORDS counts the signed heads.

Before timing, one `audit_log` must find every run intact and complete (and, with `--signed`,
signed through its last record with the key trusted); anything else stops the benchmark.

Then, in each round and on the same records:

- the ceiling (`bench.loop_ab.ceiling`): one aiokafka consumer reads every record and fastavro
  decodes each body with its writer schema, nothing else;
- verify: `stepstream.audit.audit_log(settings)` in this process, what `stepstream audit verify
  --all` runs: every partition read, every record decoded, hashed and checked against its run's
  chain;
- with `--signed`, verify with keys: the same with the key trusted, every signed head checked.

Each is given in wall time and in this process's CPU time (`time.process_time`: the broker runs
in processes of its own). The figure the issue asks for is the ceiling's time over verify's
time in the same round: 0.5 or more meets it. The machine may be shared: the rounds interleave,
and CPU time is the steadier figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from bench.common import fresh, say
from bench.loop_ab import ceiling, line
from bench.projector_throughput import STEPS_PER_RUN, produce
from bench.synthetic import Wire, plan_run, run_id, to_wire
from stepstream import Settings
from stepstream.audit import AuditReport, audit_log
from stepstream.embedded import EmbeddedStack
from stepstream.schemas import StepEvent, chain_hash
from stepstream.signing import SIGNATURE, SIGNED_KIND, SIGNING_KEY, Signer, TrustedKeys
from stepstream.topics import Position, ensure_topics

PREFIX = 'bench-a'


@dataclass(frozen=True, slots=True)
class Entry:
    """One record of the chained template run: its wire form and what changes per run."""

    wire: Wire
    link: bytes | None
    """The template's `prev_hash` (hex), replaced by the run's own link."""
    signed_seq: int | None = None
    """A signed head's `seq` (the records it covers); None for a record of the trail."""
    signature: bytes | None = None
    """A signed head's signature in the template, replaced by the run's own."""


def new_signer() -> Signer:
    """A freshly generated Ed25519 key, loaded the way a writer loads `STEPSTREAM_SIGNING_KEY`."""
    pem = Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    return Signer.from_pem(pem)


def chained_template(
    settings: Settings, rid: str, steps: int, signer: Signer | None, sign_every: int
) -> tuple[list[Entry], int]:
    """One run's records with their links (and signed heads), and how many records its trail holds."""
    entries: list[Entry] = []
    head: str | None = None
    planned = sorted(plan_run(rid, steps), key=lambda p: p.record.seq)
    points = 0
    for index, p in enumerate(planned):
        r = p.record
        fields = {n: getattr(r, n) for n in type(r).__slots__}
        fields['prev_hash'] = head
        record = type(r)(**fields)
        wire = to_wire(record, settings)
        entries.append(Entry(wire, head.encode() if head is not None else None))
        head = chain_hash(wire.value)
        if signer is None or not p.durable:
            continue
        points += 1
        last = index == len(planned) - 1
        if points % sign_every and not last:
            continue
        covered = record.seq + 1
        signature = signer.sign(rid, covered, head)
        signed = StepEvent(
            run_id=rid,
            seq=covered,
            writer_id=r.writer_id,
            timestamp=r.timestamp,
            kind=SIGNED_KIND,
            step_index=r.step_index if isinstance(r, StepEvent) else 0,
            agent_name=r.agent_name,
            conversation_id=r.conversation_id,
            parent_run_id=r.parent_run_id,
            metadata={SIGNATURE: signature, SIGNING_KEY: signer.key_id},
            idempotency_key=None,
            prev_hash=head,
        )
        entries.append(Entry(to_wire(signed, settings), head.encode(), covered, signature.encode()))
    return entries, len(planned)


def chained_runs(template: list[Entry], prefix: str, runs: int, signer: Signer | None) -> Iterator[Wire]:
    """Each run's records: the template re-keyed, each link recomputed from the new bodies."""
    old = run_id(prefix, 0).encode()
    for index in range(runs):
        rid = run_id(prefix, index)
        new = rid.encode()
        head: bytes | None = None
        for entry in template:
            w = entry.wire
            value = w.value.replace(old, new)
            if entry.link is not None:
                assert head is not None
                value = value.replace(entry.link, head)
            if entry.signed_seq is None:
                head = chain_hash(value).encode()
            else:
                assert signer is not None and entry.signature is not None and head is not None
                signature = signer.sign(rid, entry.signed_seq, head.decode())
                value = value.replace(entry.signature, signature.encode())
            yield Wire(w.topic, new, value, w.headers)


async def fill(settings: Settings, total: int, signer: Signer | None, sign_every: int) -> dict[str, Any]:
    """Produce about `total` records of chained runs (as `projector_throughput.fill` does unchained ones)."""
    await ensure_topics(settings)
    template, trail = chained_template(settings, run_id(PREFIX, 0), STEPS_PER_RUN, signer, sign_every)
    runs = -(-total // len(template))
    producer = AIOKafkaProducer(
        bootstrap_servers=settings.kafka.bootstrap_servers,
        acks='all',
        linger_ms=20,
        max_batch_size=256 * 1024,
    )
    await producer.start()
    position: Position = {}
    t0 = time.perf_counter()
    try:
        count = await produce(producer, chained_runs(template, PREFIX, runs, signer), position)
    finally:
        await producer.stop()
    elapsed = time.perf_counter() - t0
    return {'records': count, 'runs': runs, 'trail': trail, 'per_run': len(template), 'seconds': elapsed}


def mismatches(report: AuditReport, filled: dict[str, Any], signed: bool) -> list[str]:
    """Where the audit of the filled log differs from what was written (nothing: it checks)."""
    wrong: list[str] = []
    if report.records != filled['records']:
        wrong.append(f'the audit read {report.records:,} records, {filled["records"]:,} were written')
    if not report.integrity_ok:
        wrong.append(f'integrity not ok ({len(report.unreadable)} unreadable records)')
    if len(report.runs) != filled['runs']:
        wrong.append(f'{len(report.runs):,} runs, {filled["runs"]:,} were written')
    for verdict in report.runs:
        integrity = verdict.integrity
        problems = []
        if integrity is None:
            problems.append('no integrity verdict')
        else:
            if integrity.chain != 'intact':
                first = integrity.first_break
                problems.append(f'chain {integrity.chain} ({first.as_json() if first else ""})')
            if integrity.records != filled['trail']:
                problems.append(f'{integrity.records} records, not {filled["trail"]}')
            if signed and integrity.signed_through != filled['trail']:
                problems.append(f'signed through {integrity.signed_through}, not {filled["trail"]}')
        if verdict.completeness != 'complete':
            problems.append(f'completeness {verdict.completeness}: {verdict.detail}')
        if problems:
            wrong.append(f'run {verdict.run_id}: ' + '; '.join(problems))
    return wrong


async def verify(settings: Settings, keys: TrustedKeys | None) -> dict[str, Any]:
    """`audit_log` of every run, timed in wall and this process's CPU time."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    report = await audit_log(settings, keys=keys)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ok = report.integrity_ok and all(r.integrity and r.integrity.chain == 'intact' for r in report.runs)
    return {'records': report.records, 'wall_s': wall, 'cpu_s': cpu, 'ok': ok}


async def main() -> int:
    parser = argparse.ArgumentParser(prog='python -m bench.audit_verify', description=__doc__.split('\n')[0])
    parser.add_argument('records', type=int, nargs='?', default=1_000_000)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--signed', action='store_true', help='sign heads; also verify with the key trusted')
    parser.add_argument(
        '--sign-every', type=int, default=1, help='sign every K-th durability point (and the last); default 1'
    )
    parser.add_argument('--json', action='store_true', help='print the figures as JSON')
    args = parser.parse_args()
    signer = new_signer() if args.signed else None
    keys = TrustedKeys({signer.key_id: signer.private_key.public_key()}) if signer is not None else None
    results: dict[str, list[dict[str, Any]]] = {'ceiling': [], 'verify': []}
    if keys is not None:
        results['verify --keys'] = []
    async with EmbeddedStack() as stack:
        settings = fresh(stack.settings, 'audit')
        say(f'filling the log with about {args.records:,} records of chained runs ...')
        filled = await fill(settings, args.records, signer, max(1, args.sign_every))
        total = filled['records']
        say(
            f'{total:,} records ({filled["runs"]:,} runs of {filled["per_run"]} records, '
            f'{filled["trail"]} of them the trail) in {filled["seconds"]:.1f} s; checking the audit ...'
        )
        report = await audit_log(settings, keys=keys)
        wrong = mismatches(report, filled, signed=keys is not None)
        if wrong:
            say(f'the audit of the filled log is not what was written ({len(wrong)} mismatches):')
            for text in wrong[:20]:
                say(f'  {text}')
            return 1
        say('every run intact and complete' + (', signed through its last record' if keys else ''))
        for n in range(1, args.rounds + 1):
            results['ceiling'].append(await ceiling(settings, total))
            results['verify'].append(await verify(settings, None))
            if keys is not None:
                results['verify --keys'].append(await verify(settings, keys))
            for what, runs in results.items():
                text = f'round {n} ' + line(what, runs[-1])
                if args.json:
                    say(text)
                else:
                    print(text, flush=True)
    summary: dict[str, Any] = {}
    for what, runs in results.items():
        pairs = list(zip(runs, results['ceiling'], strict=True))
        summary[what] = {
            'wall_s': statistics.median(r['wall_s'] for r in runs),
            'cpu_s': statistics.median(r['cpu_s'] for r in runs),
            'records_per_s': statistics.median(r['records'] / r['wall_s'] for r in runs),
            'records_per_cpu_s': statistics.median(r['records'] / r['cpu_s'] for r in runs),
            'ceiling_over_wall': statistics.median(c['wall_s'] / r['wall_s'] for r, c in pairs),
            'ceiling_over_cpu': statistics.median(c['cpu_s'] / r['cpu_s'] for r, c in pairs),
        }
    if args.json:
        figures = {
            'records': total,
            'runs': filled['runs'],
            'records_per_run': filled['per_run'],
            'signed': keys is not None,
            'sign_every': args.sign_every if keys is not None else None,
            'fill_s': filled['seconds'],
            'rounds': results,
            'median': summary,
        }
        print(json.dumps(figures, indent=2))
        return 0
    for what, figures in summary.items():
        text = (
            f'{what}, median of {len(results[what])}: {figures["wall_s"]:.1f} s '
            f'({figures["records_per_s"]:,.0f} records/s), {figures["cpu_s"]:.1f} CPU s '
            f'({figures["records_per_cpu_s"]:,.0f} records/CPU s)'
        )
        if what != 'ceiling':
            met = 'meets' if figures['ceiling_over_wall'] >= 0.5 else 'misses'
            text += (
                f'; ceiling time / its time in the same round: {figures["ceiling_over_wall"]:.2f} wall, '
                f'{figures["ceiling_over_cpu"]:.2f} CPU ({met} the 0.5 target)'
            )
        print(text)
    return 0


if __name__ == '__main__':
    sys.exit(asyncio.run(main()))
