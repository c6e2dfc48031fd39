"""One settings object: environment, child-process hand-off and CLI flags agree."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
from pydantic import SecretStr

from stepstream import Settings
from stepstream.settings import KafkaSettings

pytestmark = [pytest.mark.fast, pytest.mark.once]


def test_env_round_trip() -> None:
    settings = Settings(
        bootstrap_servers='k1:9092,k2:9092',
        topic_prefix='prod.agents',
        s3_endpoint='http://minio:9000',
        s3_bucket='media',
        s3_access_key_id='AK',
        s3_secret_access_key='SK',
        media_threshold_bytes=1024,
        db_path='/var/lib/proj',
        ack_timeout_s=2.5,
    )
    env = settings.to_env()
    for name in (
        'BOOTSTRAP_SERVERS',
        'TOPIC_PREFIX',
        'S3_ENDPOINT',
        'S3_BUCKET',
        'S3_REGION',
        'S3_ACCESS_KEY_ID',
        'S3_SECRET_ACCESS_KEY',
        'MEDIA_THRESHOLD_BYTES',
        'DB_PATH',
    ):
        assert f'STEPSTREAM_{name}' in env
    assert Settings.from_env(env) == settings


def test_defaults_without_environment() -> None:
    settings = Settings.from_env({})
    assert settings == Settings()
    assert settings.topics.step_events_topic == 'stepstream.step-events'
    assert settings.topics.tool_effects_topic == 'stepstream.tool-effects'
    assert settings.topics.dlq_topic == 'stepstream.dlq'


def test_bad_values_name_the_variable() -> None:
    with pytest.raises(ValueError, match='STEPSTREAM_MEDIA_THRESHOLD_BYTES'):
        Settings.from_env({'STEPSTREAM_MEDIA_THRESHOLD_BYTES': 'lots'})
    with pytest.raises(ValueError, match='topic prefix'):
        Settings(topic_prefix='has space')
    with pytest.raises(ValueError, match='positive'):
        Settings(media_threshold_bytes=0)


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('STEPSTREAM_TOPIC_PREFIX', 'from-env')
    monkeypatch.setenv('STEPSTREAM_S3_BUCKET', 'env-bucket')
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    args = parser.parse_args(['--topic-prefix', 'from-flag', '--media-threshold-bytes', '4096'])
    settings = Settings.from_args(args)
    assert settings.topics.topic_prefix == 'from-flag'
    assert settings.media.media_threshold_bytes == 4096
    assert settings.media.s3_bucket == 'env-bucket'


def test_security_settings_round_trip_and_hide_the_password(tmp_path: Path) -> None:
    secret_file = tmp_path / 'kafka-password'
    secret_file.write_text('s3cr3t\n')  # as a mounted secret often ends
    env = {
        'STEPSTREAM_SECURITY_PROTOCOL': 'sasl_ssl',
        'STEPSTREAM_SASL_MECHANISM': 'scram-sha-512',
        'STEPSTREAM_SASL_USERNAME': 'producer',
        'STEPSTREAM_SASL_PASSWORD_FILE': str(secret_file),
        'STEPSTREAM_SSL_CAFILE': '/etc/kafka/ca.pem',
    }
    settings = Settings.from_env(env)
    assert settings.kafka.security_protocol == 'SASL_SSL' and settings.kafka.sasl_mechanism == 'SCRAM-SHA-512'
    assert (
        settings.kafka.sasl_password is not None
        and settings.kafka.sasl_password.get_secret_value() == 's3cr3t'
    )
    assert 's3cr3t' not in repr(settings) and 's3cr3t' not in str(settings.kafka.sasl_password)
    # A child process is handed the secret itself, and reads back the same settings.
    assert settings.to_env()['STEPSTREAM_SASL_PASSWORD'] == 's3cr3t'
    assert Settings.from_env(settings.to_env()) == settings


def test_the_password_has_no_flag_and_one_source() -> None:
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    assert '--sasl-password' not in parser.format_help()
    assert '--sasl-username' in parser.format_help()
    with pytest.raises(ValueError, match='not both'):
        Settings.from_env({'STEPSTREAM_SASL_PASSWORD': 'a', 'STEPSTREAM_SASL_PASSWORD_FILE': '/x'})
    with pytest.raises(ValueError, match=r'STEPSTREAM_SASL_PASSWORD_FILE=.*cannot be read'):
        Settings.from_env({'STEPSTREAM_SASL_PASSWORD_FILE': '/nonexistent/password'})


@pytest.mark.parametrize(
    ('fields', 'message'),
    [
        ({'security_protocol': 'TLS'}, 'STEPSTREAM_SECURITY_PROTOCOL .* must be one of'),
        ({'security_protocol': 'SASL_SSL'}, 'needs STEPSTREAM_SASL_MECHANISM'),
        ({'security_protocol': 'SASL_SSL', 'sasl_mechanism': 'GSSAPI'}, r'STEPSTREAM_SASL_MECHANISM .* one'),
        ({'security_protocol': 'SASL_SSL', 'sasl_mechanism': 'PLAIN'}, 'needs STEPSTREAM_SASL_USERNAME'),
        (
            {'security_protocol': 'SASL_SSL', 'sasl_mechanism': 'OAUTHBEARER'},
            'needs STEPSTREAM_SASL_OAUTH_TOKEN_PROVIDER',
        ),
        ({'sasl_mechanism': 'PLAIN', 'sasl_username': 'u'}, 'SASL credentials are set but'),
        ({'ssl_cafile': '/ca.pem'}, 'TLS files are set but'),
        ({'security_protocol': 'SSL', 'ssl_keyfile': '/k.pem'}, 'STEPSTREAM_SSL_KEYFILE .* without'),
    ],
)
def test_a_security_setup_that_cannot_work_is_refused_naming_the_variable(
    fields: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(**fields)  # type: ignore[arg-type]


def test_one_place_builds_every_kafka_client_s_options(tmp_path: Path) -> None:
    from aiokafka.abc import AbstractTokenProvider

    from stepstream.kafka_client import client_options

    plain = client_options(KafkaSettings())
    assert plain == {'bootstrap_servers': '127.0.0.1:9092', 'security_protocol': 'PLAINTEXT'}
    scram = client_options(
        KafkaSettings(
            security_protocol='SASL_SSL',
            sasl_mechanism='SCRAM-SHA-256',
            sasl_username='u',
            sasl_password=SecretStr('p'),  # type: ignore[arg-type]
        )
    )
    assert scram['sasl_plain_username'] == 'u' and scram['sasl_plain_password'] == 'p'
    assert scram['ssl_context'].check_hostname  # hostname verification stays on
    oauth = client_options(
        KafkaSettings(
            security_protocol='SASL_SSL',
            sasl_mechanism='OAUTHBEARER',
            sasl_oauth_token_provider='secure_kafka:ProducerToken',
        )
    )
    assert isinstance(oauth['sasl_oauth_token_provider'], AbstractTokenProvider)


def test_a_ca_file_that_is_missing_or_not_a_certificate_names_the_variable(tmp_path: Path) -> None:
    from stepstream.errors import SecureConnectionError
    from stepstream.kafka_client import client_options

    garbage = tmp_path / 'ca.pem'
    garbage.write_text('-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n')
    for cafile, cause in [(tmp_path / 'missing.pem', 'cannot be read'), (garbage, 'holds no CA certificate')]:
        settings = Settings(security_protocol='SSL', ssl_cafile=str(cafile))
        with pytest.raises(SecureConnectionError, match=f'STEPSTREAM_SSL_CAFILE=.*{cause}'):
            client_options(settings.kafka)


def test_registry_settings_round_trip_and_hide_the_password(tmp_path: Path) -> None:
    secret_file = tmp_path / 'registry-secret'
    secret_file.write_text('api-secret\n')
    env = {
        'STEPSTREAM_SCHEMA_REGISTRY_URL': 'https://psrc-123.eu-west-1.aws.confluent.cloud',
        'STEPSTREAM_SCHEMA_REGISTRY_USERNAME': 'API_KEY',
        'STEPSTREAM_SCHEMA_REGISTRY_PASSWORD_FILE': str(secret_file),
        'STEPSTREAM_SCHEMA_REGISTRY_CAFILE': '/etc/registry/ca.pem',
    }
    settings = Settings.from_env(env)
    assert settings.registry.schema_registry_password is not None
    assert settings.registry.schema_registry_password.get_secret_value() == 'api-secret'
    assert 'api-secret' not in repr(settings)
    assert Settings.from_env(settings.to_env()) == settings
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    assert '--schema-registry-url' in parser.format_help()
    assert '--schema-registry-password' not in parser.format_help()


@pytest.mark.parametrize(
    ('fields', 'message'),
    [
        ({'schema_registry_url': 'registry:8081'}, 'STEPSTREAM_SCHEMA_REGISTRY_URL .* http:// or https://'),
        ({'schema_registry_username': 'u'}, 'without STEPSTREAM_SCHEMA_REGISTRY_URL'),
        (
            {'schema_registry_url': 'https://r', 'schema_registry_username': 'u'},
            'SCHEMA_REGISTRY_PASSWORD_FILE\\) go together',
        ),
        (
            {'schema_registry_url': 'http://r:8081', 'schema_registry_cafile': '/ca.pem'},
            'STEPSTREAM_SCHEMA_REGISTRY_CAFILE .* not TLS',
        ),
    ],
)
def test_a_registry_setup_that_cannot_work_is_refused_naming_the_variable(
    fields: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(**fields)  # type: ignore[arg-type]


def test_each_setting_lives_in_one_section_and_flat_names_are_routed_there() -> None:
    from stepstream.settings import SECTION_OF, SECTIONS, SETTING_NAMES, MediaSettings, ProjectionSettings

    settings = Settings(db_path='/var/lib/proj', s3_bucket='media', partitions=3)
    assert settings.projection == ProjectionSettings(db_path='/var/lib/proj')
    assert settings.media.s3_bucket == 'media' and settings.topics.partitions == 3
    assert not hasattr(settings, 'db_path')  # one name per value: the section's
    # Every setting is one section's field, and the loader knows each by its flat name.
    assert len(SECTION_OF) == len(SETTING_NAMES) == sum(len(dataclasses.fields(c)) for c in SECTIONS.values())
    # A section given whole, and flat names over it; replace takes either.
    given = Settings(media=MediaSettings(s3_bucket='b'), media_threshold_bytes=10)
    assert given.media == MediaSettings(s3_bucket='b', media_threshold_bytes=10)
    assert (
        given.replace(db_path='/p').projection.db_path == '/p'
        and given.replace(db_path='/p').media == given.media
    )
    assert dataclasses.replace(settings, topic_prefix='x').topics.step_events_topic == 'x.step-events'  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'media_threshold'"):
        Settings(media_threshold=1)
    with pytest.raises(TypeError, match='takes a MediaSettings'):
        Settings(media=ProjectionSettings())


def test_a_section_checks_its_own_fields_naming_the_variable_and_flag() -> None:
    from stepstream.settings import LivenessSettings, MediaSettings, TopicSettings

    with pytest.raises(
        ValueError,
        match=r'media_threshold_bytes must be a positive int, got 0 \(set by STEPSTREAM_MEDIA_THRESHOLD',
    ):
        MediaSettings(media_threshold_bytes=0)
    with pytest.raises(
        ValueError,
        match=r'partitions must be a positive int, got 0 \(set by STEPSTREAM_PARTITIONS \(--partitions\)\)',
    ):
        TopicSettings(partitions=0)
    with pytest.raises(
        ValueError, match=r'stale_after_s must not be negative, got -1 \(set by STEPSTREAM_STALE_AFTER_S'
    ):
        LivenessSettings(stale_after_s=-1)
    with pytest.raises(
        ValueError,
        match=r'ack_timeout_s must be positive, got 0.0 \(set by STEPSTREAM_ACK_TIMEOUT_S \(--ack-timeout-s',
    ):
        Settings.from_env({'STEPSTREAM_ACK_TIMEOUT_S': '0'})


def test_the_media_threshold_has_one_default_and_one_check() -> None:
    from stepstream.media import DEFAULT_THRESHOLD_BYTES
    from stepstream.settings import MediaSettings

    assert (
        DEFAULT_THRESHOLD_BYTES
        == MediaSettings().media_threshold_bytes
        == Settings().media.media_threshold_bytes
    )
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match='threshold_bytes must be a positive int'):
            MediaSettings.check_threshold(bad, 'threshold_bytes')
