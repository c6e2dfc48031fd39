"""compose's Kafka without docker: its broker settings, certs.sh and kafka-setup.sh on real Kafka.

No container runs here, but the pieces of compose/ that decide whether its Kafka works do: the
CA and certificates `certs.sh` makes, the `KAFKA_*` variables of the `kafka` service (turned into
`server.properties` as the apache/kafka image does), and `kafka-setup.sh` as the operator. The
embedded Apache Kafka's jars (the image's version, a test checks) run them; then the roles of the
compose file connect with its settings and the README's. Only what differs from a container is
changed: `/certs` is a temporary directory, the service name `kafka` is `localhost` (both are in
the broker's certificate), ports are free ones, and `kafka-acls.sh` (a tool not among the broker's
jars) is recorded and its rules granted through librdkafka.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from pydantic_ai import Agent
from test_compose import env_of, load_compose

from stepstream import Settings
from stepstream.embedded import apache_kafka
from stepstream.errors import AccessDenied
from stepstream.kafka_client import client_options
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.topics import ensure_topics

from agents import answers
from brokers import kafka_only
from processes import free_port, running
from secure_kafka import acl_rules, documented_acl_rules, grant, until_answers

pytestmark = pytest.mark.broker

COMPOSE = Path(__file__).resolve().parent.parent / 'compose'


def property_name(variable: str) -> str:
    """`KAFKA_A_B__C___D` -> `a.b_c-d`, the apache/kafka image's rule for its variables."""
    name = variable.removeprefix('KAFKA_').replace('___', '\0').replace('__', '\1').replace('_', '.')
    return name.replace('\0', '-').replace('\1', '_').lower()


class Here:
    """Rewrites compose's paths and addresses to this machine's: /certs, kafka:PORT, the data dir."""

    def __init__(self, root: Path) -> None:
        self.certs = root / 'certs'
        self.data = root / 'data'
        self.ports = {port: free_port() for port in (19092, 9092, 19094, 29093)}

    def __call__(self, value: str) -> str:
        value = value.replace('$$', '$').replace('/certs', str(self.certs))
        value = value.replace('/var/lib/kafka/data', str(self.data))
        for port, here in self.ports.items():
            value = re.sub(rf'(kafka|localhost)?:{port}\b', f'localhost:{here}', value)
        return value


@kafka_only('is not what compose runs: its file sets up Apache Kafka')
@pytest.mark.skipif(shutil.which('openssl') is None, reason='compose/certs.sh makes the CA with openssl')
async def test_compose_kafka_with_its_certificates_users_and_acls_serves_every_role(
    tmp_path: Path,
) -> None:
    here = Here(tmp_path)
    here.certs.mkdir()
    script = here((COMPOSE / 'certs.sh').read_text())
    if os.geteuid() != 0:  # the keys' owner is the containers' user; not ours to change here
        script = script.replace('\nchown ', '\n: chown ')
    subprocess.run(['sh', '-c', script], check=True, capture_output=True)

    services = load_compose()['services']
    kafka = env_of(services['kafka'])
    assert services['kafka']['image'] == f'apache/kafka:{apache_kafka.KAFKA_VERSION}'
    properties = tmp_path / 'server.properties'
    properties.write_text(
        ''.join(f'{property_name(k)}={here(v)}\n' for k, v in kafka.items() if k.startswith('KAFKA_'))
    )
    java, lib = apache_kafka.resolve()
    log = tmp_path / 'kafka.log'
    with open(log, 'ab') as out:
        formatted = apache_kafka.format_command(java, lib, properties, kafka['CLUSTER_ID'])
        subprocess.run(formatted, stdout=out, stderr=subprocess.STDOUT, check=True)

    operator = Settings(
        bootstrap_servers=here('kafka:19094'),
        security_protocol='SSL',
        ssl_cafile=str(here.certs / 'ca.pem'),
        ssl_certfile=str(here.certs / 'operator-keystore.pem'),  # key and certificate
    )
    with running(apache_kafka.broker_command(java, lib, properties), log) as broker:
        await until_answers(broker, client_options(operator.kafka), log, timeout=120)

        # kafka-setup.sh as compose runs it: kafka-configs.sh is the broker's own ConfigCommand.
        tools = tmp_path / 'bin'
        tools.mkdir()
        recorded = tmp_path / 'kafka-acls.txt'
        configs = [java, '-cp', f'{lib}/*', f'-Dlog4j2.configurationFile={apache_kafka.LOG4J_CONFIG}']
        (tools / 'kafka-configs.sh').write_text(
            f'#!/bin/sh\nexec {shlex.join(configs)} kafka.admin.ConfigCommand "$@"\n'
        )
        (tools / 'kafka-acls.sh').write_text(f'#!/bin/sh\necho "kafka-acls.sh $*" >> {recorded}\n')
        for tool in tools.iterdir():
            tool.chmod(0o755)
        setup = here((COMPOSE / 'kafka-setup.sh').read_text()).replace('BIN=/opt/kafka/bin', f'BIN={tools}')
        env = {**os.environ, **env_of(services['kafka-setup'])}
        done = await asyncio.to_thread(
            subprocess.run, ['sh', '-c', setup], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
        granted = list(acl_rules(recorded.read_text()))
        assert sorted(granted, key=repr) == sorted(documented_acl_rules(), key=repr)
        tls = {
            'security.protocol': 'SSL',
            'ssl.ca.location': str(here.certs / 'ca.pem'),
            'ssl.certificate.location': str(here.certs / 'operator-keystore.pem'),
            'ssl.key.location': str(here.certs / 'operator-keystore.pem'),
        }
        await asyncio.to_thread(
            grant, operator.kafka.bootstrap_servers, granted, topic_prefix='stepstream', client=tls
        )

        # The roles, with the settings compose gives its services and the README the host.
        def role(environ: dict[str, str]) -> Settings:
            local = {k: here(v) for k, v in environ.items()}
            # No MinIO here: these roles reach Kafka only.
            return Settings.from_env(local).replace(
                s3_endpoint=None, s3_cafile=None, s3_access_key_id=None, s3_secret_access_key=None
            )

        readme = (COMPOSE / 'README.md').read_text()
        exports = dict(
            shlex.split(line)[1].split('=', 1) for line in readme.splitlines() if line.startswith('export ')
        )
        exports['STEPSTREAM_SSL_CAFILE'] = '/certs/ca.pem'  # the README's copy of the CA
        producer, admin = role(exports), role(env_of(services['topics']))
        projector = role(env_of(services['projector']))
        assert producer.kafka.sasl_username == 'producer' and producer.kafka.security_protocol == 'SASL_SSL'

        with pytest.raises(AccessDenied, match='stepstream topics ensure'):
            await ensure_topics(producer)
        await ensure_topics(admin)
        async with (
            EventLog(producer) as event_log,
            Projector(projector, db_path=tmp_path / 'projection') as projection,
        ):
            agent = Agent(answers(), capabilities=[StepPersistence(log=event_log, agent_name='compose')])
            await agent.run('hello', conversation_id='compose')
            await projection.wait_for(await event_log.flush())
            [run] = await ProjectionReader.of(projection).list_runs(conversation_id='compose')
            assert run.status == 'completed'
