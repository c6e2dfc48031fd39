"""`stepstream audit`: the tamper suite, on the real broker (both brokers in `make test`).

Real agents write signed, sealed runs (erasure on, tool calls, a delegate); `audit checkpoint`
signs what the log holds. Then the topics are copied under another prefix, untouched or with one
change each, the way an administrator could: a byte of a sealed message altered, a record
dropped, two records swapped, a forged record with valid hashes but no signature, a record of
another run spliced in, the tail of a partition cut, a whole run removed. `audit verify`, given
only the copy, the trusted public key and the checkpoint, names each (exit 1, the problem, the
run and where), and verifies the untouched copy (exit 0): the checkpoint names partitions, not
topics. Forgetting a conversation rewrites no record: the log still verifies after it. The pure
rules are tests/test_audit_chains.py's.

Decisions and operators' resolutions, which other processes write beside a run's trail: a signed
run pauses (a refund waits for an approval, an export for an outside system) and another is
cancelled mid-call (its call in doubt); other processes decide the first run's calls
(`decide_deferred_call`) and resolve the second's (`resolve_tool_effect`, what the CLI and the API
write); a decision that loses the race is written after the checkpoint. Copies with one decision
altered, the resolution dropped, or a decision forged before what the checkpoint saw each fail,
naming the decision or the resolution (`answer_breaks` in the JSON, and the text); the untouched
copy verifies. Their pure rules are tests/test_audit_answers.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from pydantic_ai import Agent
from test_cli import cli
from test_decisions_e2e import agent_on
from test_erasure import sealed_settings

from stepstream import Settings
from stepstream.forget import forget_conversation
from stepstream.kafka_client import client_options
from stepstream.media import S3MediaStore
from stepstream.producer import (
    EventLog,
    StepPersistence,
    decide_deferred_call,
    resolve_tool_effect,
    resolver_id,
)
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import StepEvent, ToolEffectTransition, chain_hash, decode, encode
from stepstream.topics import ensure_topics, log_end_offsets, partition_counts

from agents import calls_then_answers
from brokers import kafka_only

pytestmark = pytest.mark.broker

ROLES = ('step_events', 'tool_effects')


@dataclass
class Message:
    key: bytes
    value: bytes


Log = dict[tuple[str, int], list[Message]]
"""A log as read: each topic partition's records, by topic role and partition, in offset order."""


def topic_of(settings: Settings, role: str) -> str:
    return settings.topics.step_events_topic if role == 'step_events' else settings.topics.tool_effects_topic


async def read_log(settings: Settings) -> Log:
    topics = [settings.topics.step_events_topic, settings.topics.tool_effects_topic]
    counts = await partition_counts(settings.kafka, topics)
    consumer = AIOKafkaConsumer(**client_options(settings.kafka), enable_auto_commit=False)
    await consumer.start()
    try:
        log: Log = {}
        parts = [TopicPartition(t, p) for t in topics for p in range(counts[t])]
        ends = await log_end_offsets(settings.kafka, {(tp.topic, tp.partition): 0 for tp in parts})
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        for tp in parts:
            log[(ROLES[topics.index(tp.topic)], tp.partition)] = []
        remaining = {tp for tp in parts if ends[(tp.topic, tp.partition)] > 0}
        while remaining:
            for tp, batch in (await consumer.getmany(*remaining, timeout_ms=2000)).items():
                role = ROLES[topics.index(tp.topic)]
                for m in batch:
                    if m.offset < ends[(tp.topic, tp.partition)]:
                        log[(role, tp.partition)].append(Message(m.key or b'', m.value or b''))
                if batch and batch[-1].offset + 1 >= ends[(tp.topic, tp.partition)]:
                    remaining.discard(tp)
        return log
    finally:
        await consumer.stop()


async def copy_log(settings: Settings, log: Log) -> Settings:
    """The log written under a new topic prefix, each partition's records in the same order."""
    copy = settings.replace(topic_prefix=f'copy-{uuid.uuid4().hex[:10]}')
    await ensure_topics(copy)
    producer = AIOKafkaProducer(**client_options(copy.kafka), acks='all', max_batch_size=1 << 20, linger_ms=5)
    await producer.start()
    try:
        for (role, partition), messages in log.items():
            for m in messages:  # one at a time: a retry must not reorder the copy
                await producer.send_and_wait(topic_of(copy, role), m.value, key=m.key, partition=partition)
    finally:
        await producer.stop()
    return copy


def records_of(log: Log, run_id: str) -> list[tuple[tuple[str, int], int, Any]]:
    """Where each record of `run_id` stands, and the record."""
    return [
        (where, i, decode(m.value))
        for where, messages in log.items()
        for i, m in enumerate(messages)
        if m.key == run_id.encode()
    ]


@pytest.fixture
def keys(tmp_path: Path) -> tuple[str, Path]:
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode()
    public = tmp_path / 'trusted.pem'
    public.write_bytes(private.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    return pem, public


async def write_runs(settings: Settings) -> list[str]:
    """Signed, sealed runs: a delegating orchestrator, a worker with tool calls, plain answers."""
    store = S3MediaStore.from_settings(settings.media)
    run_ids: list[str] = []
    async with EventLog(settings) as log:
        from pydantic_ai import Agent

        worker = Agent(
            calls_then_answers('dig', calls=2),
            capabilities=[StepPersistence(log=log, media_store=store, agent_name='worker')],
        )

        @worker.tool_plain
        def dig() -> str:
            return 'found: ' + 'sealed content ' * 20

        orchestrator = Agent(
            calls_then_answers('delegate'),
            capabilities=[StepPersistence(log=log, media_store=store, agent_name='orchestrator')],
        )

        @orchestrator.tool_plain
        async def delegate() -> str:
            result = await worker.run('dig twice')
            return result.output

        for i in range(3):
            await orchestrator.run(f'task {i}', conversation_id=f'conv-{i}')
        await log.flush()
    for value in [m.value for ms in (await read_log(settings)).values() for m in ms]:
        record = decode(value)
        if isinstance(record, StepEvent) and record.kind == 'run_started':
            run_ids.append(record.run_id)
    return run_ids


async def verify(copy: Settings, tmp_path: Path, public: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    code, out, err = await cli(
        copy, tmp_path / 'unused', 'audit', 'verify', '--all', '--trusted-keys', str(public), '--json', *extra
    )
    assert code in (0, 1) and out, err
    return code, json.loads(out)


def first_break(report: dict[str, Any], run_id: str) -> dict[str, Any]:
    run = next(r for r in report['runs'] if r['run_id'] == run_id)
    assert run['integrity']['first_break'] is not None, run
    return run['integrity']['first_break']


def flip_sealed_byte(value: bytes) -> bytes:
    """One character of the longest base64 run in the record (its sealed message) changed."""
    text = value.decode('latin-1')
    longest = max(re.finditer(rb'[A-Za-z0-9+/]{40,}'.decode(), text), key=lambda m: len(m.group()))
    at = longest.start() + len(longest.group()) // 2
    swapped = 'B' if text[at] != 'B' else 'C'
    return (text[:at] + swapped + text[at + 1 :]).encode('latin-1')


async def test_audit_names_every_tamper_and_verifies_an_untouched_copy(
    settings: Settings, tmp_path: Path, keys: tuple[str, Path]
) -> None:
    pem, public = keys
    settings = sealed_settings(settings).replace(signing_key=pem)
    run_ids = await write_runs(settings)
    assert len(run_ids) == 6  # 3 orchestrators, each delegating to a worker
    original = await read_log(settings)

    code, report = await verify(settings, tmp_path, public)
    assert code == 0, report
    assert report['integrity']['ok'] and report['completeness']['ok']
    assert all(r['integrity']['chain'] == 'intact' for r in report['runs'])
    assert {r['run_id'] for r in report['runs']} == set(run_ids)
    checkpoint = tmp_path / 'checkpoint.json'
    code, _, err = await cli(settings, tmp_path / 'unused', 'audit', 'checkpoint', '--out', str(checkpoint))
    assert code == 0, err

    untouched = await copy_log(settings, original)
    code, report = await verify(untouched, tmp_path, public, '--checkpoint', str(checkpoint))
    assert code == 0, report
    assert all(p['ok'] for p in report['completeness']['partitions'])

    worker = next(r for r in run_ids if r.startswith('worker-'))
    records = [  # the run's trail: no signed heads
        x
        for x in records_of(original, worker)
        if not (isinstance(x[2], StepEvent) and x[2].kind == 'chain_signed')
    ]
    events = sorted(((w, i, r) for w, i, r in records if w[0] == 'step_events'), key=lambda x: x[2].seq)
    snapshot = next((w, i, r) for w, i, r in events if r.kind == 'snapshot_saved' and r is not events[-1][2])

    def altered(log: Log) -> None:
        where, i, _ = snapshot
        log[where][i] = Message(log[where][i].key, flip_sealed_byte(log[where][i].value))

    def dropped(log: Log) -> None:
        where, i, _ = events[3]
        del log[where][i]

    def swapped(log: Log) -> None:
        (where, i, _), (_, j, _) = events[2], events[3]
        log[where][i], log[where][j] = log[where][j], log[where][i]

    def forged(log: Log) -> None:
        where, i, last = max(records, key=lambda x: x[2].seq)
        fields = {name: getattr(events[-1][2], name) for name in StepEvent.__slots__}
        fields.update(seq=last.seq + 1, kind='run_completed', prev_hash=chain_hash(log[where][i].value))
        log[events[0][0]].append(Message(worker.encode(), encode(StepEvent(**fields))))

    other = next(r for r in run_ids if r != worker)

    def spliced(log: Log) -> None:
        where, i, _ = records_of(log, other)[0]
        home = events[0][0]
        log[home].insert(len(log[home]) // 2, Message(worker.encode(), log[where][i].value))

    cut_where = events[0][0]

    def cut(log: Log) -> None:
        log[cut_where][:] = log[cut_where][: len(log[cut_where]) // 2]

    def removed(log: Log) -> None:
        for where in log:
            log[where][:] = [m for m in log[where] if m.key != worker.encode()]

    cases: list[tuple[str, Callable[[Log], None], Callable[[dict[str, Any]], None]]] = [
        ('altered', altered, lambda r: expect_break(r, worker, 'altered', snapshot[2].seq)),
        ('dropped', dropped, lambda r: expect_break(r, worker, 'missing', events[3][2].seq + 1)),
        ('swapped', swapped, lambda r: expect_break(r, worker, 'reordered', events[2][2].seq)),
        ('forged', forged, lambda r: expect_break(r, worker, 'unsigned', max(x[2].seq for x in records) + 1)),
        ('spliced', spliced, lambda r: expect_break(r, other, 'inserted', None)),
        ('cut', cut, lambda r: expect_cut(r, cut_where)),
        ('removed', removed, lambda r: expect_removed(r, worker)),
    ]
    for name, change, check in cases:
        log = {where: list(messages) for where, messages in original.items()}
        change(log)
        copy = await copy_log(settings, log)
        code, report = await verify(copy, tmp_path, public, '--checkpoint', str(checkpoint))
        assert code == 1, (name, report)
        check(report)

    # Erasure destroys a conversation's key and rewrites no record: its runs still verify.
    async with Projector(settings, db_path=tmp_path / 'projection') as projector:
        await projector.catch_up()
        store = S3MediaStore.from_settings(settings.media)
        await forget_conversation(
            settings, 'conv-0', reader=ProjectionReader.of(projector), media_store=store
        )
    code, report = await verify(settings, tmp_path, public, '--checkpoint', str(checkpoint))
    assert code == 0, report


def expect_break(report: dict[str, Any], run_id: str, problem: str, seq: int | None) -> None:
    assert not report['integrity']['ok']
    assert run_id in report['integrity']['broken']
    found = first_break(report, run_id)
    assert found['problem'] == problem, found
    if seq is not None:
        assert found['seq'] == seq, found


def expect_cut(report: dict[str, Any], where: tuple[str, int]) -> None:
    assert not report['completeness']['ok']
    partition = next(p for p in report['completeness']['partitions'] if (p['topic'], p['partition']) == where)
    assert partition['verdict'] == 'truncated', partition
    assert report['completeness']['missing'], report['completeness']


def expect_removed(report: dict[str, Any], run_id: str) -> None:
    assert not report['completeness']['ok']
    run = next(r for r in report['runs'] if r['run_id'] == run_id)
    assert run['completeness']['verdict'] == 'removed', run


@kafka_only('has no DeleteRecords (its connection closes, and the admin request waits on it)')
async def test_a_checkpoint_goes_to_s3_and_a_trimmed_log_reads_trimmed(
    settings: Settings, tmp_path: Path, keys: tuple[str, Path]
) -> None:
    """`--s3` puts the checkpoint under audit/checkpoints/; records deleted from a partition's start
    (retention, `kafka-delete-records`) read `trimmed` against an older checkpoint."""
    import obstore
    from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

    pem, public = keys
    settings = settings.replace(signing_key=pem)
    run_ids = await write_runs(settings)
    checkpoint = tmp_path / 'checkpoint.json'
    code, out, err = await cli(
        settings, tmp_path / 'unused', 'audit', 'checkpoint', '--out', str(checkpoint), '--s3'
    )
    assert code == 0, err
    key = out.strip().splitlines()[-1].split(f's3://{settings.media.s3_bucket}/', 1)[1]
    assert key.startswith('audit/checkpoints/')
    stored = await obstore.get_async(S3MediaStore.from_settings(settings.media).object_store, key)
    assert bytes(await stored.bytes_async()).decode() == checkpoint.read_text()

    log = await read_log(settings)
    where, messages = max(((w, m) for w, m in log.items() if w[0] == 'step_events'), key=lambda x: len(x[1]))
    cut = len(messages) // 2
    admin = AIOKafkaAdminClient(**client_options(settings.kafka))
    await admin.start()
    try:
        trimmed = TopicPartition(topic_of(settings, where[0]), where[1])
        deleting = admin.delete_records({trimmed: RecordsToDelete(before_offset=cut)}, timeout_ms=10_000)
        await asyncio.wait_for(deleting, 60)
    finally:
        await admin.close()
    code, report = await verify(settings, tmp_path, public, '--checkpoint', str(checkpoint))
    assert code == 1, report
    [partition] = [p for p in report['completeness']['partitions'] if (p['topic'], p['partition']) == where]
    assert partition['verdict'] == 'trimmed', partition
    cut_runs = {decode(m.value).run_id for m in messages[:cut]}
    kept = {decode(m.value).run_id for m in messages[cut:]}
    for run in report['runs']:
        if run['run_id'] in cut_runs - kept:  # every record of it was cut
            assert run['completeness']['verdict'] in ('trimmed', 'removed'), run
    assert set(run_ids) >= cut_runs


WRITER = resolver_id('audit-test')


async def cancelled_mid_call(log: EventLog) -> str:
    """A run cancelled while its tool runs: the call's `started` stands alone, in doubt."""
    entered = asyncio.Event()
    agent = Agent(calls_then_answers('send'), capabilities=[StepPersistence(log=log, run_id='run-in-doubt')])

    @agent.tool_plain
    async def send() -> str:
        entered.set()
        await asyncio.sleep(3600)
        return 'never'

    task = asyncio.create_task(agent.run('send it'))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return 'run-in-doubt'


def answers_in(log: Log) -> list[tuple[tuple[str, int], int, ToolEffectTransition]]:
    """Where each decision and resolution stands, and the record."""
    found = []
    for where, messages in log.items():
        for i, m in enumerate(messages):
            record = decode(m.value)
            if isinstance(record, ToolEffectTransition) and record.status == 'resolved':
                found.append((where, i, record))
    return found


def answer_breaks(report: dict[str, Any], run_id: str) -> list[tuple[str, str, int]]:
    run = next(r for r in report['runs'] if r['run_id'] == run_id)
    return [(b['problem'], b['answer'], b['seq']) for b in run['integrity']['answer_breaks']]


async def test_a_decision_or_resolution_altered_dropped_or_forged_after_a_checkpoint_is_named(
    settings: Settings, projector: Projector, tmp_path: Path, keys: tuple[str, Path]
) -> None:
    pem, public = keys
    settings = settings.replace(signing_key=pem)
    async with EventLog(settings) as log:
        paused = await agent_on(log, []).run('refund order 7', conversation_id='conv-audit')
        in_doubt = await cancelled_mid_call(log)
        await projector.wait_for(await log.flush())
        reader = ProjectionReader.of(projector)
        waiting = {w.effect.tool_name: w.effect for w in await reader.list_waiting()}
        refund, export = waiting['refund'], waiting['export']
        run_id = refund.run_id
        await decide_deferred_call(log, refund, decision='approved', operator='alice', writer_id=WRITER)
        await decide_deferred_call(
            log, export, decision='returned', operator='batch', writer_id=WRITER, result=[3]
        )
        doubt = await reader.get_tool_effect(in_doubt, 'call-0')
        assert doubt is not None and doubt.status == 'started', doubt
        await resolve_tool_effect(
            log,
            doubt,
            resolution='did_not_happen',
            note='the outbox is empty',
            operator='bob',
            writer_id=WRITER,
        )
        await log.flush()
    assert paused.output is not None

    code, report = await verify(settings, tmp_path, public)
    assert code == 0, report
    runs = {r['run_id']: r['integrity'] for r in report['runs']}
    assert (runs[run_id]['answers'], runs[in_doubt]['answers']) == (2, 1)

    checkpoint = tmp_path / 'checkpoint.json'
    code, _, err = await cli(settings, tmp_path / 'unused', 'audit', 'checkpoint', '--out', str(checkpoint))
    assert code == 0, err
    async with EventLog(settings, create_topics=False) as late:  # a decision that lost the race, after it
        await decide_deferred_call(
            late, refund, decision='denied', operator='carol', writer_id=WRITER, message='no'
        )
    original = await read_log(settings)
    answers = answers_in(original)
    approval = next(a for a in answers if a[2].resolved_by == 'alice')
    resolution = next(a for a in answers if a[2].resolved_by == 'bob')
    returned = next(a for a in answers if a[2].resolved_by == 'batch')

    untouched = await copy_log(settings, original)
    code, report = await verify(untouched, tmp_path, public, '--checkpoint', str(checkpoint))
    assert code == 0, report  # the late decision was written after the checkpoint: not a break

    def altered(log: Log) -> None:
        where, i, record = approval
        changed = dataclasses.replace(record, resolved_by='mallory')
        log[where][i] = Message(log[where][i].key, encode(changed))

    def dropped(log: Log) -> None:
        where, i, _ = resolution
        del log[where][i]

    def forged(log: Log) -> None:
        where, i, record = returned
        denial = dataclasses.replace(
            record, resolution='failed', result=None, error='no', resolved_by='mallory'
        )
        log[where].insert(i, Message(run_id.encode(), encode(denial)))

    cases = [
        (
            altered,
            run_id,
            ('altered', 'decision', approval[2].seq),
            ['approved by mallory', 'approved by alice'],
        ),
        (dropped, in_doubt, ('missing', 'resolution', resolution[2].seq), ['did_not_happen by bob']),
        (forged, run_id, ('inserted', 'decision', returned[2].seq), ['failed by mallory']),
    ]
    for change, run, expected, words in cases:
        log = {where: list(messages) for where, messages in original.items()}
        change(log)
        copy = await copy_log(settings, log)
        code, report = await verify(copy, tmp_path, public, '--checkpoint', str(checkpoint))
        assert code == 1, (change.__name__, report)
        assert run in report['integrity']['broken'], report['integrity']
        assert answer_breaks(report, run) == [expected], (change.__name__, report)
        detail = next(r for r in report['runs'] if r['run_id'] == run)['integrity']['answer_breaks'][0][
            'detail'
        ]
        assert all(word in detail for word in words), detail
    code, out, _ = await cli(
        copy,
        tmp_path / 'unused',
        'audit',
        'verify',
        '--all',
        '--trusted-keys',
        str(public),
        '--checkpoint',
        str(checkpoint),
    )
    assert code == 1 and f'run {run_id}: inserted at seq {returned[2].seq}' in out, out
    assert 'the decision (failed by mallory)' in out, out
