"""S3 over TLS with a private CA: SeaweedFS serves HTTPS with a certificate a test CA signed.

Every S3 client stepstream makes (the media store the capability offloads to, the projector's
reads, shard checkpoints, the bucket check at `EventLog` start) takes its options from
`stepstream.s3_client.client_options`, so one setting, `STEPSTREAM_S3_CAFILE`, makes all of them
trust the CA; a client that does not trust it fails at start, naming the setting.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from pydantic_ai import Agent
from pydantic_ai.messages import ToolReturnPart

from stepstream import MediaUnavailable, Settings
from stepstream.embedded import EmbeddedStack
from stepstream.media import S3MediaStore
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader, continue_run
from stepstream.s3_client import client_options
from stepstream.settings import MediaSettings
from stepstream.storage import Checkpoints

from agents import calls_then_answers
from certificates import TestCA

pytestmark = pytest.mark.broker

TOOL_OUTPUT = 'row,' * 50_000  # 200 KB: well above the 64 KiB threshold, so it goes to S3


@pytest.fixture(scope='module')
def cas(tmp_path_factory: pytest.TempPathFactory) -> tuple[TestCA, TestCA]:
    root = tmp_path_factory.mktemp('s3-ca')
    return TestCA(root / 'ca'), TestCA(root / 'other-ca', 'some other CA')


@pytest.fixture(scope='module')
def https_stack(cas: tuple[TestCA, TestCA]) -> Iterator[EmbeddedStack]:
    ca, _ = cas
    served = ca.issue('seaweedfs', server=True)
    stack = EmbeddedStack(s3_certfile=served.cert, s3_keyfile=served.key, s3_cafile=str(ca.cafile))
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def tls_settings(https_stack: EmbeddedStack) -> Settings:
    return https_stack.settings.replace(topic_prefix=f'test-{uuid.uuid4().hex[:12]}', partitions=2)


async def logged_values(settings: Settings) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        settings.topics.step_events_topic,
        bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset='earliest',
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        values: list[bytes] = []
        while True:
            batches = await consumer.getmany(timeout_ms=1500)
            if not batches:
                return values
            values.extend(m.value or b'' for batch in batches.values() for m in batch)
    finally:
        await consumer.stop()


async def test_agent_to_log_to_projection_with_media_and_checkpoints_over_https(
    tls_settings: Settings, tmp_path: Path
) -> None:
    settings = tls_settings
    assert settings.media.s3_endpoint is not None and settings.media.s3_endpoint.startswith('https://')
    checkpoints = Checkpoints.from_settings(
        settings, group=f'{settings.topics.topic_prefix}.tls', interval_s=3600
    )
    async with (
        EventLog(settings) as log,
        Projector(settings, db_path=tmp_path / 'projection') as projector,
    ):
        agent = Agent(calls_then_answers('export'), capabilities=[StepPersistence(log=log, agent_name='tls')])

        @agent.tool_plain
        def export() -> str:
            return TOOL_OUTPUT

        await agent.run('export everything', conversation_id='conv-tls')
        await projector.wait_for(await log.flush())
        [run] = await ProjectionReader.of(projector).list_runs(conversation_id='conv-tls')
        history = await continue_run(
            ProjectionReader.of(projector), run_id=run.run_id
        )  # media read over HTTPS
        assert any(
            isinstance(p, ToolReturnPart) and p.content == TOOL_OUTPUT for m in history for p in m.parts
        )
        uploaded = await checkpoints.upload_all(projector.shards)
    # The payload went to S3: the log holds its reference, never the 200 KB.
    values = await logged_values(settings)
    assert values and all(TOOL_OUTPUT.encode() not in value for value in values)
    assert any(b'media+sha256://' in value for value in values)
    assert uploaded
    listed = [c.key for p in range(settings.topics.partitions) for c in await checkpoints.list(p)]
    assert sorted(listed) == sorted(c.key for c in uploaded)


@pytest.mark.parametrize('trust', ['another CA', 'the system CAs only'])
async def test_an_untrusted_certificate_fails_at_start_naming_the_ca_setting(
    tls_settings: Settings, cas: tuple[TestCA, TestCA], trust: str
) -> None:
    _, other = cas
    settings = tls_settings.replace(s3_cafile=str(other.cafile) if trust == 'another CA' else None)
    log = EventLog(settings)
    StepPersistence(log=log)  # it uses the settings' bucket: the log checks it as it starts
    with pytest.raises(MediaUnavailable) as err:
        async with log:
            pass
    message = str(err.value)
    assert 'TLS certificate of the endpoint is not trusted (UnknownIssuer)' in message
    assert 'STEPSTREAM_S3_CAFILE' in message


async def test_plain_http_against_the_https_endpoint_says_to_use_https(tls_settings: Settings) -> None:
    assert tls_settings.media.s3_endpoint is not None
    settings = tls_settings.replace(
        s3_endpoint=tls_settings.media.s3_endpoint.replace('https://', 'http://'), s3_cafile=None
    )
    with pytest.raises(MediaUnavailable) as err:
        await S3MediaStore.from_settings(settings.media).check()
    assert 'speaks HTTPS' in str(err.value) and 'use https:// in STEPSTREAM_S3_ENDPOINT' in str(err.value)


def test_the_ca_file_is_checked_when_the_client_is_built(tmp_path: Path) -> None:
    endpoint = 'https://s3.example.com'
    with pytest.raises(MediaUnavailable, match=r"STEPSTREAM_S3_CAFILE='.*missing.pem' cannot be read"):
        client_options(MediaSettings(s3_endpoint=endpoint, s3_cafile=str(tmp_path / 'missing.pem')))
    (tmp_path / 'not-a-ca.pem').write_text('hello')
    with pytest.raises(MediaUnavailable, match='holds no PEM certificate'):
        client_options(MediaSettings(s3_endpoint=endpoint, s3_cafile=str(tmp_path / 'not-a-ca.pem')))


def test_a_ca_file_with_a_plain_http_endpoint_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r'STEPSTREAM_S3_CAFILE .* is http://127.0.0.1:9000, which is not TLS'
    ):
        Settings(s3_endpoint='http://127.0.0.1:9000', s3_cafile='/etc/ssl/ca.pem')
