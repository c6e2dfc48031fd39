"""One settings object: environment, child-process hand-off and CLI flags agree."""

from __future__ import annotations

import argparse

import pytest

from stepstream import Settings


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
    assert settings.step_events_topic == 'stepstream.step-events'
    assert settings.tool_effects_topic == 'stepstream.tool-effects'
    assert settings.dlq_topic == 'stepstream.dlq'


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
    assert settings.topic_prefix == 'from-flag'
    assert settings.media_threshold_bytes == 4096
    assert settings.s3_bucket == 'env-bucket'
