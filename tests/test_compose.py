"""compose/docker-compose.yml, checked by structure (no docker engine needed).

The services must agree with each other and with `Settings`: the projector's STEPSTREAM_* variables
are ones `Settings.from_env()` reads, and its addresses name the compose services. Every connection
is TLS from the CA certs.sh makes, clients authenticate with SCRAM, and the ACLs kafka-setup.sh
grants are the ones docs/security.md lists. The projector's command is one the CLI parses; Prometheus
scrapes its metrics port and Grafana finds the files compose mounts (tests/test_alerts.py checks
what is in them).
"""

from __future__ import annotations

import argparse
import base64
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from stepstream.cli._main import _parser
from stepstream.cli._services import projector_service
from stepstream.embedded.apache_kafka import BROKER_SETTINGS, KAFKA_VERSION, POM
from stepstream.settings import ENV_PREFIX, SETTING_NAMES, Settings

from secure_kafka import acl_rules, documented_acl_rules

pytestmark = [pytest.mark.fast, pytest.mark.once]

yaml = pytest.importorskip('yaml', reason='PyYAML is needed to read the compose file (dev extra)')

COMPOSE_DIR = Path(__file__).resolve().parent.parent / 'compose'


def interpolate(value: Any) -> Any:
    """Compose's `${VAR:-default}` with the defaults (the environment is not consulted)."""
    if isinstance(value, str):
        return re.sub(r'\$\{[A-Z_]+:-([^}]*)\}', r'\1', value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def load_compose() -> dict[str, Any]:
    """compose/docker-compose.yml with each `${VAR:-default}` read as its default."""
    with open(COMPOSE_DIR / 'docker-compose.yml') as f:
        return dict(interpolate(yaml.safe_load(f)))


@pytest.fixture(scope='module')
def compose() -> dict[str, Any]:
    return load_compose()


def env_of(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment as strings, whether written as a mapping or as KEY=VALUE items."""
    env = service.get('environment', {})
    if isinstance(env, list):
        env = dict(item.split('=', 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def command_text(service: dict[str, Any]) -> str:
    command = service.get('command', '')
    return ' '.join(command) if isinstance(command, list) else str(command)


def test_services(compose: dict[str, Any]) -> None:
    assert {
        'certs',
        'kafka',
        'kafka-setup',
        'topics',
        'minio',
        'minio-init',
        'projector',
        'prometheus',
        'grafana',
    } <= set(compose['services'])


def test_kafka_is_kraft_and_reachable_from_host_and_network(compose: dict[str, Any]) -> None:
    kafka = compose['services']['kafka']
    env = env_of(kafka)
    assert kafka['image'].startswith('apache/kafka:')
    assert set(env['KAFKA_PROCESS_ROLES'].split(',')) == {'broker', 'controller'}
    assert 'KAFKA_ZOOKEEPER_CONNECT' not in env
    voter_id, voter = env['KAFKA_CONTROLLER_QUORUM_VOTERS'].split('@')
    assert voter_id == env['KAFKA_NODE_ID']
    assert len(base64.urlsafe_b64decode(env['CLUSTER_ID'] + '==')) == 16  # a KRaft cluster id

    listeners = dict(item.split('://') for item in env['KAFKA_LISTENERS'].split(','))
    advertised = dict(item.split('://') for item in env['KAFKA_ADVERTISED_LISTENERS'].split(','))
    protocols = dict(item.split(':') for item in env['KAFKA_LISTENER_SECURITY_PROTOCOL_MAP'].split(','))
    assert set(listeners) == set(protocols)
    assert env['KAFKA_CONTROLLER_LISTENER_NAMES'] in listeners
    assert voter.endswith(listeners[env['KAFKA_CONTROLLER_LISTENER_NAMES']])  # kafka:29093 / :29093
    assert set(advertised) <= set(listeners) and env['KAFKA_INTER_BROKER_LISTENER_NAME'] in advertised
    assert 'localhost:9092' in advertised.values()
    assert '9092:9092' in kafka['ports']


def test_kafka_runs_what_the_tests_run(compose: dict[str, Any]) -> None:
    """The broker settings and version are the embedded Apache Kafka's, which the suite runs on."""
    kafka = compose['services']['kafka']
    env = env_of(kafka)
    for name, value in BROKER_SETTINGS.items():
        variable = 'KAFKA_' + name.upper().replace('.', '_')
        assert env.get(variable) == value, (variable, env.get(variable), value)
    assert kafka['image'] == f'apache/kafka:{KAFKA_VERSION}'
    pom = POM.read_text()
    assert f'<kafka.version>{KAFKA_VERSION}</kafka.version>' in pom


def test_projector_env_is_settings(compose: dict[str, Any]) -> None:
    services = compose['services']
    env = env_of(services['projector'])
    known = {f'{ENV_PREFIX}{name.upper()}' for name in SETTING_NAMES}
    assert set(env) <= known, f'unknown to Settings: {set(env) - known}'
    assert {
        'STEPSTREAM_BOOTSTRAP_SERVERS',
        'STEPSTREAM_TOPIC_PREFIX',
        'STEPSTREAM_S3_ENDPOINT',
        'STEPSTREAM_S3_BUCKET',
        'STEPSTREAM_S3_REGION',
        'STEPSTREAM_S3_ACCESS_KEY_ID',
        'STEPSTREAM_S3_SECRET_ACCESS_KEY',
        'STEPSTREAM_DB_PATH',
    } <= set(env)

    settings = Settings.from_env(environ=env)
    assert settings.to_env() == {**Settings().to_env(), **env}  # every value is taken as given

    # Kafka: the compose service, on the listener advertised to the compose network.
    kafka_env = env_of(services['kafka'])
    advertised = [item.split('://')[1] for item in kafka_env['KAFKA_ADVERTISED_LISTENERS'].split(',')]
    for server in settings.kafka.bootstrap_servers.split(','):
        host, _ = server.rsplit(':', 1)
        assert host == 'kafka' and server in advertised

    # S3: the MinIO service's API port, its root credentials and the bucket minio-init creates.
    assert settings.media.s3_endpoint is not None
    endpoint = urlsplit(settings.media.s3_endpoint)
    assert endpoint.hostname == 'minio' and endpoint.port == 9000
    assert f'{endpoint.port}:9000' in services['minio']['ports']
    minio_env = env_of(services['minio'])
    assert settings.media.s3_access_key_id == minio_env['MINIO_ROOT_USER']
    assert settings.media.s3_secret_access_key is not None
    assert settings.media.s3_secret_access_key.get_secret_value() == minio_env['MINIO_ROOT_PASSWORD']
    init = command_text(services['minio-init'])
    assert (
        f'/{settings.media.s3_bucket}' in init
        and 'mc mb' in init
        and f' {settings.media.s3_endpoint} ' in init
    )
    assert minio_env['MINIO_ROOT_USER'] in init and minio_env['MINIO_ROOT_PASSWORD'] in init

    # The projection lives on a volume, not in the container's writable layer.
    mounts = [m.split(':')[1] for m in services['projector']['volumes']]
    assert any(Path(settings.projection.db_path).is_relative_to(m) for m in mounts)


def projector_args(compose: dict[str, Any]) -> argparse.Namespace:
    """The compose projector's command as the CLI parses it."""
    argv = compose['services']['projector']['command']
    assert argv[0] == 'stepstream'
    return _parser(argv[1:]).parse_args(argv[1:])


def test_projector_runs_the_cli_after_its_dependencies(compose: dict[str, Any]) -> None:
    projector = compose['services']['projector']
    assert command_text(projector).startswith('stepstream projector ')
    args = projector_args(compose)
    assert args.command is projector_service and args.group is None
    depends = projector['depends_on']
    assert depends['kafka']['condition'] == 'service_healthy'
    assert depends['minio-init']['condition'] == 'service_completed_successfully'
    assert depends['topics']['condition'] == 'service_completed_successfully'
    topics = compose['services']['topics']
    assert command_text(topics) == 'stepstream topics ensure'
    assert topics['depends_on']['kafka-setup']['condition'] == 'service_completed_successfully'
    assert compose['services']['minio-init']['depends_on']['minio']['condition'] == 'service_healthy'

    context = (COMPOSE_DIR / projector['build']['context']).resolve()
    dockerfile = context / projector['build']['dockerfile']
    assert (context / 'pyproject.toml').exists() and dockerfile.exists()
    text = dockerfile.read_text()
    assert 'pip install' in text and 'requirements.lock' in text
    assert (dockerfile.parent / f'{dockerfile.name}.dockerignore').exists()


def test_readme_shows_how_to_reach_it_from_the_host(compose: dict[str, Any]) -> None:
    readme = (COMPOSE_DIR / 'README.md').read_text()
    assert 'docker compose' in readme and 'up' in readme
    exports = dict(
        shlex.split(line)[1].split('=', 1) for line in readme.splitlines() if line.startswith('export ')
    )
    settings = Settings.from_env(environ=exports)
    assert settings.kafka.bootstrap_servers == 'localhost:9092'
    projector = Settings.from_env(environ=env_of(compose['services']['projector']))
    assert (
        settings.media.s3_bucket,
        settings.media.s3_access_key_id,
        settings.media.s3_secret_access_key,
    ) == (
        projector.media.s3_bucket,
        projector.media.s3_access_key_id,
        projector.media.s3_secret_access_key,
    )
    assert settings.media.s3_endpoint == 'https://localhost:9000'
    assert settings.media.s3_cafile == settings.kafka.ssl_cafile == 'compose-ca.pem'
    assert (settings.kafka.security_protocol, settings.kafka.sasl_mechanism) == ('SASL_SSL', 'SCRAM-SHA-512')
    assert settings.kafka.sasl_username == 'producer'
    password = settings.kafka.sasl_password.get_secret_value() if settings.kafka.sasl_password else None
    assert password == scram_users(compose)['producer']
    assert "certs 'cat /certs/ca.pem' > compose-ca.pem" in readme


SETUP = COMPOSE_DIR / 'kafka-setup.sh'
CERTS = COMPOSE_DIR / 'certs.sh'


def scram_users(compose: dict[str, Any]) -> dict[str, str]:
    """The SCRAM users kafka-setup.sh creates, with the passwords compose gives it by default."""
    env = env_of(compose['services']['kafka-setup'])
    users = re.findall(r'^scram_user (\w+) "\$(\w+)"$', SETUP.read_text(), re.MULTILINE)
    return {name: env[variable] for name, variable in users}


def clients(compose: dict[str, Any]) -> dict[str, Settings]:
    """The Settings of every compose service that runs stepstream."""
    return {
        name: Settings.from_env(environ=env_of(service))
        for name, service in compose['services'].items()
        if command_text(service).startswith('stepstream ')
    }


def test_no_listener_is_plaintext_and_clients_use_sasl_ssl_with_the_ca(compose: dict[str, Any]) -> None:
    kafka = env_of(compose['services']['kafka'])
    protocols = dict(item.split(':') for item in kafka['KAFKA_LISTENER_SECURITY_PROTOCOL_MAP'].split(','))
    assert set(protocols.values()) <= {'SSL', 'SASL_SSL'}
    # The listeners authenticated by certificate require one; their principal is its CN.
    for name, protocol in protocols.items():
        if protocol == 'SSL':
            assert kafka[f'KAFKA_LISTENER_NAME_{name}_SSL_CLIENT_AUTH'] == 'required'
    assert kafka['KAFKA_SSL_PRINCIPAL_MAPPING_RULES'] == 'RULE:^CN=([^,]+)$$/$$1/,DEFAULT'  # $$: compose's $
    assert kafka['KAFKA_SUPER_USERS'] == 'User:kafka;User:operator'  # the broker and the operator
    assert kafka['KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND'] == 'false'
    mechanisms = kafka['KAFKA_SASL_ENABLED_MECHANISMS'].split(',')
    advertised = dict(item.split('://') for item in kafka['KAFKA_ADVERTISED_LISTENERS'].split(','))
    listener_of = {address: name for name, address in advertised.items()}
    ca = kafka['KAFKA_SSL_TRUSTSTORE_LOCATION']

    users = scram_users(compose)
    assert set(users) >= {'admin', 'producer', 'projector'}
    for name, settings in clients(compose).items():
        listener = listener_of[settings.kafka.bootstrap_servers]
        assert protocols[listener] == settings.kafka.security_protocol == 'SASL_SSL', name
        mechanism = settings.kafka.sasl_mechanism
        assert mechanism in mechanisms
        assert f'KAFKA_LISTENER_NAME_{listener}_{mechanism.replace("-", "___")}_SASL_JAAS_CONFIG' in kafka
        assert settings.kafka.ssl_cafile == ca, name
        assert settings.kafka.sasl_password is not None
        assert users[settings.kafka.sasl_username or ''] == settings.kafka.sasl_password.get_secret_value(), (
            name
        )
        if settings.media.s3_endpoint is not None:
            assert settings.media.s3_endpoint.startswith('https://') and settings.media.s3_cafile == ca, name
    assert clients(compose)['topics'].kafka.sasl_username == 'admin'  # the one role that creates topics
    assert clients(compose)['projector'].kafka.sasl_username == 'projector'


def test_the_acls_compose_grants_are_the_documented_ones() -> None:
    assert sorted(acl_rules(SETUP.read_text(), command='acls'), key=repr) == sorted(
        documented_acl_rules(), key=repr
    )


def test_the_certificates_name_the_addresses_clients_use(compose: dict[str, Any]) -> None:
    text = CERTS.read_text()
    sans = dict(re.findall(r'^issue (\w+) "([^"]*)"$', text, re.MULTILINE))
    assert sans['kafka'] == 'DNS:kafka,DNS:localhost' and sans['minio'] == 'DNS:minio,DNS:localhost'
    assert 'operator' in sans  # the super user's client certificate
    services = compose['services']
    for name in ('kafka', 'kafka-setup', 'minio', 'minio-init', 'topics', 'projector'):
        assert 'certs:/certs:ro' in services[name]['volumes'], name
    assert '--certs-dir' in command_text(services['minio'])


def test_prometheus_scrapes_the_projector_and_grafana_shows_it(compose: dict[str, Any]) -> None:
    """The projector's metrics port is the one Prometheus scrapes and its healthcheck asks;
    Prometheus and Grafana mount files that exist, where their configuration looks for them."""
    services = compose['services']
    args = projector_args(compose)
    assert args.metrics_port == 9464 and args.metrics_host == '0.0.0.0'  # reachable on the network
    assert f'127.0.0.1:{args.metrics_port}:{args.metrics_port}' in services['projector']['ports']
    health = ' '.join(services['projector']['healthcheck']['test'])
    assert f'http://127.0.0.1:{args.metrics_port}/readyz' in health

    def mounts(service: str) -> dict[str, Path]:
        """Container path -> the compose/ file or folder bind-mounted there."""
        found = {}
        for volume in services[service]['volumes']:
            source, target = volume.split(':')[:2]
            if source.startswith('./'):
                found[target] = COMPOSE_DIR / source
                assert found[target].exists(), volume
        return found

    prometheus = services['prometheus']
    assert re.fullmatch(r'prom/prometheus:v3\.\d+\.\d+', prometheus['image'])
    assert '9090:9090' in prometheus['ports']
    files = mounts('prometheus')
    config_path = next(c.split('=', 1)[1] for c in prometheus['command'] if c.startswith('--config.file='))
    config = yaml.safe_load(files[config_path].read_text())
    for rules in config['rule_files']:  # relative to the config file, in the container and here
        in_container = str(Path(config_path).parent / rules)
        assert files[in_container] == files[config_path].parent / rules
    jobs = {job['job_name']: job for job in config['scrape_configs']}
    targets = [t for static in jobs['stepstream-projector']['static_configs'] for t in static['targets']]
    assert targets == [f'projector:{args.metrics_port}']

    grafana = services['grafana']
    assert re.fullmatch(r'grafana/grafana:\d+\.\d+\.\d+', grafana['image'])
    assert '3000:3000' in grafana['ports']
    files = mounts('grafana')
    provisioning = files['/etc/grafana/provisioning']
    datasources = yaml.safe_load((provisioning / 'datasources' / 'prometheus.yml').read_text())
    (source,) = datasources['datasources']
    assert source['url'] == 'http://prometheus:9090' and source['type'] == 'prometheus'
    providers = yaml.safe_load((provisioning / 'dashboards' / 'stepstream.yml').read_text())
    (provider,) = providers['providers']
    dashboards = files[provider['options']['path']]
    assert (dashboards / 'stepstream.json').exists()
    home = env_of(grafana)['GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH']
    assert (dashboards / Path(home).relative_to(provider['options']['path'])).exists()
