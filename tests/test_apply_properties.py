"""Property-based tests of the apply rules: for every generated log, the projection is total,
a pure function of the log, and its views agree with each other.

Logs mix genuine-looking records of a few runs with every kind of hostile record: duplicates
with equal and different content, seqs across both topics, seq jumps, writers racing for a run,
records before their registration, hostile ids, records in the wrong place, garbage bytes and
oversized values. Some runs end waiting on deferred calls (approval, question, external) and get
decisions (decision 0056): valid ones, the same bytes resent, conflicting ones by other writers,
decisions for calls that do not wait (unknown, started, completed, decided already, another run's,
an unknown run's) and malformed ones. Each log is applied in one pass and again in a random
interleaving of its partitions, cut into random batches, with crashes (a staged batch thrown away)
and resumes from the stored offsets; the logical dumps must be identical.

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
    DECISIONS,
    DEFERRALS,
    MAX_NOTE_CHARS,
    RESOLUTIONS,
    RESUMED_BY_KEY,
    RUN_STATUSES,
    STEP_EVENT_SCHEMA,
    ModelUsage,
    RunUsage,
    SnapshotDelta,
    StepEvent,
    ToolEffectRecord,
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
    EffectState,
    MemoryShard,
    Shard,
    agent_count,
    status_count,
    waiting_count,
)
from stepstream.storage._keys import (
    AGENT,
    BROKEN,
    BY_TAG,
    CONFLICT,
    COUNT,
    EFFECT,
    KEYSPACES,
    LATEST,
    PARKED,
    PROCESS_LOCAL,
    RUN,
    STATUS,
    UNRESOLVED_RUN,
    WAITING,
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
_PROMPTS_TAIL = ModelMessagesTypeAdapter.dump_json(
    [
        ModelRequest(parts=[UserPromptPart('Refund the order')]),
        ModelRequest(parts=[UserPromptPart('and the invoice, too')]),
    ]
).decode()
SNAPSHOT_MEDIA: list[tuple[str, list[str] | None]] = [
    (TAIL, None),  # an earlier writer's record that offloaded nothing
    (_PROMPTS_TAIL, []),  # two user prompts: their words are searched (decision 0062)
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
    'tool_call_deferred',
    'run_completed',
    'run_waiting',
    'run_failed',
    'snapshot_saved',
    'snapshot_saved',
    'run_heartbeat',
    'run_resumed',
]
STATUSES = ['started', 'started', 'completed', 'failed', 'annotated', 'resolved', 'deferred']
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

DEFERRALS_SORTED = sorted(DEFERRALS)
DECIDED_BY = {
    'approval': ['approved', 'approved', 'denied'],
    'question': ['returned', 'failed'],
    'external': ['returned', 'returned', 'failed'],
}
"""The decisions a writer makes for each kind of deferred call (`decision_for` refuses the others)."""
FLAWS: dict[str, tuple[str | None, dict[str, str | None]]] = {
    'args_on_denial': ('denied', {'args': '{"amount": 1}'}),
    'no_message': ('denied', {'error': None}),
    'message_on_approval': ('approved', {'error': 'no reason'}),
    'no_result': ('returned', {'result': None}),
    'result_on_failure': ('failed', {'result': '1'}),
    'result_not_json': ('returned', {'result': '{oops'}),
    'args_not_object': ('approved', {'args': '[1, 2]'}),
    'blank_note': (None, {'note': '  '}),
    'long_note': (None, {'note': 'n' * (MAX_NOTE_CHARS + 1)}),
    'no_operator': (None, {'resolved_by': ''}),
    'deferral_on_decision': (None, {'deferral': 'approval'}),
    'metadata_on_decision': (None, {'deferral_metadata': '{}'}),
}
"""Malformed decisions (`_check_decision`, `_check_deferral`): (the decision it is, or any; the fields it
carries wrongly). The projector refuses each (`invalid`)."""


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
    deferral: str = 'approval'
    """What a `deferred` transition waits for."""
    decision: str | None = None
    """A `resolved` transition's decision (`approved`...), or None: an operator's resolution."""
    flaw: str | None = None
    """A decision's `FLAWS`: a malformed one."""
    by: str = 'ops@example'
    """Who resolved or decided (`resolved_by`)."""
    resumer: str | None = None
    """A `run_resumed` mark's resuming run (`RESUMED_BY_KEY`); None: a mark that names none."""


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
    deferral=st.sampled_from(DEFERRALS_SORTED),
    decision=st.sampled_from([None, None, *sorted(DECISIONS)]),
    flaw=st.one_of(st.none(), st.none(), st.none(), st.sampled_from(sorted(FLAWS))),
    resumer=st.sampled_from([None, 'run-r1', 'run-a', '../escape']),
)


@st.composite
def logs(draw: st.DrawFn, min_waiting: int = 0, max_waiting: int = 1) -> list[Op]:
    """Coherent runs (an owner writing seqs 0..n across both topics) with twins on the other
    topic, exact repeats and different records at one seq, plus random and hostile records, all
    in a random order (so seqs go backwards and records come before their registration); then
    `min_waiting` to `max_waiting` runs that end waiting, and decisions (`ends_waiting`)."""
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
                out.append(
                    replace(op, writer='operator', status='resolved', minute=op.minute + 2, decision=None)
                )
            if not op.is_event and op.status == 'deferred' and draw(st.integers(0, 2)) == 0:
                decision = draw(st.sampled_from(DECIDED_BY[op.deferral]))  # someone decides it
                out.append(replace(op, writer='approver', status='resolved', decision=decision, flaw=None))
    out += draw(st.lists(ops, max_size=12))
    out = draw(st.permutations(out))
    if not min_waiting and draw(st.integers(0, 2)):  # a third of the logs, in the other properties
        max_waiting = 0
    for run_id in draw(
        st.lists(st.sampled_from(DEFERRED_RUNS), unique=True, min_size=min_waiting, max_size=max_waiting)
    ):
        out = draw(ends_waiting(run_id, out, decided=min_waiting > 0))
    return out


DEFERRED_RUNS = ['wait-a', 'wait-d']
"""Runs that end waiting (`ends_waiting`), one in each partition. No other record names them but
the decisions aimed at them, so what their calls read follows from the log alone (`expected_calls`)."""
CALL_SHAPES = ['deferred', 'deferred', 'started_deferred', 'started', 'completed']
"""A waiting run's calls: deferred (`requires_approval`), started then deferred (`CallDeferred` in its
body), and two that do not wait: one in doubt, one completed."""
TARGETS = [
    'decide',
    'decide',
    'decide',
    'resend',
    'stale',
    'resolution',
    'malformed',
    'unknown_call',
    'other_run',
    'unknown_run',
    'wrong_key',
]
"""What a decision aimed at a waiting run is: `decide` one of its calls (waiting or not: a second
one conflicts), `resend` the same bytes as an earlier one, answer a `stale` seq, an operator's
`resolution` instead, a `malformed` one (`FLAWS`), one for an `unknown_call`, for its call under
an `other_run`'s id (whose call it is not), under an `unknown_run`'s, or keyed wrong (`wrong_key`)."""
DECIDERS = [('stepstream-cli@ops-1:41', 'alice'), ('stepstream-serve@web:7', 'bob'), ('refunds-bot', 'carol')]
"""(writer_id, resolved_by) of the processes that decide."""


@st.composite
def ends_waiting(draw: st.DrawFn, run_id: str, others: list[Op], *, decided: bool = False) -> list[Op]:
    """`others` with a run that ends waiting on its deferred calls, and decisions aimed at it.

    The run's own records keep their order among themselves; each decision lands anywhere (before
    the call it decides, too) or, more often, after that call's last transition. `decided`: one at
    least is a decision.
    """
    minute = draw(st.integers(0, 5))

    def owner(seq: int, *, kind: str = 'run_started', status: str = '', call: str = '', **more: object) -> Op:
        return Op(
            is_event=not status, run_id=run_id, writer='owner', seq=seq, kind=kind,
            status=status or 'started', call=call, snapshot_seq=0, prefix_len=0, parent=None,
            minute=minute, hostile=None,
            **more,  # type: ignore[arg-type]
        )  # fmt: skip

    run = [owner(0), owner(1, kind='model_request_started')]
    calls: list[tuple[str, Op]] = []  # (shape, the call's last transition)
    for n in range(draw(st.integers(1, 3))):
        shape, call, seq = draw(st.sampled_from(CALL_SHAPES)), f'{run_id[-1]}{n}', len(run)
        deferral = draw(st.sampled_from(DEFERRALS_SORTED))
        if shape != 'deferred':
            run.append(owner(seq, status='started', call=call))
        if shape == 'completed':
            run.append(owner(seq + 1, status='completed', call=call))
        if shape.endswith('deferred'):
            run.append(owner(len(run), status='deferred', call=call, deferral=deferral))
            run.append(owner(len(run), kind='tool_call_deferred', call=call))
        calls.append((shape, next(op for op in reversed(run) if op.call == call and not op.is_event)))
    run.append(owner(len(run), kind='snapshot_saved', media=0))
    run.append(owner(len(run), kind='run_waiting'))
    out = list(others)
    at = sorted(draw(st.lists(st.integers(0, len(out)), min_size=len(run), max_size=len(run))))
    for offset, (position, op) in enumerate(zip(at, run, strict=True)):
        out.insert(position + offset, op)

    decisions: list[Op] = []
    for target in ['decide'] * decided + draw(st.lists(st.sampled_from(TARGETS), max_size=5)):
        shape, last = draw(st.sampled_from(calls))
        writer, by = draw(st.sampled_from(DECIDERS))
        kinds = DECIDED_BY[last.deferral] if shape.endswith('deferred') else sorted(DECISIONS)
        decision = replace(
            last,
            writer=writer,
            by=by,
            status='resolved',
            decision=draw(st.sampled_from(kinds)),
            minute=draw(st.integers(0, 5)),
        )
        if target == 'resend' and decisions:
            decision = draw(st.sampled_from(decisions))
        elif target == 'stale':
            decision = replace(decision, seq=last.seq - 1)  # the call's `started`, or no transition of it
        elif target == 'resolution':
            decision = replace(decision, decision=None)
        elif target == 'malformed':
            decision = replace(decision, flaw=draw(st.sampled_from(sorted(FLAWS))))
        elif target == 'unknown_call':
            decision = replace(decision, call='nope')
        elif target in ('other_run', 'unknown_run'):
            other = [r for r in (*DEFERRED_RUNS, *RUN_IDS) if r != run_id]
            decision = replace(
                decision, run_id=draw(st.sampled_from(other)) if target == 'other_run' else 'run-gone'
            )
        elif target == 'wrong_key':
            decision = replace(decision, hostile='wrong_key')
        decisions.append(decision)
        after = max(i for i, op in enumerate(out) if op is last) + 1
        out.insert(draw(st.integers(0 if draw(st.integers(0, 3)) == 0 else after, len(out))), decision)

    marks: list[Op] = []  # runs that resume it (decision 0057): the first valid mark after it waits
    for resumer in draw(st.lists(st.sampled_from(RESUMERS), max_size=3)):
        mark = replace(
            run[0], kind='run_resumed', writer=f'resumer-{resumer}', minute=draw(st.integers(0, 5)),
            resumer=None if resumer == 'none' else run_id if resumer == 'self' else resumer,
        )  # fmt: skip
        if resumer == 'resend' and marks:
            mark = draw(st.sampled_from(marks))
        marks.append(mark)
        after = max(i for i, op in enumerate(out) if op is run[-1]) + 1
        out.insert(draw(st.integers(0 if draw(st.integers(0, 3)) == 0 else after, len(out))), mark)
    return out


RESUMERS = ['run-r1', 'run-r2', 'run-r1', 'resend', 'self', 'none']
"""The runs a waiting run's `run_resumed` marks name: two resuming runs, a resend of an earlier mark,
the waiting run itself (`invalid`) and none (`invalid`)."""


def expected_resumed(generated: list[Op]) -> dict[str, str | None]:
    """Which run resumes each of the `DEFERRED_RUNS`, from the log alone: the first mark in its
    partition's log order that names another run and comes after its `run_waiting`."""
    found: dict[str, str | None] = dict.fromkeys(DEFERRED_RUNS)
    waiting: set[str] = set()
    for op, source in placed(generated):
        if op.run_id not in found or source.topic != EVENTS or source.key != op.run_id.encode():
            continue
        if op.kind == 'run_waiting' and op.writer == 'owner':
            waiting.add(op.run_id)
        elif (
            op.kind == 'run_resumed'
            and op.run_id in waiting
            and found[op.run_id] is None
            and op.resumer not in (None, op.run_id)
        ):
            found[op.run_id] = op.resumer
    return found


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
            metadata={RESUMED_BY_KEY: op.resumer} if op.kind == 'run_resumed' and op.resumer else {},
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
            prev_hash=None if resolved else prev_hash,
            **(answer_fields(op, error) if resolved else deferral_fields(op, error)),
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


def deferral_fields(op: Op, error: str | None) -> dict[str, str | None]:
    """A transition's fields beyond its envelope: a `deferred` one's what it waits for."""
    if op.status != 'deferred':
        return {'error': error}
    args = f'{{"order": {op.minute}}}' if op.minute % 3 else None
    metadata = '{"queue": "refunds"}' if op.minute % 2 else None
    return {'error': error, 'deferral': op.deferral, 'args': args, 'deferral_metadata': metadata}


def answer_fields(op: Op, error: str | None) -> dict[str, str | None]:
    """A `resolved` transition's fields: an operator's resolution, or a decision (maybe malformed)."""
    bad_note = op.hostile == 'bad_resolution'
    if op.decision is None:
        return {
            'error': error,
            'resolution': 'did_not_happen' if op.minute % 2 else 'happened',
            'resolved_by': op.by,
            'note': '' if bad_note else f'checked at minute {op.minute}',
        }
    decision, wrong = FLAWS[op.flaw] if op.flaw is not None else (None, {})
    decision = decision or op.decision
    fields: dict[str, str | None] = {
        'resolution': decision,
        'resolved_by': op.by,
        'note': '' if bad_note else None if op.minute % 3 == 0 else f'decided at minute {op.minute}',
        'args': '{"order": 7, "amount": 100}' if decision == 'approved' and op.minute % 2 else None,
        'result': f'{{"rows": {op.minute}}}' if decision == 'returned' else None,
        'error': {'denied': 'over the limit, ask a manager', 'failed': 'the job failed'}.get(decision),
    }
    if error is not None:  # oversized: refused
        fields['error'] = error
    return fields | wrong


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


def placed(generated: list[Op]) -> list[tuple[Op, SourceRecord]]:
    """Each op with the record it writes, at its offset in its partition; the runs' records chained."""
    offsets: dict[tuple[int, int], int] = {}
    heads = chain_heads(generated)
    return [(op, to_source(op, offsets, heads)) for op in generated]


def partitioned(records: list[SourceRecord]) -> dict[tuple[int, int], list[SourceRecord]]:
    """Each (topic, partition) sequence of `records`, in their order."""
    log: dict[tuple[int, int], list[SourceRecord]] = {}
    for source in records:
        log.setdefault((source.topic, source.partition), []).append(source)
    return log


def make_log(generated: list[Op]) -> dict[tuple[int, int], list[SourceRecord]]:
    """Each (topic, partition) sequence of the log, in offset order; the runs' records chained."""
    return partitioned([source for _, source in placed(generated)])


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


Observe = Callable[[AnyShard], None]
"""Reads a store once its log is applied, before it is closed."""


def apply_in_one_pass(
    path: str, log: dict[tuple[int, int], list[SourceRecord]], store: str, observe: Observe | None = None
) -> list[tuple[bytes, bytes]]:
    """One batch, the tool-effects topic first: every transition arrives before any step event."""
    db = open_store(path, store)
    try:
        txn, _ = applier().stage(db, [r for tp in sorted(log, reverse=True) for r in log[tp]])
        txn.commit()
        if observe is not None:
            observe(db)
        return list(db.logical_items())
    finally:
        db.close()


def apply_with_crashes(
    path: str,
    log: dict[tuple[int, int], list[SourceRecord]],
    seed: int,
    store: str,
    make_applier: Callable[[], Applier] = applier,
    observe: Observe | None = None,
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
                if observe is not None:
                    observe(db)
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
    path: str,
    records: list[SourceRecord],
    sizes: list[int],
    *,
    one_applier: bool,
    store: str,
    observe: Observe | None = None,
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
        if observe is not None:
            observe(db)
        return list(db.items()), dead, applied, duplicates
    finally:
        db.close()


def batch_sizes(total: int, rng: random.Random) -> list[int]:
    """Random batch sizes that add up to `total`."""
    sizes: list[int] = []
    while total:
        sizes.append(min(total, rng.choice([1, 2, 3, 5, 8, 13, total])))
        total -= sizes[-1]
    return sizes


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
    records = [r for part in parts for r in part]
    sizes = [size for part in parts for size in batch_sizes(len(part), rng)]
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
    waiting = [e for e in (EffectState.decode(v) for _, v in shard.scan(EFFECT.tag)) if e.waiting]
    assert {k for k, _ in shard.scan(WAITING.tag)} == {
        WAITING.key(e.ended_at or 0, e.run_id, e.tool_call_id) for e in waiting
    }
    expected.update(waiting_count(e.deferral or '') for e in waiting)
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
    waits: list[ToolEffectRecord] = []  # the calls that wait, read from each run's ledger
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
        waits += [e for e in effects if e.status == 'deferred']
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
    await check_waiting(reader, waits)


async def check_waiting(reader: ProjectionReader, waits: list[ToolEffectRecord]) -> None:
    """What `list_waiting` and the counts say (the `WAITING` index) is what each run's ledger says."""
    waiting = await reader.list_waiting()
    assert [(w.effect.run_id, w.effect.tool_call_id) for w in waiting] == [
        (e.run_id, e.tool_call_id)
        for e in sorted(waits, key=lambda e: (e.ended_at, e.run_id, e.tool_call_id))
    ]
    assert all(w.effect.deferral is not None and w.waiting_since == w.effect.ended_at for w in waiting)
    assert [w.cursor for w in await reader.list_waiting(newest_first=True)] == [
        w.cursor for w in reversed(waiting)
    ]
    counts = await reader.counts()
    assert counts is not None
    assert counts.waiting_calls == {d: sum(e.deferral == d for e in waits) for d in DEFERRALS_SORTED}
    for deferral in DEFERRALS_SORTED:
        listed = await reader.list_waiting(deferral=deferral)  # type: ignore[arg-type]
        assert listed == [w for w in waiting if w.effect.deferral == deferral]
    paged, after = [], None  # a page at a time, from the last call seen
    while page := await reader.list_waiting(limit=2, after=after):
        paged += page
        after = page[-1].cursor
    assert paged == waiting


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


# -- decisions on deferred calls (decision 0056) ---------------------------------------------------

Ledger = list[tuple[object, ...]]
"""A call's resolutions and decisions, in log order: what each says, and whether it is applied."""


def expected_calls(generated: list[Op]) -> dict[tuple[str, str], tuple[str, Ledger]]:
    """What each call of the `DEFERRED_RUNS` must read, from the log alone: its status and ledger.

    The ledger holds every well-formed `resolved` record keyed by the call's run that names the call
    and comes after one of its transitions in their partition (one before any answers nothing: the
    DLQ), in log order. The first that answers the transition deciding the call's status, in kind (a
    decision a `deferred`, an operator's resolution a `started`), is applied: the call reads
    `resolved`. A second implementation of the rule, from the records as written.
    """
    transitions: dict[tuple[str, str], list[ToolEffectTransition]] = {}
    answers: dict[tuple[str, str], list[ToolEffectTransition]] = {}
    for op, source in placed(generated):
        if source.topic != EFFECTS or source.key not in {r.encode() for r in DEFERRED_RUNS}:
            continue
        if op.status == 'resolved' and op.flaw is not None:
            continue  # malformed: refused whatever the state
        assert source.value is not None
        t = decode(source.value)
        assert isinstance(t, ToolEffectTransition)
        call = (t.run_id, t.tool_call_id)
        if t.status != 'resolved':
            transitions.setdefault(call, []).append(t)
        elif call in transitions:
            answers.setdefault(call, []).append(t)
    expected: dict[tuple[str, str], tuple[str, Ledger]] = {}
    for call, seen in transitions.items():
        deciding = max(seen, key=lambda t: t.seq)
        kinds = {'started': RESOLUTIONS, 'deferred': DECISIONS}.get(deciding.status, frozenset())
        ledger = answers.get(call, [])
        applied = next((r for r in ledger if r.seq == deciding.seq and r.resolution in kinds), None)
        expected[call] = (
            deciding.status if applied is None else 'resolved',
            [
                (
                    r.resolution,
                    r.resolved_by,
                    r.writer_id,
                    r.timestamp,
                    r.note or '',
                    r.seq,
                    r.args,
                    r.result,
                    r.error,
                    r is applied,
                )
                for r in ledger
            ],
        )
    return expected


async def read_calls(
    reader: ProjectionReader,
) -> tuple[dict[tuple[str, str], tuple[str, Ledger]], set[tuple[str, str]]]:
    """Each call of the `DEFERRED_RUNS` as the projection reads it (`expected_calls`' terms), and
    those `list_waiting` lists."""
    found: dict[tuple[str, str], tuple[str, Ledger]] = {}
    for run_id in DEFERRED_RUNS:
        for e in await reader.list_tool_effects(run_id):
            applied = [r for r in e.resolutions if r.applied]
            assert applied == ([] if e.resolution is None else [e.resolution])  # one outcome at most
            assert (e.status == 'resolved') == bool(applied)
            found[(run_id, e.tool_call_id)] = (
                e.status,
                [
                    (
                        r.resolution,
                        r.resolved_by,
                        r.writer_id,
                        r.resolved_at,
                        r.note,
                        r.resolves_seq,
                        r.args,
                        r.result,
                        r.error,
                        r.applied,
                    )
                    for r in e.resolutions
                ],
            )
    waiting = {(w.effect.run_id, w.effect.tool_call_id) for w in await reader.list_waiting()}
    return found, {call for call in waiting if call[0] in DEFERRED_RUNS}


@pytest.mark.parametrize('store', STORES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated=logs(min_waiting=1, max_waiting=2), seed=st.integers(0, 2**32))
def test_each_deferred_call_has_one_outcome_in_every_projection(
    generated: list[Op], seed: int, store: str
) -> None:
    """Runs that end waiting, with valid, resent, conflicting, stale, misdirected and malformed
    decisions among the other records: applied in one pass, in a random interleaving with crashes,
    and in random batches to one `Applier`, every projection reads each call's first valid answer
    in its partition's log order as its one outcome (`expected_calls`), lists exactly the calls left
    undecided as waiting, and holds the same logical content (a rebuild is identical)."""
    log = make_log(generated)
    expected = expected_calls(generated)
    waiting = {call for call, (status, _) in expected.items() if status == 'deferred'}
    assert expected
    rng = random.Random(seed)
    records = interleave(log, rng)

    def observe(db: AnyShard) -> None:
        assert asyncio.run(read_calls(ProjectionReader(db))) == (expected, waiting)

    with tempfile.TemporaryDirectory() as path:
        reference = apply_in_one_pass(f'{path}/one', log, store, observe)
        assert apply_with_crashes(f'{path}/crashes', log, seed, store, observe=observe) == reference
        batched = apply_in_batches(
            f'{path}/batches',
            records,
            batch_sizes(len(records), rng),
            one_applier=True,
            store=store,
            observe=observe,
        )
    assert [(k, v) for k, v in batched[0] if not k.startswith(PROCESS_LOCAL)] == reference


@pytest.mark.parametrize('store', STORES)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated=logs(min_waiting=1, max_waiting=2), seed=st.integers(0, 2**32))
def test_a_waiting_run_reads_resumed_by_its_first_mark_in_every_projection(
    generated: list[Op], seed: int, store: str
) -> None:
    """Runs that end waiting, with `run_resumed` marks before and after their end, resent, naming
    two resuming runs, the run itself or none: in one pass, with crashes and in random batches, each
    reads `resumed` by the first valid mark after it waits (`expected_resumed`), else `waiting`."""
    log = make_log(generated)
    expected = expected_resumed(generated)
    rng = random.Random(seed)

    def observe(db: AnyShard) -> None:
        async def read() -> dict[str, str | None]:
            found: dict[str, str | None] = {}
            for run_id in DEFERRED_RUNS:
                run = await ProjectionReader(db).get_run(run_id)
                if run is None:
                    found[run_id] = None
                    continue
                assert (run.status == 'resumed') == (run.resumed_by is not None), run
                found[run_id] = run.resumed_by
            return found

        assert asyncio.run(read()) == expected

    with tempfile.TemporaryDirectory() as path:
        reference = apply_in_one_pass(f'{path}/one', log, store, observe)
        assert apply_with_crashes(f'{path}/crashes', log, seed, store, observe=observe) == reference
        records = interleave(log, rng)
        batched = apply_in_batches(
            f'{path}/batches', records, batch_sizes(len(records), rng), one_applier=True, store=store,
            observe=observe,
        )  # fmt: skip
    assert [(k, v) for k, v in batched[0] if not k.startswith(PROCESS_LOCAL)] == reference


def by_run(items: list[tuple[bytes, bytes]], run_ids: set[str]) -> dict[str, dict[bytes, bytes]]:
    """The keys and values of the store that name each run (its states, its entries in every index)."""
    found: dict[str, dict[bytes, bytes]] = {}
    for k, v in items:
        for run_id in run_ids.intersection(p for p in BY_TAG[k[:1]].parse(k) if isinstance(p, str)):
            found.setdefault(run_id, {})[k] = v
    return found


@pytest.mark.parametrize('store', STORES)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated=logs(min_waiting=1, max_waiting=2), seed=st.integers(0, 2**32), data=st.data())
def test_a_decision_never_changes_another_runs_projection(
    generated: list[Op], seed: int, data: st.DataObject, store: str
) -> None:
    """The decisions keyed by one run (valid, resent, malformed, for another run's call or an
    unknown run's) taken out of the log, the other records at their offsets: every other run's
    states and index entries are the same, byte for byte."""
    written = placed(generated)
    decision = [op.status == 'resolved' and op.decision is not None and not op.is_event for op, _ in written]
    key = data.draw(
        st.sampled_from(sorted({s.key or b'' for (_, s), d in zip(written, decision, strict=True) if d}))
    )
    rest = [s for (_, s), d in zip(written, decision, strict=True) if not (d and (s.key or b'') == key)]
    assert len(rest) < len(written)
    run_ids = {op.run_id for op in generated} | {p for p in PARENTS if p is not None} | {'another-run'}
    rng = random.Random(seed)
    dumps = []
    with tempfile.TemporaryDirectory() as path:
        for n, records in enumerate(([s for _, s in written], rest)):
            order = interleave(partitioned(records), rng)
            items = apply_in_batches(
                f'{path}/{n}', order, batch_sizes(len(order), rng), one_applier=True, store=store
            )[0]
            dumps.append(by_run(items, run_ids - {key.decode(errors='replace')}))
    assert dumps[0] == dumps[1]
