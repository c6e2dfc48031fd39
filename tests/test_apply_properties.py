"""Property-based tests of the apply rules: for every generated log, the projection is total,
a pure function of the log, and its views agree with each other.

Logs mix genuine-looking records of a few runs with every kind of hostile record: duplicates
with equal and different content, seqs across both topics, seq jumps, writers racing for a run,
records before their registration, hostile ids, records in the wrong place, garbage bytes and
oversized values. Each log is applied in one pass and again in a random interleaving of its
partitions, cut into random batches, with crashes (a staged batch thrown away) and resumes from
the stored offsets; the logical dumps must be identical.

These run the real `Applier` without Kafka, each on an in-memory shard (`MemoryShard`, the fast
tier) and on RocksDB on disk (`Shard`): the same transactions over two stores, so a property that
holds on one and not the other points at the store. `test_hostile_log.py` proves the same rules
end to end through the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import random
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal, localcontext
from pathlib import Path

import pytest
from fastavro import parse_schema, schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_ai.messages import BinaryContent, ModelMessagesTypeAdapter, ModelRequest, UserPromptPart

from stepstream.errors import SchemaError, StepStreamError
from stepstream.ids import MAX_ID_BYTES
from stepstream.media import REFERENCE_PREFIX, media_uri_for
from stepstream.projector import _parked as parked_module
from stepstream.projector._apply import (
    DLQ_REASONS,
    EFFECTS,
    EVENTS,
    TIMED_KINDS,
    Applier,
    SourceRecord,
)
from stepstream.projector._listing import latest
from stepstream.readmodel import ProjectionReader, inspect_recovery
from stepstream.schemas import (
    CHAIN_STATUSES,
    RUN_STATUSES,
    STEP_EVENT_SCHEMA,
    ModelUsage,
    RunUsage,
    SnapshotDelta,
    StepEvent,
    ToolEffectTransition,
    chain_hash,
    decode,
    encode,
)
from stepstream.schemas._plain import plain_fields, read_plain
from stepstream.storage import (
    BROKEN_COUNT,
    CONFLICTING_COUNT,
    PARKED_COUNT,
    UNRESOLVED_COUNT,
    MemoryShard,
    Shard,
    agent_count,
    status_count,
)
from stepstream.storage._keys import (
    AGENT,
    BROKEN,
    CONFLICT,
    COUNT,
    KEYSPACES,
    LATEST,
    PARKED,
    RUN,
    STATUS,
    UNRESOLVED_RUN,
    Keyspace,
)
from stepstream.storage._state import RunState
from stepstream.timestamps import micros
from stepstream.topics import murmur2_partition

pytestmark = [pytest.mark.fast, pytest.mark.once]

TOPICS = ('props.step-events', 'props.tool-effects')
PARTITIONS = 2
T0 = datetime(2026, 11, 30, tzinfo=UTC)
TAIL = ModelMessagesTypeAdapter.dump_json([ModelRequest(parts=[UserPromptPart('hi')])]).decode()
SEQ_JUMP = 50  # a small limit, so that generated seqs cross it
_URIS = [media_uri_for(f'payload {i}'.encode()) for i in range(3)]
_TEXT_REF_TAIL = ModelMessagesTypeAdapter.dump_json(
    [ModelRequest(parts=[UserPromptPart(REFERENCE_PREFIX + _URIS[0])])]
).decode()
_BINARY_REF_TAIL = ModelMessagesTypeAdapter.dump_json(
    [
        ModelRequest(
            parts=[
                UserPromptPart(
                    [BinaryContent((REFERENCE_PREFIX + _URIS[1]).encode(), media_type='image/png')]
                )
            ]
        )
    ]
).decode()
SNAPSHOT_MEDIA: list[tuple[str, list[str] | None]] = [
    (TAIL, None),  # an earlier writer's record that offloaded nothing
    (TAIL, []),  # a v4 writer's that offloaded nothing
    (_TEXT_REF_TAIL, [_URIS[0]]),
    (TAIL, [_URIS[2], _URIS[1]]),  # what a JSON payload holds is listed, never seen in the text
    (_TEXT_REF_TAIL, None),  # before v4: read from the content, text...
    (_BINARY_REF_TAIL, None),  # ...and binaries (base64 in the JSON)
]
"""(messages, media) of a snapshot record: what its media index entries come from."""

RUN_IDS = ['run-a', 'run-a', 'run-b', 'run-c']
WRITERS = ['owner', 'owner', 'owner', 'intruder', 'w\x00x', 'operator']
CALLS = ['c1', 'c\x00', 'c\x00\x01', '']
PARENTS = [None, 'run-a', 'run-b', 'run-zzz']
KINDS = [
    'run_started',
    'run_started',
    'model_request_started',
    'model_request_completed',
    'model_request_completed',
    'model_request_failed',
    'tool_call_started',
    'tool_call_completed',
    'tool_call_failed',
    'run_completed',
    'run_failed',
    'snapshot_saved',
    'snapshot_saved',
    'run_heartbeat',
]
STATUSES = ['started', 'started', 'completed', 'failed', 'annotated', 'resolved']
HOSTILE = [
    'garbage',
    'tombstone',
    'no_key',
    'wrong_key',
    'wrong_partition',
    'wrong_topic',
    'unknown_kind',
    'bad_run_id',
    'long_id',
    'negative_seq',
    'big_value',
    'bad_resolution',
    'misplaced_usage',
    'bad_usage',
    'bad_media',
]
TOKENS = [1000, 7, 0, 2**39]
COSTS = ['0.004125', None, '1E-3', '0.000000000000000000000000000001']
DURATIONS = [1234, None, 0]
TRACE_IDS = [None, '0af7651916cd43dd8448eb211c80319c']
GARBLED_USAGE = [
    {'tokens': -1},
    {'tokens': 2**41},
    {'cost': 'abc'},
    {'cost': 'NaN'},
    {'cost': '-1'},
    {'cost': '1e12'},
    {'cost': '7' * 70},
    {'cost': '1E-31'},
    {'duration_us': -5},
    {'duration_us': 2**50},
    {'trace_id': 'not-hex'},
]
"""A `bad_usage` record carries one of these: every one is refused (`invalid`)."""


LINKS = ['good'] * 8 + ['none', 'wrong']
"""Mostly chained, some records without a link or with a forged one (decision 0048)."""


@dataclass(frozen=True)
class Op:
    """One record to write: what it is and how it is (mis)placed."""

    is_event: bool
    run_id: str
    writer: str
    seq: int
    kind: str
    status: str
    call: str
    snapshot_seq: int
    prefix_len: int
    parent: str | None
    minute: int
    hostile: str | None
    tokens: int = 0
    cost: str | None = None
    duration_us: int | None = None
    trace_id: str | None = None
    media: int = 0
    """Which `SNAPSHOT_MEDIA` a snapshot record holds."""
    link: str = 'good'
    """Its `prev_hash`: `good` (the hash of its run's genuine record before it), `none` or `wrong`."""


ops = st.builds(
    Op,
    is_event=st.booleans(),
    run_id=st.sampled_from(RUN_IDS),
    writer=st.sampled_from(WRITERS),
    seq=st.one_of(st.integers(0, 5), st.integers(0, 5), st.sampled_from([SEQ_JUMP + 20, 10**9, 2**62])),
    kind=st.sampled_from(KINDS),
    status=st.sampled_from(STATUSES),
    call=st.sampled_from(CALLS),
    snapshot_seq=st.integers(0, 3),
    prefix_len=st.integers(0, 2),
    parent=st.sampled_from(PARENTS),
    minute=st.integers(0, 5),
    hostile=st.one_of(st.none(), st.none(), st.none(), st.sampled_from(HOSTILE)),
    tokens=st.sampled_from(TOKENS),
    cost=st.sampled_from(COSTS),
    duration_us=st.sampled_from(DURATIONS),
    trace_id=st.sampled_from(TRACE_IDS),
    media=st.integers(0, len(SNAPSHOT_MEDIA) - 1),
    link=st.sampled_from(LINKS),
)


@st.composite
def logs(draw: st.DrawFn) -> list[Op]:
    """Coherent runs (an owner writing seqs 0..n across both topics) with twins on the other
    topic, exact repeats and different records at one seq, plus random and hostile records, all
    in a random order (so seqs go backwards and records come before their registration)."""
    out: list[Op] = []
    for run_id in draw(st.lists(st.sampled_from(RUN_IDS), unique=True, min_size=1, max_size=3)):
        parent = draw(st.sampled_from(PARENTS))
        for seq in range(draw(st.integers(1, 7))):
            op = replace(draw(ops), run_id=run_id, writer='owner', seq=seq, parent=parent, hostile=None)
            if seq == 0:
                op = replace(op, is_event=True, kind='run_started')
            out.append(op)
            if draw(st.integers(0, 3)) == 0:
                out.append(replace(op, is_event=not op.is_event))  # a twin on the other topic
            if draw(st.integers(0, 4)) == 0:
                out.append(op)  # an exact repeat (a producer retry)
            if draw(st.integers(0, 5)) == 0:
                out.append(replace(op, minute=op.minute + 1))  # another record at the same seq
            if not op.is_event and op.status == 'started' and draw(st.integers(0, 2)) == 0:
                # an operator's answer to it (it holds no seq of the run)
                out.append(replace(op, writer='operator', status='resolved', minute=op.minute + 2))
    out += draw(st.lists(ops, max_size=12))
    return draw(st.permutations(out))


def to_source(
    op: Op, offsets: dict[tuple[int, int], int], heads: dict[tuple[str, int], str] | None = None
) -> SourceRecord:
    """The record an op writes, at the next offset of the partition it lands in.

    Its `prev_hash` links to `heads[(run, seq - 1)]`, the genuine record before it (`make_log`).
    """
    prev_hash = {
        'good': (heads or {}).get((op.run_id, op.seq - 1)),
        'none': None,
        'wrong': 'f' * 64,
    }[op.link]
    ts = T0 + timedelta(minutes=op.minute)
    run_id = '../escape' if op.hostile == 'bad_run_id' else op.run_id
    call = 'x' * (MAX_ID_BYTES + 1) if op.hostile == 'long_id' else op.call
    seq = -1 if op.hostile == 'negative_seq' else op.seq
    error = 'e' * 300_000 if op.hostile == 'big_value' else None
    record: StepEvent | ToolEffectTransition
    if op.hostile == 'misplaced_usage' and op.kind == 'model_request_completed':
        op = replace(op, kind='model_request_started')  # usage is not misplaced on the one kind it belongs to
    if op.hostile == 'bad_usage':
        op = replace(
            op, kind='model_request_completed', **GARBLED_USAGE[(op.minute * 7 + op.seq) % len(GARBLED_USAGE)]
        )
    if op.is_event:
        usage = None
        if op.kind == 'model_request_completed' or op.hostile == 'misplaced_usage':
            usage = ModelUsage(
                model_name='gpt-4o',
                input_tokens=op.tokens,
                output_tokens=op.tokens // 3,
                cache_read_tokens=op.tokens // 2,
                cache_write_tokens=op.tokens // 4,
                cost_usd=op.cost,
            )
        snapshot = None
        if op.hostile == 'bad_media':
            op = replace(op, kind='snapshot_saved')
        if op.kind == 'snapshot_saved':
            messages, media = SNAPSHOT_MEDIA[op.media]
            snapshot = SnapshotDelta(
                snapshot_seq=op.snapshot_seq,
                state='complete' if op.minute % 2 else 'interrupted',
                prefix_len=op.prefix_len,
                messages=messages,
                media=['../not-a-uri', *(media or [])] if op.hostile == 'bad_media' else media,
            )
        record = StepEvent(
            run_id=run_id,
            seq=seq,
            writer_id=op.writer,
            timestamp=ts,
            kind='some_future_kind' if op.hostile == 'unknown_kind' else op.kind,  # type: ignore[arg-type]
            parent_run_id=op.parent,
            conversation_id='conv\x00' if op.minute < 3 else 'conv',
            tool_call_id=call,
            error=error,
            snapshot=snapshot,
            usage=usage,
            duration_us=op.duration_us if op.kind in TIMED_KINDS or op.hostile == 'misplaced_usage' else None,
            trace_id=op.trace_id,
            span_id=op.trace_id[:16] if op.trace_id is not None else None,
            prev_hash=prev_hash,
        )
    else:
        resolved = op.status == 'resolved' or op.hostile == 'bad_resolution'
        record = ToolEffectTransition(
            run_id=run_id,
            seq=seq,
            writer_id=op.writer,
            timestamp=ts,
            tool_call_id=call,
            tool_name=f'tool-{op.minute}',
            status=op.status,  # type: ignore[arg-type]
            error=error,
            resolution=('did_not_happen' if op.minute % 2 else 'happened') if resolved else None,
            resolved_by='ops@example' if resolved else None,
            note=('' if op.hostile == 'bad_resolution' else f'checked at minute {op.minute}')
            if resolved
            else None,
            prev_hash=None if resolved else prev_hash,
        )
    value: bytes | None = encode(record)
    key: bytes | None = run_id.encode()
    topic = EVENTS if op.is_event else EFFECTS
    partition = murmur2_partition(run_id.encode(), PARTITIONS)
    if op.hostile == 'garbage':
        value = b'\xc3\x01' + bytes(range(op.minute * 7, op.minute * 7 + 20))
    elif op.hostile == 'tombstone':
        value = None
    elif op.hostile == 'no_key':
        key = None
    elif op.hostile == 'wrong_key':
        key = b'another-run'
    elif op.hostile == 'wrong_partition':
        partition = 1 - partition
    elif op.hostile == 'wrong_topic':
        topic = 1 - topic
    offset = offsets.get((topic, partition), 0)
    offsets[(topic, partition)] = offset + 1
    return SourceRecord(topic, partition, offset, key, value)


def chain_heads(generated: list[Op]) -> dict[tuple[str, int], str]:
    """The hash of each run's genuine record at each seq (its owner's first, in log order), chained."""
    genuine: dict[tuple[str, int], Op] = {}
    for op in generated:
        if op.writer == 'owner' and op.hostile is None and op.status != 'resolved':
            genuine.setdefault((op.run_id, op.seq), op)
    heads: dict[tuple[str, int], str] = {}
    for (run_id, seq), op in sorted(genuine.items(), key=lambda item: item[0][1]):
        value = to_source(op, {}, heads).value
        assert value is not None
        heads[(run_id, seq)] = chain_hash(value)
    return heads


def make_log(generated: list[Op]) -> dict[tuple[int, int], list[SourceRecord]]:
    """Each (topic, partition) sequence of the log, in offset order; the runs' records chained."""
    offsets: dict[tuple[int, int], int] = {}
    log: dict[tuple[int, int], list[SourceRecord]] = {}
    heads = chain_heads(generated)
    for op in generated:
        source = to_source(op, offsets, heads)
        log.setdefault((source.topic, source.partition), []).append(source)
    return log


STORES = ['memory', 'rocksdb']
"""Every rule below is proven on both stores (`store` parametrizes the tests)."""

AnyShard = Shard | MemoryShard


def open_store(path: str | Path, store: str) -> AnyShard:
    """A new, empty shard of the kind `store` names (`path` is where RocksDB keeps it)."""
    return MemoryShard() if store == 'memory' else Shard.open(path, create=True)


def reopen(shard: AnyShard) -> AnyShard:
    """A process restart: RocksDB is closed and opened again; memory is all a process keeps."""
    if isinstance(shard, MemoryShard):
        return shard
    shard.close()
    return Shard.open(shard.path)


def applier() -> Applier:
    return Applier(TOPICS, partitions=PARTITIONS, max_snapshots_per_run=2, max_seq_jump=SEQ_JUMP)


def apply_in_one_pass(
    path: str, log: dict[tuple[int, int], list[SourceRecord]], store: str
) -> list[tuple[bytes, bytes]]:
    """One batch, the tool-effects topic first: every transition arrives before any step event."""
    db = open_store(path, store)
    try:
        txn, _ = applier().stage(db, [r for tp in sorted(log, reverse=True) for r in log[tp]])
        txn.commit()
        return list(db.logical_items())
    finally:
        db.close()


def apply_with_crashes(
    path: str,
    log: dict[tuple[int, int], list[SourceRecord]],
    seed: int,
    store: str,
    make_applier: Callable[[], Applier] = applier,
) -> list[tuple[bytes, bytes]]:
    """Random interleaving, random batches, random crashes and resumes from the stored offsets."""
    rng = random.Random(seed)
    db = open_store(path, store)
    crashes = 0
    try:
        while True:
            stored = db.offsets()
            cursor = {tp: stored.get(_tp(tp), 0) for tp in log}
            if all(cursor[tp] >= len(seq) for tp, seq in log.items()):
                return list(db.logical_items())
            batch: list[SourceRecord] = []
            for _ in range(rng.randint(1, 12)):
                open_seqs = [tp for tp in log if cursor[tp] < len(log[tp])]
                if not open_seqs:
                    break
                tp = rng.choice(open_seqs)
                batch.append(log[tp][cursor[tp]])
                cursor[tp] += 1
            # A fresh applier per batch: it keeps nothing between batches, as after a restart.
            txn, _ = make_applier().stage(db, batch)
            if crashes < 6 and rng.random() < 0.2:
                crashes += 1
                if rng.random() < 0.5:  # a process restart: the store is closed and reopened
                    db = reopen(db)
                continue
            txn.commit()
    finally:
        db.close()


def _tp(tp: tuple[int, int]) -> object:
    from aiokafka.structs import TopicPartition

    return TopicPartition(TOPICS[tp[0]], tp[1])


@pytest.mark.parametrize('store', STORES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated=logs(), seed=st.integers(0, 2**32))
def test_the_projection_is_a_pure_function_of_the_log(generated: list[Op], seed: int, store: str) -> None:
    log = make_log(generated)
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as other:
        reference = apply_in_one_pass(one, log, store)
        replayed = apply_with_crashes(other, log, seed, store)
    assert replayed == reference


def interleave(log: dict[tuple[int, int], list[SourceRecord]], rng: random.Random) -> list[SourceRecord]:
    """One consumption order of the log: each (topic, partition) in offset order, mixed at random."""
    cursor = dict.fromkeys(log, 0)
    out: list[SourceRecord] = []
    while open_seqs := [tp for tp in log if cursor[tp] < len(log[tp])]:
        tp = rng.choice(open_seqs)
        out.append(log[tp][cursor[tp]])
        cursor[tp] += 1
    return out


def apply_in_batches(
    path: str, records: list[SourceRecord], sizes: list[int], *, one_applier: bool, store: str
) -> tuple[list[tuple[bytes, bytes]], list[tuple[str, tuple[int, int, int], str]], int, int]:
    """Every key and value of the store, with the batches' dead letters and counts, in order.

    With `one_applier` every batch goes to one `Applier` (as in a projector), else each batch
    to a new one (as after restarts)."""
    db = open_store(path, store)
    dead, applied, duplicates, at = [], 0, 0, 0
    shared = applier()
    try:
        for size in sizes:
            txn, outcome = (shared if one_applier else applier()).stage(db, records[at : at + size])
            txn.commit()
            at += size
            dead += [(d.reason, d.source.coordinates, d.detail) for d in outcome.dead]
            applied, duplicates = applied + outcome.applied, duplicates + outcome.duplicates
        return list(db.items()), dead, applied, duplicates
    finally:
        db.close()


@pytest.mark.parametrize('store', STORES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated=logs(), seed=st.integers(0, 2**32), one_partition=st.booleans())
def test_batch_cuts_change_nothing_in_the_store(
    generated: list[Op], seed: int, one_partition: bool, store: str
) -> None:
    """The same records applied one per batch (a new `Applier` each) and in batches of random
    sizes (one `Applier`): the stores are equal byte for byte (offsets and DLQ counts included),
    and so are the dead letters. Either the partitions mixed, or each batch from one partition
    number (a shard's batches)."""
    rng = random.Random(seed)
    log = make_log(generated)
    if one_partition:
        parts = [interleave({tp: log[tp] for tp in log if tp[1] == p}, rng) for p in range(PARTITIONS)]
    else:
        parts = [interleave(log, rng)]
    records, sizes = [r for part in parts for r in part], []
    for part in parts:
        left = len(part)
        while left:
            sizes.append(min(left, rng.choice([1, 2, 3, 5, 8, 13, len(part)])))
            left -= sizes[-1]
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as other:
        single = apply_in_batches(one, records, [1] * len(records), one_applier=False, store=store)
        batched = apply_in_batches(other, records, sizes, one_applier=True, store=store)
    assert batched == single


@pytest.mark.parametrize('store', STORES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated=logs())
def test_views_agree_with_each_other(generated: list[Op], store: str) -> None:
    log = make_log(generated)
    with tempfile.TemporaryDirectory() as path:
        db = open_store(path, store)
        try:
            txn, outcome = applier().stage(db, [r for seq in log.values() for r in seq])
            txn.commit()
            assert {dead.reason for dead in outcome.dead} <= set(DLQ_REASONS)
            refused = sum(
                op.hostile not in (None, 'big_value')
                and (
                    op.hostile not in ('unknown_kind', 'misplaced_usage', 'bad_usage', 'bad_media')
                    or op.is_event
                )
                and (op.hostile != 'bad_resolution' or not op.is_event)
                for op in generated
            )
            assert len(outcome.dead) >= refused  # every record that cannot apply was refused
            check_run_indexes(db)
            asyncio.run(check_views(ProjectionReader(db)))
            for stale_after_s in (20.0, 1e10):  # T0's runs stale now, or all still live
                asyncio.run(check_unresolved_summary(ProjectionReader(db, stale_after_s=stale_after_s)))
        finally:
            db.close()


async def check_unresolved_summary(reader: ProjectionReader) -> None:
    """What `/metrics` shows, from the unresolved index's keys alone, is what reading each call says."""
    listed = await reader.list_unresolved_tool_effects()
    summary = await reader.unresolved_summary()
    assert summary.in_flight == sum(e.in_flight for e in listed)
    assert summary.in_doubt == sum(e.unknown_after_crash for e in listed)
    doubted = [e.started_at for e in listed if e.unknown_after_crash]
    assert summary.oldest_in_doubt == min(doubted, default=None)


def check_run_indexes(shard: AnyShard) -> None:
    """`STATUS`, `AGENT`, `LATEST` and `COUNT` say exactly what the registered runs' states say."""
    states = [RunState.decode(v) for _, v in shard.scan(RUN.tag)]
    assert {k for k, _ in shard.scan(STATUS.tag)} == {
        STATUS.key(s.status, s.started_at, s.run_id) for s in states
    }
    assert {k for k, _ in shard.scan(AGENT.tag)} == {
        AGENT.key(s.agent_name, s.status, s.started_at, s.run_id) for s in states if s.agent_name is not None
    }
    assert {k for k, _ in shard.scan(LATEST.tag)} == {
        LATEST.key(latest(s), s.run_id) for s in states if s.status == 'running'
    }
    expected = Counter(status_count(s.status) for s in states)
    expected.update(agent_count(s.agent_name) for s in states if s.agent_name is not None)
    expected[UNRESOLVED_COUNT] = sum(1 for _ in shard.scan(UNRESOLVED_RUN.tag))
    expected[PARKED_COUNT] = sum(1 for _ in shard.scan(PARKED.tag))
    assert {k for k, _ in shard.scan(BROKEN.tag)} == {
        BROKEN.key(s.started_at, s.run_id) for s in states if s.chain_break is not None
    }
    expected[BROKEN_COUNT] = sum(1 for s in states if s.chain_break is not None)
    conflicting = {CONFLICT.parse(k)[0] for k, _ in shard.scan(CONFLICT.tag)}
    assert conflicting == {s.run_id for s in states if s.conflicting_writers}
    expected[CONFLICTING_COUNT] = len(conflicting)
    assert {k: int(v) for k, v in shard.scan(COUNT.tag)} == {k: n for k, n in expected.items() if n}


async def check_views(reader: ProjectionReader) -> None:
    runs = await reader.list_runs()
    for chain in CHAIN_STATUSES:  # `broken` through `BROKEN`
        listed = [r.run_id for r in await reader.list_runs(chain=chain)]
        assert listed == [r.run_id for r in runs if r.chain == chain], chain
    for run in runs:  # where it broke is said exactly when it is broken
        assert (
            (run.chain == 'broken') == (run.chain_break_seq is not None) == (run.chain_break_at is not None)
        )
    for status in RUN_STATUSES:  # through `STATUS`
        listed = [r.run_id for r in await reader.list_runs(status=status)]
        assert listed == [r.run_id for r in runs if r.status == status], status
    for agent in {r.agent_name for r in runs if r.agent_name is not None}:  # through `AGENT`
        listed = [r.run_id for r in await reader.list_runs(agent_name=agent, newest_first=True)]
        assert listed == [r.run_id for r in reversed(runs) if r.agent_name == agent], agent
    listed_unresolved = await reader.list_unresolved_tool_effects()
    every_unresolved = {(e.run_id, e.tool_call_id) for e in listed_unresolved}
    counts = (await reader.status()).runs  # the tallies agree with the listings
    assert counts is not None
    assert counts.by_status == {s: sum(r.status == s for r in runs) for s in RUN_STATUSES}
    agents = Counter(r.agent_name for r in runs if r.agent_name is not None)
    assert counts.by_agent == dict(sorted(agents.items()))
    assert counts.unresolved_effects == len(every_unresolved)
    per_run_unresolved = set()
    for run in runs:
        unresolved = await reader.list_unresolved_tool_effects(run.run_id)
        per_run_unresolved |= {(e.run_id, e.tool_call_id) for e in unresolved}
        effects = await reader.list_tool_effects(run.run_id)
        assert {e.tool_call_id for e in effects if e.doubt is not None} == {
            e.tool_call_id for e in unresolved
        }
        for effect in effects:  # resolved: by exactly the first resolution of its latest `started`
            applied = [r for r in effect.resolutions if r.applied]
            assert (effect.status == 'resolved') == bool(applied) == (effect.resolution is not None)
            assert len(applied) <= 1 and not (effect.unknown_after_crash and applied)
        report = await inspect_recovery(reader, run_id=run.run_id)
        assert [e.tool_call_id for e in report.unresolved] == [e.tool_call_id for e in unresolved]

        tree = await reader.run_tree(run.run_id)
        children = {r.run_id for r in tree if r.parent_run_id == run.run_id and r.run_id != run.run_id}
        listed = {r.run_id for r in await reader.list_runs(parent_run_id=run.run_id)}
        assert children == listed - {run.run_id}
        if run.parent_run_id is not None:
            assert run.run_id in {r.run_id for r in await reader.list_runs(parent_run_id=run.parent_run_id)}

        missing = sum(high - low + 1 for low, high in run.gaps)
        assert run.event_count + missing == run.last_seq + 1
        events = await reader.list_events(run.run_id)
        assert [e.seq for e in events] == sorted({e.seq for e in events})
        assert run.usage == usage_of(events)
        # A generated log may lack snapshot 0: the reader says so, it does not crash.
        with contextlib.suppress(StepStreamError):
            await reader.list_snapshots(run.run_id, include_interrupted=True)
    assert per_run_unresolved == every_unresolved


@pytest.mark.parametrize('store', STORES)
def test_parked_records_are_kept_decoded_within_bounds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, store: str
) -> None:
    """A run's transitions parked over many batches stay decoded only within the byte bound,
    and its registration applies every one of them, the kept and the dropped alike."""
    monkeypatch.setattr(parked_module, 'PARKED_DECODED_BYTES', 2_000)
    run_id = 'run-a'
    partition = murmur2_partition(run_id.encode(), PARTITIONS)
    transitions = [
        SourceRecord(EFFECTS, partition, seq - 1, run_id.encode(), encode(ToolEffectTransition(
            run_id=run_id, seq=seq, writer_id='owner', timestamp=T0, tool_call_id=f'c{seq}',
            tool_name='tool', status='started', error='e' * 200,
        )))
        for seq in range(1, 41)
    ]  # fmt: skip
    started = SourceRecord(EVENTS, partition, 0, run_id.encode(), encode(StepEvent(
        run_id=run_id, seq=0, writer_id='owner', timestamp=T0, kind='run_started'
    )))  # fmt: skip
    one = applier()
    db = open_store(tmp_path / 'projection', store)
    try:
        for at in range(0, len(transitions), 7):
            txn, _ = one.stage(db, transitions[at : at + 7])
            txn.commit()
            assert 0 < one._parked.size_bytes <= 2_000
        txn, outcome = one.stage(db, [started])
        txn.commit()
        assert (outcome.applied, outcome.dead) == (41, [])
        assert one._parked.size_bytes == 0 and not one._parked
        unresolved = asyncio.run(ProjectionReader(db).list_unresolved_tool_effects(run_id))
        assert len(unresolved) == 40
    finally:
        db.close()


def _long_timestamps(node: object) -> object:
    """A schema with its timestamp-micros read as the long it is on the wire."""
    if isinstance(node, list):
        return [_long_timestamps(item) for item in node]
    if isinstance(node, dict):
        return {k: _long_timestamps(v) for k, v in node.items() if k != 'logicalType'}
    return node


RAW_EVENT_SCHEMA = parse_schema(
    _long_timestamps(json.loads(STEP_EVENT_SCHEMA.path.read_text())), named_schemas={}
)
EVENT_HEADER = encode(StepEvent(run_id='r', seq=0, writer_id='w', timestamp=T0, kind='run_started'))[:10]
TIMESTAMP_EDGES = [micros(datetime.min.replace(tzinfo=UTC)), micros(datetime.max.replace(tzinfo=UTC)), 0]


@settings(max_examples=300, deadline=None)
@given(
    timestamp=st.one_of(
        st.sampled_from([t + d for t in TIMESTAMP_EDGES for d in (-1, 0, 1)] + [-(2**63), 2**63 - 1]),
        st.integers(-(2**63), 2**63 - 1),
    ),
    snapshot=st.booleans(),
    damage=st.one_of(st.none(), st.tuples(st.integers(0, 400), st.integers(0, 255), st.booleans())),
)
def test_the_plain_reader_takes_exactly_what_decode_takes(
    timestamp: int, snapshot: bool, damage: tuple[int, int, bool] | None
) -> None:
    """Any body, timestamp or damage: the plain fields equal the decoded record's, or both refuse."""
    delta = {'snapshot_seq': 2, 'state': 'complete', 'prefix_len': 1, 'messages': TAIL}
    fields = {
        'run_id': 'run-a', 'seq': 3, 'writer_id': 'w', 'timestamp': timestamp, 'agent_name': None,
        'conversation_id': 'c', 'parent_run_id': None,
        'kind': 'snapshot_saved' if snapshot else 'run_started',
        'step_index': 1, 'tool_call_id': None, 'tool_name': None, 'error': None, 'metadata': {'k': 'v'},
        'idempotency_key': 'i', 'snapshot': delta if snapshot else None,
    }  # fmt: skip
    body = io.BytesIO()
    schemaless_writer(body, RAW_EVENT_SCHEMA, fields)
    value = EVENT_HEADER + body.getvalue()
    if damage is not None:
        at, byte, cut = damage
        value = value[:at] if cut else value[:at] + bytes([byte]) + value[at + 1 :]
    try:
        expected: tuple[int, dict[str, object]] | None = plain_fields(decode(value))
    except SchemaError:
        expected = None
    assert read_plain(value) == expected


text = st.text(alphabet=st.sampled_from(['a', 'b', '\x00', '\x01', '\xff', 'é', '\U0001f600']), max_size=6)
components = {'str': text, 'int': st.integers(-(2**63), 2**63 - 1)}


@given(space=st.sampled_from(KEYSPACES), data=st.data())
def test_keys_round_trip_and_keep_order(space: Keyspace, data: st.DataObject) -> None:
    parts = [data.draw(components[kind]) for kind in space.parts]
    others = [data.draw(components[kind]) for kind in space.parts]
    assert space.parse(space.key(*parts)) == tuple(parts)
    assert (space.key(*parts) < space.key(*others)) == (parts < others)
    assert space.key(*parts).startswith(space.prefix(*parts[:1]))


@given(st.sets(st.integers(0, 60), max_size=40), st.randoms())
def test_claimed_seqs_are_kept_as_exact_ranges(seqs: set[int], rng: random.Random) -> None:
    run = RunState(run_id='r', owner='w', started_at=0)
    order = sorted(seqs)
    rng.shuffle(order)
    for seq in order:
        assert not run.holds(seq)
        run.claim(seq)
        assert run.holds(seq)
    expanded = {s for low, high in run.seqs for s in range(low, high + 1)}
    assert expanded == seqs
    assert all(a[1] + 1 < b[0] for a, b in zip(run.seqs, run.seqs[1:], strict=False))
    assert run.record_count == len(seqs)
    assert RUN.parse(RUN.key('r')) == ('r',)


RESOLVE_TARGETS = [
    'unknown',
    'completed',
    'failed',
    'missing_call',
    'stale_seq',
    'garbage',
    'no_note',
    'unknown_run',
]


@pytest.mark.parametrize('store', STORES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    targets=st.lists(st.sampled_from(RESOLVE_TARGETS), min_size=1, max_size=6),
    resolution=st.sampled_from(['happened', 'did_not_happen']),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
def test_a_resolution_resolves_only_an_unknown_effect(
    targets: list[str],
    resolution: str,
    sizes: list[int],
    tmp_path_factory: pytest.TempPathFactory,
    store: str,
) -> None:
    """Operators' resolutions of every kind, after a run with an unknown, a completed and a failed
    call: the unknown one is resolved by the first resolution that answers its `started`; a
    completed or failed call stays as it was (the resolution is only history); one for a call
    that does not exist, or a garbage one, goes to the DLQ; every batch applies."""
    run_id = 'run-a'
    partition = murmur2_partition(run_id.encode(), PARTITIONS)
    offsets: dict[int, int] = {}

    def source(record: StepEvent | ToolEffectTransition, value: bytes | None = None) -> SourceRecord:
        topic = EVENTS if isinstance(record, StepEvent) else EFFECTS
        offset = offsets[topic] = offsets.get(topic, -1) + 1
        return SourceRecord(topic, partition, offset, record.run_id.encode(), value or encode(record))

    def transition(seq: int, call: str, status: str) -> ToolEffectTransition:
        return ToolEffectTransition(
            run_id=run_id, seq=seq, writer_id='owner', timestamp=T0, tool_call_id=call,
            tool_name='publish', status=status,  # type: ignore[arg-type]
        )  # fmt: skip

    log = [
        source(StepEvent(run_id=run_id, seq=0, writer_id='owner', timestamp=T0, kind='run_started')),
        source(transition(1, 'unknown', 'started')),
        source(transition(2, 'completed', 'started')),
        source(transition(3, 'completed', 'completed')),
        source(transition(4, 'failed', 'started')),
        source(transition(5, 'failed', 'failed')),
    ]
    started_seq = {'unknown': 1, 'completed': 2, 'failed': 4}
    expected_dead: list[str] = []
    first_answer = None
    for n, target in enumerate(targets):
        call = target if target in started_seq else 'unknown'
        record = ToolEffectTransition(
            run_id='run-b' if target == 'unknown_run' else run_id,
            seq=0 if target == 'stale_seq' else started_seq.get(call, 1),
            writer_id=f'stepstream-resolve:ops-{n}',
            timestamp=T0 + timedelta(minutes=n),
            tool_call_id='no-such-call' if target == 'missing_call' else call,
            tool_name='publish',
            status='resolved',
            resolution=resolution,  # type: ignore[arg-type]
            resolved_by=f'ops-{n}',
            note='' if target == 'no_note' else f'checked the channel ({n})',
        )
        if target == 'unknown_run':
            record = replace(record, run_id=run_id)  # encoded for run-b below: a record under the wrong key
        value = b'\xc3\x01' + bytes(12) if target == 'garbage' else None
        log.append(source(record, value))
        if target == 'unknown_run':
            log[-1] = replace(log[-1], key=b'run-b', partition=murmur2_partition(b'run-b', PARTITIONS))
        expected_dead.append(
            {'garbage': 'unknown_version', 'no_note': 'invalid', 'missing_call': 'unknown_effect'}.get(
                target, 'wrong_key' if target == 'unknown_run' else ''
            )
        )
        if target == 'unknown' and first_answer is None:
            first_answer = f'ops-{n}'

    path = tmp_path_factory.mktemp('resolve') / 'projection'
    db = open_store(path, store)
    try:
        dead, at = [], 0
        one = applier()
        while at < len(log):
            size = sizes[len(dead) % len(sizes)] if at else 6  # the run first, then resolutions in batches
            txn, outcome = one.stage(db, log[at : at + size])
            txn.commit()
            dead += [d.reason for d in outcome.dead]
            at += size
        assert sorted(dead) == sorted(reason for reason in expected_dead if reason)
        reader = ProjectionReader(db)
        effects = {e.tool_call_id: e for e in asyncio.run(reader.list_tool_effects(run_id))}
        assert set(effects) == {'unknown', 'completed', 'failed'}
        assert (effects['completed'].status, effects['failed'].status) == ('completed', 'failed')
        assert effects['completed'].resolution is None and effects['failed'].resolution is None
        unknown = effects['unknown']
        if first_answer is None:
            assert unknown.unknown_after_crash and unknown.resolution is None
        else:
            assert unknown.status == 'resolved' and not unknown.unknown_after_crash
            assert unknown.resolution is not None and unknown.resolution.resolved_by == first_answer
            assert unknown.resolution.resolution == resolution
        kept = {t: sum(1 for x in targets if x == t) for t in ('unknown', 'completed', 'failed', 'stale_seq')}
        assert len(unknown.resolutions) == kept['unknown'] + kept['stale_seq']  # the ledger keeps them all
        assert len(effects['completed'].resolutions) == kept['completed']
        unresolved = asyncio.run(reader.list_unresolved_tool_effects())
        assert [e.tool_call_id for e in unresolved] == ([] if first_answer else ['unknown'])
    finally:
        db.close()


@pytest.mark.parametrize('store', STORES)
def test_a_resolution_before_every_live_transition_is_dead_whichever_topic_comes_first(
    tmp_path: Path, store: str
) -> None:
    """A step event takes the seq of the `started` a resolution answers, and the call's only other
    transition comes after the resolution: the resolution answered nothing that stays, so it goes
    to the DLQ, whether the step event is applied before the transitions or after them."""
    run_id = 'run-a'
    partition = murmur2_partition(run_id.encode(), PARTITIONS)
    key = run_id.encode()

    def effect(offset: int, seq: int, status: str, **resolution: str) -> SourceRecord:
        t = ToolEffectTransition(
            run_id=run_id, seq=seq, writer_id='owner' if not resolution else 'ops-cli', timestamp=T0,
            tool_call_id='c1', tool_name='publish', status=status, **resolution,  # type: ignore[arg-type]
        )  # fmt: skip
        return SourceRecord(EFFECTS, partition, offset, key, encode(t))

    def event(offset: int, seq: int, kind: str) -> SourceRecord:
        e = StepEvent(run_id=run_id, seq=seq, writer_id='owner', timestamp=T0, kind=kind)  # type: ignore[arg-type]
        return SourceRecord(EVENTS, partition, offset, key, encode(e))

    events = [event(0, 0, 'run_started'), event(1, 1, 'model_request_started')]
    effects = [
        effect(0, 1, 'started'),
        effect(1, 1, 'resolved', resolution='happened', resolved_by='ops', note='seen it'),
        effect(2, 2, 'completed'),
    ]
    dumps, dead = [], []
    for name, order in (('events-first', events + effects), ('effects-first', effects + events)):
        db = open_store(tmp_path / name, store)
        try:
            txn, outcome = applier().stage(db, order)
            txn.commit()
            dumps.append(list(db.logical_items()))
            dead.append(
                sorted((d.reason, d.source.offset) for d in outcome.dead if d.source.topic == EFFECTS)
            )
        finally:
            db.close()
    assert dead[0] == dead[1] == [('duplicate_seq', 0), ('unknown_effect', 1)]
    assert dumps[0] == dumps[1]


def usage_of(events: list[StepEvent]) -> RunUsage:
    """The sums a run record shows, computed again from its events (a second implementation)."""
    sums = RunUsage()
    priced: list[Decimal] = []
    for e in events:
        if e.kind == 'model_request_completed':
            sums.model_requests += 1
            if e.usage is not None:
                sums.requests += e.usage.requests
                sums.input_tokens += e.usage.input_tokens
                sums.output_tokens += e.usage.output_tokens
                sums.cache_read_tokens += e.usage.cache_read_tokens
                sums.cache_write_tokens += e.usage.cache_write_tokens
            if e.usage is None or e.usage.cost_usd is None:
                sums.unpriced_requests += 1
            else:
                priced.append(Decimal(e.usage.cost_usd))
        if e.kind.startswith('model_request') and e.duration_us is not None:
            sums.model_request_us += e.duration_us
        if e.kind in ('tool_call_completed', 'tool_call_failed'):
            sums.tool_calls += 1
            sums.tool_call_failures += e.kind == 'tool_call_failed'
            sums.tool_call_us += e.duration_us or 0
    if priced:
        with localcontext(prec=200):
            sums.cost_usd = format(sum(priced, Decimal(0)), 'f')
    return sums
