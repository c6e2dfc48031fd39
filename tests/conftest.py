"""Shared fixtures: one real embedded stack (Tansu + SeaweedFS) for the session.

Tests share the broker but never a topic: each test gets its own topic prefix, so they cannot
see each other's records, and its own RocksDB directory.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from stepstream import Settings
from stepstream.embedded import EmbeddedStack
from stepstream.producer import EventLog
from stepstream.projector import Projector

from brokers import BROKER


@pytest.fixture(scope='session')
def stack() -> Iterator[EmbeddedStack]:
    embedded = EmbeddedStack()
    embedded.start()
    try:
        yield embedded
    finally:
        embedded.stop()


@pytest.fixture
def settings(stack: EmbeddedStack) -> Settings:
    return stack.settings.replace(topic_prefix=f'test-{uuid.uuid4().hex[:12]}', partitions=3)


@pytest.fixture
async def event_log(settings: Settings) -> AsyncIterator[EventLog]:
    async with EventLog(settings) as log:
        yield log


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / 'projection'


@pytest.fixture
async def projector(settings: Settings, db_path: Path) -> AsyncIterator[Projector]:
    async with Projector(settings, db_path=db_path) as running:
        yield running


BROKER_INDEPENDENT = {
    'test_apply_properties',
    'test_settings',
    'test_compose',
    'test_media',
    'test_media_externalizer',
    'test_explorer',
    'test_capability_rules',
    'test_cli_usage',
    'test_liveness',
    'test_retention',
}
"""Modules that never talk to Kafka, and the explorer's browser tests (what a page shows does not
depend on the broker; test_serve checks the API on both): run once, in the Tansu pass."""

ENGINE_BOUND = {'test_durable_exec', 'test_durable_temporal', 'test_durable_prefect'}
"""The durable-execution engines' tests: what they prove is what each engine journals and replays
(the broker only stores what the processes send), and each starts processes and servers for a
minute or more, so they run once, in the Tansu pass."""


STARTS_SERVICES = {
    'test_brokers',
    'test_cli',
    'test_compose_kafka',
    'test_demo',
    'test_embedded',
    'test_failure_paths',
    'test_media_e2e',
    'test_s3_tls',
    'test_schema_registry',
    'test_telemetry',
    'test_producer::test_a_refused_broker_is_named_and_not_blamed_on_the_timeout',
    'test_producer::test_broker_down_at_a_durability_point_fails_the_run_before_the_tool',
    'test_media::test_s3_stopped_fails_clearly_and_recovers',
    'test_cli_usage::test_version_and_help',
    'test_cli_usage::test_the_secret_key_is_never_a_flag',
    'test_cli_usage::test_a_usage_error_names_the_subcommand_and_the_closest_flag',
    'test_cli_usage::test_a_wrong_broker_address_says_what_is_wrong',
}
"""Modules and tests that start a broker, S3, a CLI process or a JVM of their own (without the
`stack` fixture): left out of the fast tier with every test that asks for `stack`."""


def needs_services(item: pytest.Item) -> bool:
    """Whether a test talks to a broker or S3 (or starts a process): not in the fast tier."""
    module = getattr(item, 'module', None)
    name = module.__name__ if module is not None else ''
    test = getattr(item, 'originalname', item.name)
    return (
        'stack' in getattr(item, 'fixturenames', ())
        or name in STARTS_SERVICES
        or f'{name}::{test}' in STARTS_SERVICES
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        '--fast',
        action='store_true',
        help='the fast tier (`make check`): unit and property tests that need no broker and no S3',
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption('--fast'):
        keep = [item for item in items if not needs_services(item)]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    if BROKER != 'kafka':
        return
    skip = pytest.mark.skip(reason='does not touch the broker: it runs in the Tansu pass')
    skip_engine = pytest.mark.skip(reason="tests an engine's journal, not the broker: runs in the Tansu pass")
    for item in items:
        module = getattr(item, 'module', None)
        if module is not None and module.__name__ in BROKER_INDEPENDENT:
            item.add_marker(skip)
        elif module is not None and module.__name__ in ENGINE_BOUND:
            item.add_marker(skip_engine)
