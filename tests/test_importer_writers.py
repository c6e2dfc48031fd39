"""The importer writes like any writer (redaction, signed heads, sealing); a property over generated stores.

Fast tier. A secret in a reference history is redacted on the way in (the reference kept it); with
a signing key each imported run's head is signed and verifies; with erasure on the snapshots are
sealed. The property: any store the reference's own `SqliteStepStore` or `FileStepStore` holds
(runs with and without lineage, events, snapshots that grow, shrink and are interrupted, ledgers
annotated and ended) reads back from the projection as the reference store returns it, and a
second import writes nothing.
"""

from __future__ import annotations

import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, TextPart, UserPromptPart
from pydantic_ai.models.function import FunctionModel
from pydantic_ai_harness.step_persistence import (
    ContinuableSnapshot,
    RunRecord,
    StepEvent,
    StepPersistence,
    ToolEffectRecord,
)

from stepstream import Settings
from stepstream.erasure import new_kek
from stepstream.importer import import_store, open_store
from stepstream.media import DiskMediaStore
from stepstream.producer import REDACTION_KEY, InMemoryLog, Redaction
from stepstream.producer._sealing import Sealer
from stepstream.schemas import StepEvent as LogEvent
from stepstream.schemas import chain_hash
from stepstream.signing import SIGNATURE, SIGNING_KEY, Signer, TrustedKeys, statement

from memory_projection import MemoryProjection
from reference_stores import assert_imported, reference_store, store_path

pytestmark = pytest.mark.fast

SECRET = 'sk-proj-' + 'A1b2C3d4E5f6G7h8I9j0' * 2


async def _secret_run(tmp_path: Path) -> Path:
    store = reference_store('sqlite', tmp_path)
    agent = Agent(
        FunctionModel(lambda m, i: ModelResponse(parts=[TextPart('noted')])),
        capabilities=[StepPersistence(store=store, agent_name='keys')],
    )
    await agent.run(f'my key is {SECRET}, keep it', conversation_id='conv-key')
    return store_path('sqlite', tmp_path)


async def _import(
    log: InMemoryLog, path: Path, media: Path, projection: MemoryProjection | None = None, **options: Any
) -> MemoryProjection:
    projection = projection or MemoryProjection(log, DiskMediaStore(media))
    store = open_store(path)
    try:
        await import_store(store, log, projection.reader(), media_store=projection.media_store, **options)
    finally:
        store.close()
    await projection.wait_for()
    return projection


@pytest.mark.parametrize('policy', ['default', 'off'])
async def test_a_secret_in_a_reference_history_is_redacted_as_the_capability_would(
    tmp_path: Path, policy: str
) -> None:
    path = await _secret_run(tmp_path)
    log = InMemoryLog()
    redaction = Redaction.off() if policy == 'off' else None
    projection = await _import(log, path, tmp_path / 'media', redaction=redaction)

    (run,) = await projection.reader().list_runs()
    (snapshot,) = await projection.reader().list_snapshots(run.run_id)
    kept = SECRET in str(snapshot.messages)
    assert kept == (policy == 'off')
    assert any(SECRET.encode() in r.value for r in log.records) == (policy == 'off')
    assert run.metadata[REDACTION_KEY] == (redaction or Redaction.from_settings(log.settings)).label


async def test_each_imported_run_has_its_head_signed(tmp_path: Path) -> None:
    path = await _secret_run(tmp_path)
    pem = (
        Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode()
    )
    signer = Signer.from_pem(pem.encode())
    trusted = TrustedKeys({signer.key_id: signer.private_key.public_key()})
    log = InMemoryLog(Settings(signing_key=pem))  # type: ignore[arg-type]
    await _import(log, path, tmp_path / 'media')

    trail = [
        r for r in log.records if not (isinstance(r.record, LogEvent) and r.record.kind == 'chain_signed')
    ]
    (signed,) = [
        r.record for r in log.records if isinstance(r.record, LogEvent) and r.record.kind == 'chain_signed'
    ]
    last = max(trail, key=lambda r: r.record.seq)
    assert signed.seq == len(trail) and signed.prev_hash == chain_hash(last.value)
    message = statement(signed.run_id, signed.seq, signed.prev_hash)
    assert trusted.verify(signed.metadata[SIGNING_KEY], signed.metadata[SIGNATURE], message) is True


async def test_with_erasure_on_the_snapshots_are_sealed_with_the_conversations_key(tmp_path: Path) -> None:
    path = await _secret_run(tmp_path)
    log = InMemoryLog()
    keys: list[bytes] = []

    async def send_key(key: bytes, value: bytes) -> None:
        keys.append(key)

    log.sealer = Sealer(new_kek(), send_key)
    await _import(log, path, tmp_path / 'media', redaction=Redaction.off())

    snapshots = [
        r.record.snapshot for r in log.records if isinstance(r.record, LogEvent) and r.record.snapshot
    ]
    assert snapshots and len(keys) == 1 and b'conv-key' in keys[0]
    assert all('keep it' not in s.messages for s in snapshots)  # sealed: not even the redacted text
    assert not any(b'keep it' in r.value for r in log.records)


# -- the property over generated reference stores ------------------------------------------------

BASE = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
KINDS = [
    'model_request_started',
    'model_request_completed',
    'tool_call_started',
    'tool_call_completed',
    'run_failed',
]

texts = st.text(st.characters(codec='utf-8', exclude_categories=('Cs',)), max_size=12)
operations = st.lists(
    st.one_of(
        st.tuples(st.just('event'), st.sampled_from(KINDS), st.dictionaries(texts, texts, max_size=2)),
        st.tuples(st.just('say'), texts, st.booleans()),
        st.tuples(st.just('snapshot'), st.integers(0, 6), st.sampled_from(['complete', 'interrupted'])),
        st.tuples(st.just('effect'), st.integers(0, 2), st.sampled_from(['started', 'completed', 'failed'])),
    ),
    max_size=14,
)
runs = st.lists(
    st.tuples(
        st.booleans(), st.booleans(), st.booleans(), st.dictionaries(texts, texts, max_size=2), operations
    ),
    min_size=1,
    max_size=3,
)


async def _write_reference(store: Any, generated: list[Any]) -> None:
    """Write `generated` through the reference store's own methods, each record later than the last."""
    clock = iter(BASE + timedelta(milliseconds=7 * n, microseconds=n) for n in range(10_000))
    run_ids: list[str] = []
    for number, (started, in_conversation, has_parent, metadata, ops) in enumerate(generated):
        run_id = f'gen-{number}'
        parent = run_ids[-1] if has_parent and run_ids else None
        conversation = 'conv-gen' if in_conversation else None
        await store.register_run(
            RunRecord(
                run_id=run_id,
                conversation_id=conversation,
                parent_run_id=parent,
                agent_name='gen',
                metadata=metadata,
                started_at=next(clock),
            )
        )
        run_ids.append(run_id)
        envelope = {
            'run_id': run_id,
            'conversation_id': conversation,
            'parent_run_id': parent,
            'agent_name': 'gen',
        }
        if started:
            await store.append_event(
                StepEvent(kind='run_started', step_index=0, timestamp=next(clock), **envelope)
            )
        history: list[ModelMessage] = []
        for index, op in enumerate(ops):
            if op[0] == 'event':
                call = f'call-{index % 3}' if op[1].startswith('tool') else None
                await store.append_event(
                    StepEvent(
                        kind=op[1],
                        step_index=index,
                        timestamp=next(clock),
                        tool_call_id=call,
                        tool_name='tool' if call else None,
                        error='boom' if op[1] == 'run_failed' else None,
                        metadata=op[2],
                        idempotency_key=f'{index}:{op[1]}',
                        **envelope,
                    )
                )
            elif op[0] == 'say':
                history.append(
                    ModelRequest(parts=[UserPromptPart(op[1], timestamp=BASE)])
                    if op[2]
                    else ModelResponse(parts=[TextPart(op[1])], timestamp=BASE)
                )
            elif op[0] == 'snapshot':
                await store.save_snapshot(
                    ContinuableSnapshot(
                        run_id=run_id,
                        step_index=index,
                        messages=history[: op[1]],
                        timestamp=next(clock),
                        state=op[2],
                        idempotency_key=f'{index}:{op[2]}',
                        conversation_id=conversation,
                    )
                )
            else:
                prior = await store.get_tool_effect(run_id=run_id, tool_call_id=f'call-{op[1]}')
                if op[2] == 'started' and prior is not None and prior.status != 'started':
                    continue  # the reference's capability never starts a call again once it ended
                at = next(clock)
                await store.record_tool_effect(
                    ToolEffectRecord(
                        tool_call_id=f'call-{op[1]}',
                        tool_name='tool',
                        run_id=run_id,
                        status=op[2],
                        # A `started` record of a started call is an annotation: it keeps `started_at`.
                        started_at=prior.started_at if prior is not None else at,
                        ended_at=None if op[2] == 'started' else at,
                        # As the reference's capability and `annotate_tool_effect` do: a later
                        # record keeps the call's key and summary unless it sets its own.
                        idempotency_key=f'key-{index}' if index % 2 else prior and prior.idempotency_key,
                        effect_summary=f'summary {index}'
                        if index % 3 == 0
                        else prior and prior.effect_summary,
                    )
                )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated=runs, kind=st.sampled_from(['sqlite', 'file']))
async def test_any_reference_store_reads_back_as_it_returns_it(generated: list[Any], kind: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        store = reference_store(kind, where)
        await _write_reference(store, generated)
        log = InMemoryLog()
        projection = await _import(log, store_path(kind, where), where / 'media', redaction=Redaction.off())
        assert projection.dead == []
        assert await assert_imported(store, projection.reader()) == len(generated)
        written = len(log.records)
        await _import(log, store_path(kind, where), where / 'media', projection, redaction=Redaction.off())
        assert len(log.records) == written and projection.dead == []
