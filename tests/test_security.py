"""TLS, SASL and least-privilege ACLs on a real Apache Kafka (tests/secure_kafka.py).

One secured broker serves the whole module. Each test has its own topic prefix and is granted
the ACLs of docs/security.md, as written there, for that prefix.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import SecretStr
from pydantic_ai import Agent, RunContext

from stepstream import Settings
from stepstream.cli import _main as cli
from stepstream.errors import AccessDenied, SecureConnectionError, StepStreamError
from stepstream.kafka_client import client_options
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader, continue_run
from stepstream.topics import ensure_topics

from agents import answers, calls_then_answers
from brokers import kafka_only
from secure_kafka import USERS, SecureKafka, documented_acl_rules, grant

pytestmark = [
    pytest.mark.broker,
    kafka_only('has no TLS listeners, SASL users or ACLs: the security tests need Apache Kafka'),
]


@pytest.fixture(scope='module')
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureKafka]:
    broker = SecureKafka(tmp_path_factory.mktemp('secure-kafka'))
    try:
        asyncio.run(broker.start())
        yield broker
    finally:
        broker.stop()


@pytest.fixture
async def granted(secure: SecureKafka, settings: Settings) -> Settings:
    """The test's settings, with the documented ACLs granted for its topic prefix."""
    rules = list(documented_acl_rules())
    assert {r.principal for r in rules} == {'User:admin', 'User:producer', 'User:projector', 'User:analyst'}
    await asyncio.to_thread(grant, secure.admin_bootstrap, rules, topic_prefix=settings.topics.topic_prefix)
    return settings


def scram(secure: SecureKafka, settings: Settings, user: str, mechanism: str = 'SCRAM-SHA-512') -> Settings:
    """`settings` connecting as SCRAM `user` over SASL_SSL, trusting the test CA."""
    return settings.replace(
        bootstrap_servers=secure.sasl_ssl_bootstrap,
        security_protocol='SASL_SSL',
        sasl_mechanism=mechanism,
        sasl_username=user,
        sasl_password=SecretStr(USERS[user]),
        ssl_cafile=str(secure.ca.cafile),
    )


def mutual_tls(secure: SecureKafka, settings: Settings, user: str) -> Settings:
    """`settings` connecting with the client certificate of `user` (its CN is the principal)."""
    issued = secure.clients[user]
    return settings.replace(
        bootstrap_servers=secure.ssl_bootstrap,
        security_protocol='SSL',
        ssl_cafile=str(secure.ca.cafile),
        ssl_certfile=str(issued.cert),
        ssl_keyfile=str(issued.key),
    )


async def run_a_librarian(producer: Settings, projector: Settings, db_path: Path) -> None:
    """Agent -> log -> projection -> continue_run, with the producer and projector principals."""
    async with EventLog(producer) as log, Projector(projector, db_path=db_path) as running:
        librarian = Agent(
            calls_then_answers('lookup'), capabilities=[StepPersistence(log=log, agent_name='librarian')]
        )

        @librarian.tool
        async def lookup(ctx: RunContext[None]) -> str:
            return 'shelf 7'

        await librarian.run('find X', conversation_id='conv-1')
        await running.wait_for(await log.flush())
        reader = ProjectionReader.of(running)
        [run] = await reader.list_runs(conversation_id='conv-1')
        assert run.status == 'completed' and run.gaps == []
        history = await continue_run(reader, run_id=run.run_id)
        assert 'shelf 7' in str(history)


# -- the whole path over secure listeners -----------------------------------------------------


async def test_the_whole_path_runs_over_sasl_ssl_with_scram_and_least_privilege(
    secure: SecureKafka, granted: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = scram(secure, granted, 'admin')
    for name, value in admin.to_env().items():
        monkeypatch.setenv(name, value)
    assert await asyncio.to_thread(cli.main, ['topics', 'ensure']) == 0  # the CLI, as the admin

    producer = scram(secure, granted, 'producer', 'SCRAM-SHA-256')
    projector = scram(secure, granted, 'projector')
    await run_a_librarian(producer, projector, tmp_path / 'projection')

    # The projector's rights also cover dead-lettering a poison record and committing its group.
    raw = AIOKafkaProducer(**client_options(producer.kafka))
    await raw.start()
    try:
        poison = await raw.send_and_wait(granted.topics.step_events_topic, b'not a record', key=b'run-x')
    finally:
        await raw.stop()
    async with Projector(projector, db_path=tmp_path / 'projection') as running:
        await running.wait_for({poison.topic_partition: poison.offset + 1})
        assert running.dead_lettered == 1
    committed = await group_offsets(secure, f'{granted.topics.topic_prefix}.projector')
    assert committed, 'the projector committed no group offsets'

    # The read-only principal reads the log and the DLQ in an `analytics.` group.
    analyst = scram(secure, granted, 'analyst')
    consumer = AIOKafkaConsumer(
        granted.topics.step_events_topic,
        granted.topics.dlq_topic,
        **client_options(analyst.kafka),
        group_id='analytics.audit',
        auto_offset_reset='earliest',
    )
    await consumer.start()
    try:
        seen: set[str] = set()
        while seen != {granted.topics.step_events_topic, granted.topics.dlq_topic}:
            batches = await consumer.getmany(timeout_ms=1000)
            seen |= {tp.topic for tp in batches}
    finally:
        await consumer.stop()


async def group_offsets(secure: SecureKafka, group: str) -> dict[object, object]:
    """The committed offsets of `group` (the projector commits on its first batch), asked as admin."""
    admin = AIOKafkaAdminClient(bootstrap_servers=secure.admin_bootstrap)
    await admin.start()
    try:
        return dict(await admin.list_consumer_group_offsets(group))
    finally:
        await admin.close()


async def test_the_whole_path_runs_over_mutual_tls(
    secure: SecureKafka, granted: Settings, tmp_path: Path
) -> None:
    await ensure_topics(scram(secure, granted, 'admin'))
    producer = mutual_tls(secure, granted, 'producer')
    projector = mutual_tls(secure, granted, 'projector')
    await run_a_librarian(producer, projector, tmp_path / 'projection')


async def test_an_oauthbearer_token_provider_plugs_in(secure: SecureKafka, granted: Settings) -> None:
    await ensure_topics(scram(secure, granted, 'admin'))
    producer = granted.replace(
        bootstrap_servers=secure.sasl_ssl_bootstrap,
        security_protocol='SASL_SSL',
        sasl_mechanism='OAUTHBEARER',
        sasl_oauth_token_provider='secure_kafka:ProducerToken',
        ssl_cafile=str(secure.ca.cafile),
    )
    async with EventLog(producer) as log:
        agent = Agent(answers(), capabilities=[StepPersistence(log=log, agent_name='oauth')])
        await agent.run('hello')
        assert sum((await log.flush()).values()) >= 2


# -- failures at startup name the cause and the setting -----------------------------------------


@pytest.fixture
def failing(secure: SecureKafka, settings: Settings) -> dict[str, tuple[Settings, list[str]]]:
    good = scram(secure, settings, 'producer')
    other_ca = str(secure.other_ca.cafile)
    stranger = secure.stranger_cert
    return {
        'wrong password': (
            good.replace(sasl_password=SecretStr('not-the-password')),
            ['refused SASL SCRAM-SHA-512 authentication', 'STEPSTREAM_SASL_PASSWORD'],
        ),
        'untrusted CA': (
            good.replace(ssl_cafile=other_ca),
            ['not trusted by the CA in STEPSTREAM_SSL_CAFILE', other_ca],
        ),
        'plaintext client on a TLS listener': (
            settings.replace(bootstrap_servers=secure.sasl_ssl_bootstrap),
            ['speaks TLS', 'STEPSTREAM_SECURITY_PROTOCOL is PLAINTEXT'],
        ),
        'TLS client on a plaintext listener': (
            settings.replace(
                bootstrap_servers=secure.admin_bootstrap,
                security_protocol='SSL',
                ssl_cafile=str(secure.ca.cafile),
            ),
            ['does not speak TLS', 'STEPSTREAM_SECURITY_PROTOCOL is SSL'],
        ),
        'no client certificate for mutual TLS': (
            settings.replace(
                bootstrap_servers=secure.ssl_bootstrap,
                security_protocol='SSL',
                ssl_cafile=str(secure.ca.cafile),
            ),
            ['requires a client certificate', 'STEPSTREAM_SSL_CERTFILE'],
        ),
        'client certificate of another CA': (
            mutual_tls(secure, settings, 'producer').replace(
                ssl_certfile=str(stranger.cert), ssl_keyfile=str(stranger.key)
            ),
            ['refused the client certificate', str(stranger.cert)],
        ),
    }


@pytest.mark.parametrize(
    'case',
    [
        'wrong password',
        'untrusted CA',
        'plaintext client on a TLS listener',
        'TLS client on a plaintext listener',
        'no client certificate for mutual TLS',
        'client certificate of another CA',
    ],
)
async def test_a_misconfigured_connection_fails_at_start_naming_cause_and_setting(
    failing: dict[str, tuple[Settings, list[str]]], case: str
) -> None:
    settings, expected = failing[case]
    with pytest.raises(SecureConnectionError) as failure:
        async with EventLog(settings):
            pass
    message = str(failure.value)
    for part in expected:
        assert part in message
    assert 'producer-secret' not in message and 'not-the-password' not in message


def test_the_password_stays_out_of_repr_flags_and_messages(secure: SecureKafka, settings: Settings) -> None:
    secured = scram(secure, settings, 'producer')
    assert 'producer-secret' not in repr(secured) and 'producer-secret' not in str(secured)
    parser = cli._parser()
    assert '--sasl-password' not in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(['status', '--sasl-password', 'x'])


# -- least privilege ----------------------------------------------------------------------------


async def test_a_producer_that_may_not_create_topics_is_told_to_run_topics_ensure(
    secure: SecureKafka, granted: Settings
) -> None:
    with pytest.raises(AccessDenied, match='run `stepstream topics ensure` once with an admin principal'):
        async with EventLog(scram(secure, granted, 'producer')):
            pass


async def test_each_role_is_refused_what_its_acls_do_not_grant(
    secure: SecureKafka, granted: Settings, tmp_path: Path
) -> None:
    await ensure_topics(scram(secure, granted, 'admin'))

    # The projector and the read-only principal may not write the log.
    for user in ('projector', 'analyst'):
        async with EventLog(scram(secure, granted, user)) as log:
            agent = Agent(answers(), capabilities=[StepPersistence(log=log, agent_name='writer')])
            with pytest.raises(AccessDenied, match=f"SASL user '{user}' to write"):
                await agent.run('hello')
                await log.flush()

    # The producer may not read the log (nor create the DLQ a projector needs).
    producer = scram(secure, granted, 'producer')
    with pytest.raises(AccessDenied, match='run `stepstream topics ensure`'):
        async with Projector(producer, db_path=tmp_path / 'p1'):
            pass
    with pytest.raises(AccessDenied, match="SASL user 'producer' to use the consumer group"):
        async with Projector(producer, db_path=tmp_path / 'p2', create_topics=False):
            pass

    # A principal with no ACLs sees no topics at all, and is told they may be hidden from it.
    with pytest.raises(StepStreamError, match='may not describe them'):
        async with EventLog(scram(secure, granted, 'stranger'), create_topics=False):
            pass
