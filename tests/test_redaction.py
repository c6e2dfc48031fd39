"""Redaction: no secret an agent hands a tool reaches a record or a media object (decision 0047).

Generated payloads (nested objects and lists, secrets under secret-named keys at any depth, in
tool arguments given as objects and as JSON text, in tool returns, in free text of well-known
formats, beside values large enough to be offloaded) go through the snapshot writer and through
real `Agent` runs on the in-memory log and a disk media store: no secret's bytes are in any
record or object, every value that is not a secret is kept, redacting twice changes nothing, and
a run completes as it does without redaction. The same rules over the real broker, S3, RocksDB,
the export and the explorer, with erasure on and off: tests/test_redaction_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream import Settings
from stepstream.media import DiskMediaStore
from stepstream.producer import (
    REDACTED,
    REDACTION_KEY,
    InMemoryLog,
    Redaction,
    StepPersistence,
    annotate_tool_effect,
)
from stepstream.producer._snapshots import SnapshotWriter
from stepstream.readmodel import ProjectionReader

from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast

SECRET_KEYS = [
    'api_key',
    'API-Key',
    'x-api-key',
    'apiKey',
    'password',
    'DB_PASSWORD',
    'token',
    'access_token',
    'GitHubToken',
    'client_secret',
    'Authorization',
    'private_key',
    'credentials',
    'session_id',
    'Cookie',
    'passphrase',
]
PLAIN_KEYS = ['name', 'query', 'items', 'max_tokens', 'tokens_used', 'data', 'url', 'note', 'id', 'key_count']


def formatted_secrets(tag: str) -> list[str]:
    """One secret of each well-known format, made unique by `tag` (hex)."""
    upper = tag.upper()[:16].ljust(16, 'Q')
    return [
        f'AKIA{upper}',
        'ghp_' + (tag * 5)[:36],
        f'sk-proj-{tag}{tag}',
        f'xoxb-{tag}-{tag}',
        'AIza' + (tag * 5)[:35],
        f'eyJ{tag}.eyJ{tag}.{tag}sig',
        f'-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA{tag * 5}\n{tag}==\n-----END RSA PRIVATE KEY-----',
    ]


@st.composite
def payloads(draw: st.DrawFn, secrets: list[str], canaries: list[str]) -> Any:
    """A JSON value with secrets under secret-named keys at any depth, and canaries that must stay."""

    def leaf() -> Any:
        kind = draw(st.sampled_from(['canary', 'int', 'none', 'text']))
        if kind == 'canary':
            canary = f'keep-{len(canaries)}-{draw(st.integers(0, 10**6))}'
            canaries.append(canary)
            return canary
        return {'int': 7, 'none': None, 'text': 'plain words'}[kind]

    def value(depth: int) -> Any:
        kind = draw(st.sampled_from(['leaf', 'dict', 'list', 'secret'] if depth < 4 else ['leaf', 'secret']))
        if kind == 'leaf':
            return leaf()
        if kind == 'list':
            return [value(depth + 1) for _ in range(draw(st.integers(0, 3)))]
        if kind == 'secret':  # a secret-named key: its whole value goes, whatever it is
            secret = f'sekrit-{len(secrets)}-{draw(st.text("0123456789abcdef", min_size=12, max_size=12))}'
            secrets.append(secret)
            shape = draw(st.sampled_from(['str', 'dict', 'list']))
            held: Any = {'str': secret, 'dict': {'inner': secret}, 'list': [secret, 1]}[shape]
            return {draw(st.sampled_from(SECRET_KEYS)): held}
        keys = draw(st.lists(st.sampled_from(PLAIN_KEYS), max_size=3, unique=True))
        return {k: value(depth + 1) for k in keys}

    return {'call': value(0), 'more': [value(1), value(1)]}


def history(args: Any, as_text: bool, returned: Any, text: str, big: str) -> list[ModelMessage]:
    """A history with the payloads where an agent puts them."""
    return [
        ModelRequest(parts=[UserPromptPart(content=f'please {text}')], instructions=f'be careful: {text}'),
        ModelResponse(parts=[ToolCallPart('use', json.dumps(args) if as_text else args, 'call-1')]),
        ModelRequest(parts=[ToolReturnPart('use', {'result': returned, 'blob': big}, 'call-1')]),
        ModelResponse(parts=[TextPart(f'done with {text}')]),
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), as_text=st.booleans(), offloaded=st.booleans(), hashed=st.booleans())
def test_no_secret_reaches_a_snapshot_or_its_media(
    data: st.DataObject, as_text: bool, offloaded: bool, hashed: bool
) -> None:
    secrets: list[str] = []
    canaries: list[str] = []
    args = data.draw(payloads(secrets, canaries))
    returned = data.draw(payloads(secrets, canaries))
    tag = data.draw(st.text('0123456789abcdef', min_size=8, max_size=8))
    formatted = formatted_secrets(tag)
    text = ' and '.join(f'use {s} now' for s in formatted)
    big = 'x' * (5000 if offloaded else 10)  # above the threshold: the message is offloaded
    messages = history(args, as_text, returned, text, big)
    redaction = Redaction(hash_key=b'k' if hashed else None)

    with tempfile.TemporaryDirectory() as root:
        writer = SnapshotWriter(DiskMediaStore(Path(root)), 4096, redaction)
        delta = asyncio.run(writer.delta(writer.plan(messages), 0))
        written = [delta.messages.encode(), *(p.read_bytes() for p in Path(root).rglob('*') if p.is_file())]
    assert bool(delta.media) == offloaded
    for secret in [*secrets, *formatted]:
        for part in secret.split('\n'):  # a private key block: none of its lines either
            assert not any(part.encode() in blob for blob in written), secret
    restored = json.dumps(json.loads(delta.messages))
    for canary in canaries:  # everything else is kept
        assert canary in restored or offloaded
    if secrets or formatted:
        assert '[redacted' in restored
    ModelMessagesTypeAdapter.validate_json(delta.messages)  # still Pydantic AI's messages

    # Redacting twice changes nothing (a continued run's history holds the markers).
    again = SnapshotWriter(None, 1 << 30, redaction).plan(
        ModelMessagesTypeAdapter.validate_json(delta.messages)
    )
    assert again.redacted == frozenset()


def test_each_rule_says_what_it_replaced_and_keeps_the_rest() -> None:
    policy = Redaction()
    assert policy.text('Authorization: Bearer abc.d3f-ghi_jkl') == f'Authorization: Bearer {REDACTED}'
    assert policy.text('postgres://app:hunter2hunter2@db:5432/x') == f'postgres://app:{REDACTED}@db:5432/x'
    assert policy.text('failed: password=correcthorse42; retry') == f'failed: password={REDACTED}; retry'
    assert policy.text('the token: is missing') == 'the token: is missing'  # too short to be one
    assert policy.value({'max_tokens': 5, 'input_tokens': 3, 'keys': ['a']}) == {
        'max_tokens': 5,
        'input_tokens': 3,
        'keys': ['a'],
    }
    assert policy.value({'headers': {'X-Api-Key': 12345, 'Accept': 'json'}}) == {
        'headers': {'X-Api-Key': REDACTED, 'Accept': 'json'}
    }
    assert policy.metadata({'team': 'docs', 'deploy_token': 'abc'}) == {
        'team': 'docs',
        'deploy_token': REDACTED,
    }

    keyed = Redaction(hash_key=b'one')
    first, second = keyed.value({'token': 'same'}), keyed.value({'password': 'same'})
    assert first['token'] == second['password'] != keyed.value({'token': 'other'})['token']
    assert first['token'].startswith('[redacted hmac-sha256:')
    assert Redaction(hash_key=b'two').value({'token': 'same'}) != first  # the key decides the hash

    extended = policy.extend(keys=['pin'], patterns=[r'\bACME-\d{6}\b'])
    assert extended.value({'card_pin': 1234, 'ref': 'ACME-123456 ok'}) == {
        'card_pin': REDACTED,
        'ref': f'{REDACTED} ok',
    }
    custom = Redaction(redactor=lambda key, value: REDACTED if key == 'ssn' else value)
    assert custom.value({'ssn': '078-05-1120', 'token': 'x1', 'name': 'a'}) == {
        'ssn': REDACTED,
        'token': REDACTED,
        'name': 'a',
    }
    off = Redaction.off()
    assert off.value({'token': 'x1'}) == {'token': 'x1'}
    assert off.text('Bearer abcdefghijk') == 'Bearer abcdefghijk'
    assert off.metadata({'deploy_token': 'abc'}) == {'deploy_token': 'abc'}
    assert (policy.label, keyed.label, extended.label, custom.label, off.label) == (
        'default/2',
        'default+hmac/2',
        'extended/2',
        'default+redactor/2',
        'off',
    )
    with pytest.raises(ValueError, match='is not RE2 syntax'):
        policy.extend(patterns=['(?!lookahead)'])


def test_the_settings_choose_the_policy() -> None:
    assert Redaction.from_settings(Settings()).label == 'default/2'
    assert Redaction.from_settings(Settings(redaction='off')).label == 'off'
    extra = Redaction.from_settings(Settings(redaction_keys='pin, ssn', redaction_hash_key='k'))  # type: ignore[arg-type]
    assert extra.label == 'extended+hmac/2' and extra.value({'ssn': 'x'})['ssn'].startswith('[redacted hmac')
    with pytest.raises(ValueError, match='STEPSTREAM_REDACTION'):
        Settings(redaction='some')
    assert 'redaction_hash_key' not in repr(Settings(redaction_hash_key='k'))  # type: ignore[arg-type]


def agent_with_secrets(
    log: InMemoryLog, store: DiskMediaStore, args: Any, returned: Any, final: str, redaction: Redaction | None
) -> Agent[None, str]:
    """An agent whose model hands a tool `args`, whose tool returns `returned`, and answers `final`."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart('use', args, 'call-1')])
        return ModelResponse(parts=[TextPart(final)])

    capability = StepPersistence(
        log=log, media_store=store, media_threshold_bytes=4096, redaction=redaction, agent_name='holder'
    )
    agent = Agent(FunctionModel(model), capabilities=[capability])

    @agent.tool_plain
    def use(**kwargs: Any) -> Any:
        return returned

    return agent


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), offloaded=st.booleans())
def test_a_run_with_secrets_leaves_none_in_the_log_and_completes_as_without_redaction(
    data: st.DataObject, offloaded: bool
) -> None:
    secrets: list[str] = []
    canaries: list[str] = []
    args = data.draw(payloads(secrets, canaries))
    returned = {'found': data.draw(payloads(secrets, canaries)), 'blob': 'y' * (6000 if offloaded else 5)}
    tag = data.draw(st.text('0123456789abcdef', min_size=8, max_size=8))
    formatted = formatted_secrets(tag)
    final = f'your key is {formatted[0]}'
    prompt = f'connect with Authorization: Bearer {formatted[1]}'

    async def run(redaction: Redaction | None, root: Path) -> tuple[InMemoryLog, Any, list[bytes]]:
        log = InMemoryLog()
        store = DiskMediaStore(root)
        result = await agent_with_secrets(log, store, args, returned, final, redaction).run(
            prompt, conversation_id='conv-secret'
        )
        objects = [p.read_bytes() for p in root.rglob('*') if p.is_file()]
        return log, result, objects

    with tempfile.TemporaryDirectory() as on_dir, tempfile.TemporaryDirectory() as off_dir:
        log, result, objects = asyncio.run(run(None, Path(on_dir)))
        off_log, off_result, off_objects = asyncio.run(run(Redaction.off(), Path(off_dir)))
        written = [r.value for r in log.records if r.value is not None] + objects
        for secret in [*secrets, *formatted[:2]]:
            assert not any(secret.encode() in blob for blob in written), secret
        # The check can fail: without redaction the same run writes them.
        off_written = b''.join([r.value for r in off_log.records if r.value is not None] + off_objects)
        assert formatted[1].encode() in off_written and all(s.encode() in off_written for s in secrets)

        # The agent saw its own values: the run completes exactly as without redaction.
        assert result.output == off_result.output == final
        assert ModelMessagesTypeAdapter.dump_json(result.all_messages()) != b''
        assert [type(m) for m in result.all_messages()] == [type(m) for m in off_result.all_messages()]
        assert [r.topic for r in log.records] == [r.topic for r in off_log.records]

        projection = MemoryProjection(log)
        asyncio.run(projection.wait_for())
        reader = ProjectionReader(projection.shard, media_store=DiskMediaStore(Path(on_dir)))
        [run] = asyncio.run(reader.list_runs())
        assert run.metadata[REDACTION_KEY] == 'default/2'
        latest = asyncio.run(reader.latest_snapshot(run.run_id))
        assert latest is not None
        shown = ModelMessagesTypeAdapter.dump_json(latest.messages).decode()  # offloaded values restored
        assert '[redacted]' in shown and not any(s in shown for s in [*secrets, *formatted[:2]])
        for canary in canaries:
            assert canary in shown


async def test_errors_summaries_and_keys_of_the_records_are_redacted_too(tmp_path: Path) -> None:
    secret = 'ghp_' + 'z' * 36
    log = InMemoryLog()

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart('deploy', {}, 'call-1')])
        return ModelResponse(parts=[TextPart('ok')])

    capability = StepPersistence(log=log, media_store=DiskMediaStore(tmp_path))
    agent = Agent(FunctionModel(model), capabilities=[capability])

    @agent.tool
    async def deploy(ctx: RunContext[None]) -> str:
        await annotate_tool_effect(
            ctx, idempotency_key=f'deploy-{secret}', effect_summary=f'pushed with {secret}'
        )
        raise RuntimeError(f'push refused for token {secret}')

    with pytest.raises(RuntimeError):
        await agent.run('deploy it', conversation_id='conv-errors')
    written = b''.join(r.value for r in log.records if r.value is not None)
    assert b'push refused' in written and b'pushed with' in written  # the rest is kept
    assert secret.encode() not in written
