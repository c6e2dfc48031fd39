"""A run's records form a hash chain (issue 37, item 1; decision 0048).

Generated runs (several steps, parallel tool calls, tools that fail and are retried, a run that
fails, large values offloaded, delegates writing their own runs) on the in-memory log: in seq
order across both topics, each record of a run carries the `chain_hash` of the run's record
before it and the first carries none; heartbeats carry none. Changing any byte of a record's
body, dropping a record or swapping two breaks the link after it. With a signing key, each
durability point signs the head (`chain_signed`), so `audit/_chains.verify_run` finds every record
covered by a trusted signature; and the projection, applying the records, reads each run's chain
`intact`, and `broken` at the record after an altered one (`projector/_chain.py`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import tempfile
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from fastavro import schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_ai import Agent, ModelRetry
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream import Settings
from stepstream.audit import Seen, verify_run
from stepstream.media import DiskMediaStore
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.producer._memory import StoredRecord
from stepstream.producer._run import RunWriter
from stepstream.projector._apply import Applier, SourceRecord
from stepstream.schemas import (
    MAGIC,
    UNCHAINED_KINDS,
    StepEvent,
    ToolEffectTransition,
    chain_hash,
    decode,
    encode,
    load_schema_versions,
)
from stepstream.signing import SIGNATURE, SIGNED_KIND, SIGNING_KEY, Signer, TrustedKeys, statement
from stepstream.storage import RUN, MemoryShard, RunState

pytestmark = pytest.mark.fast


def chains(log: InMemoryLog) -> dict[str, list[StoredRecord]]:
    """Each run's records in seq order (both topics), heartbeats left out."""
    runs: dict[str, list[tuple[int, StoredRecord]]] = defaultdict(list)
    for stored in log.records:
        assert stored.value is not None
        record = decode(stored.value)
        if isinstance(record, StepEvent) and record.kind in UNCHAINED_KINDS:
            assert record.kind == 'chain_signed' or record.prev_hash is None  # not the run's trail
            continue
        runs[record.run_id].append((record.seq, stored))
    return {run: [s for _, s in sorted(items, key=lambda item: item[0])] for run, items in runs.items()}


def parallel_calls(
    steps: int, parallel: int, fails: bool
) -> Callable[[list[ModelMessage], AgentInfo], ModelResponse]:
    """A model that calls `work` `parallel` times at once for `steps` steps, then answers (or fails)."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = sum(isinstance(m, ModelResponse) for m in messages)
        if done < steps:
            return ModelResponse(
                parts=[ToolCallPart('work', {'n': i}, f'call-{done}-{i}') for i in range(parallel)]
            )
        if fails:
            raise RuntimeError('the model gave up')
        return ModelResponse(parts=[TextPart('done')])

    return model


def broken_at(records: list[bytes]) -> int | None:
    """The index of the first record whose link is not the hash of the one before it, or None."""
    previous: bytes | None = None
    for index, value in enumerate(records):
        if decode(value).prev_hash != previous:
            return index
        previous = chain_hash(value)
    return None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.integers(1, 4),
    parallel=st.integers(1, 3),
    retried=st.booleans(),
    fails=st.booleans(),
    large=st.booleans(),
    signed=st.booleans(),
)
def test_every_run_is_a_chain_of_its_records(
    steps: int, parallel: int, retried: bool, fails: bool, large: bool, signed: bool
) -> None:
    log = InMemoryLog(Settings(signing_key=SIGNING_PEM) if signed else None)
    attempts: dict[str, int] = defaultdict(int)

    model = parallel_calls(steps, parallel, fails)

    with tempfile.TemporaryDirectory() as root:
        capability = StepPersistence(
            log=log, agent_name='chained', media_store=DiskMediaStore(Path(root)), media_threshold_bytes=2048
        )
        agent = Agent(FunctionModel(model), capabilities=[capability])
        helper = Agent(
            FunctionModel(lambda m, i: ModelResponse(parts=[TextPart('ok')])), capabilities=[capability]
        )

        @agent.tool_plain(retries=2)
        async def work(n: int) -> Any:
            attempts[f'{n}'] += 1
            if retried and attempts[f'{n}'] == 1:
                raise ModelRetry('once more')
            await helper.run(f'help {n}')  # a delegate: a run of its own, chained on its own
            attempts['helped'] += 1
            return 'x' * 5000 if large else n

        async def run() -> None:
            try:
                await agent.run('go', conversation_id='conv-chain')
            except RuntimeError:
                assert fails

        asyncio.run(run())

    runs = chains(log)
    assert len(runs) == 1 + attempts['helped']  # the run and its delegates
    for run_id, stored in runs.items():
        values = [s.value for s in stored if s.value is not None]
        assert [decode(v).seq for v in values] == list(range(len(values))), run_id  # no gap
        assert broken_at(values) is None, run_id
        assert decode(values[0]).prev_hash is None
    for run_id, integrity in audit(log, TRUSTED if signed else None).items():
        assert integrity.ok and integrity.chain == 'intact', integrity.breaks
        assert integrity.records == len(runs[run_id])
        # Signed: every durability point signs its head, the run's end included.
        assert integrity.signed_through == (len(runs[run_id]) if signed else None), run_id
    projected = {run_id: state.chain for run_id, state in project(log.records).items()}
    assert projected == dict.fromkeys(runs, 'intact')


def one_tool_call_run() -> InMemoryLog:
    """The log of one run that calls a tool once, then answers."""
    log = InMemoryLog()
    agent = Agent(
        FunctionModel(
            lambda m, i: (
                ModelResponse(parts=[ToolCallPart('work', {}, 'c1')])
                if len(m) == 1
                else ModelResponse(parts=[TextPart('done')])
            )
        ),
        capabilities=[StepPersistence(log=log)],
    )

    @agent.tool_plain
    def work() -> str:
        return 'worked'

    asyncio.run(agent.run('go'))
    return log


def test_a_changed_byte_a_dropped_or_swapped_record_breaks_the_chain_after_it() -> None:
    log = one_tool_call_run()
    (values,) = [[s.value for s in stored if s.value is not None] for stored in chains(log).values()]
    assert len(values) > 5 and broken_at(values) is None
    altered = bytearray(values[3])
    altered[12] ^= 1  # a byte of the body (of its run id), not of its own link
    assert broken_at([*values[:3], bytes(altered), *values[4:]]) == 4
    assert broken_at([*values[:3], *values[4:]]) == 3
    assert broken_at([*values[:3], values[4], values[3], *values[5:]]) == 3


SIGNING_PEM = (
    Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode()
)
SIGNER = Signer.from_pem(SIGNING_PEM.encode())
TRUSTED = TrustedKeys({SIGNER.key_id: SIGNER.private_key.public_key()})


def audit(log: InMemoryLog, keys: TrustedKeys | None) -> dict[str, Any]:
    """`verify_run` of each run, over what the log holds, checked against `keys`."""
    seen: dict[str, list[Seen]] = defaultdict(list)
    for stored in log.records:
        record = decode(stored.value)
        if isinstance(record, StepEvent) and record.kind == 'run_heartbeat':
            continue
        signature = None
        if isinstance(record, StepEvent) and record.kind == 'chain_signed':
            signature = (record.metadata[SIGNING_KEY], record.metadata[SIGNATURE])
        kind = record.kind if isinstance(record, StepEvent) else record.status
        topic = 0 if isinstance(record, StepEvent) else 1
        seen[record.run_id].append(
            Seen(
                topic,
                stored.partition,
                stored.offset,
                record.seq,
                chain_hash(stored.value),
                record.prev_hash,
                kind,
                signature=signature,
            )
        )
    return {run_id: verify_run(run_id, items, keys) for run_id, items in seen.items()}


def project(records: list[StoredRecord]) -> dict[str, RunState]:
    """The runs' states after the records are applied in one batch, transitions first (any order will do)."""
    shard = MemoryShard()
    applier = Applier(('events', 'effects'), partitions=1, max_snapshots_per_run=None, max_seq_jump=1000)
    sources = [
        SourceRecord(1 if isinstance(s.record, ToolEffectTransition) else 0, 0, s.offset, s.key, s.value)
        for s in sorted(records, key=lambda s: isinstance(s.record, StepEvent))
    ]
    txn, outcome = applier.stage(shard, sources)
    txn.commit()
    assert not outcome.dead, [(d.reason, d.detail) for d in outcome.dead]
    return {RunState.decode(v).run_id: RunState.decode(v) for _, v in shard.scan(RUN.tag)}


def test_the_projection_reads_a_chain_intact_broken_or_unchained() -> None:
    log = one_tool_call_run()
    records = [
        s for s in log.records if not (isinstance(s.record, StepEvent) and s.record.kind == 'run_heartbeat')
    ]
    (state,) = project(records).values()
    assert (state.chain, state.chain_break_seq) == ('intact', None)
    by_seq = sorted(records, key=lambda s: s.record.seq)
    # Record 3 written again a microsecond later: valid, in place, but not what record 4 links to.
    third = by_seq[3].record
    fields = {name: getattr(third, name) for name in type(third).__slots__}
    changed = encode(type(third)(**{**fields, 'timestamp': third.timestamp + timedelta(microseconds=1)}))
    tampered = [s._replace(value=changed) if s is by_seq[3] else s for s in records]
    (state,) = project(tampered).values()
    assert (state.chain, state.chain_break_seq) == ('broken', 4)
    assert (
        state.chain_break_at
        == f'{"step_events" if isinstance(by_seq[4].record, StepEvent) else "tool_effects"}/0'
    )
    # Written before the chain (step_event v4, tool_effect_transition v2): unchained, never broken.
    old = [s._replace(value=older(s.record)) for s in records]
    (state,) = project(old).values()
    assert (state.chain, state.chain_break_seq) == ('unchained', None)


def older(record: StepEvent | ToolEffectTransition) -> bytes:
    """The record as a writer before the chain encoded it (the version before the one with `prev_hash`)."""
    name = 'step_event' if isinstance(record, StepEvent) else 'tool_effect_transition'
    unlinked = [
        v for v in load_schema_versions()[name] if all(f['name'] != 'prev_hash' for f in v.parsed['fields'])
    ]
    version = unlinked[-1]
    fields = {f['name']: getattr(record, f['name']) for f in version.parsed['fields']}
    if isinstance(record, StepEvent):
        fields['snapshot'] = (
            None
            if record.snapshot is None
            else {f: getattr(record.snapshot, f) for f in record.snapshot.__slots__}
        )
        fields['usage'] = (
            None if record.usage is None else {f: getattr(record.usage, f) for f in record.usage.__slots__}
        )
    body = io.BytesIO()
    schemaless_writer(body, version.parsed, fields)
    return MAGIC + version.fingerprint + body.getvalue()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.integers(1, 4), parallel=st.integers(1, 3), fails=st.booleans())
def test_a_signing_writer_signs_each_new_head_once_at_its_durability_points(
    steps: int, parallel: int, fails: bool
) -> None:
    """Issue 37, item 6: at most one signature per durability point, none for a head already
    signed, each over the head the log holds at that point, and always the run's final head."""
    signer = SIGNER
    log = InMemoryLog(Settings(signing_key=SIGNING_PEM))  # type: ignore[arg-type]
    points: dict[str, int] = defaultdict(int)
    durable = RunWriter.durable

    async def counted(self: RunWriter, ctx: Any) -> None:
        points[self.run_id] += 1
        await durable(self, ctx)

    model = parallel_calls(steps, parallel, fails)

    agent = Agent(FunctionModel(model), capabilities=[StepPersistence(log=log, agent_name='signed')])

    @agent.tool_plain
    def work(n: int) -> int:
        return n

    async def run() -> None:
        try:
            await agent.run('go')
        except RuntimeError:
            assert fails

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(RunWriter, 'durable', counted)
        asyncio.run(run())

    ((run_id, stored),) = chains(log).items()  # the trail, signed heads left out
    trail = [s.value for s in stored]
    every = [decode(s.value) for s in log.records if s.value is not None]
    heads = [r for r in every if isinstance(r, StepEvent) and r.kind == SIGNED_KIND]
    assert heads and len(heads) <= points[run_id]
    assert len({h.prev_hash for h in heads}) == len(heads)  # a head is signed once
    for head in heads:
        assert head.prev_hash == chain_hash(trail[head.seq - 1])  # the head the log held then
        signature = base64.b64decode(head.metadata[SIGNATURE])
        signer.private_key.public_key().verify(signature, statement(run_id, head.seq, head.prev_hash))
    assert heads[-1].seq == len(trail)  # the final head is signed
