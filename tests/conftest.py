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
}
"""Modules that never talk to Kafka, and the explorer's browser tests (what a page shows does not
depend on the broker; test_serve checks the API on both): run once, in the Tansu pass."""

ENGINE_BOUND = {'test_durable_exec', 'test_durable_temporal', 'test_durable_prefect'}
"""The durable-execution engines' tests: what they prove is what each engine journals and replays
(the broker only stores what the processes send), and each starts processes and servers for a
minute or more, so they run once, in the Tansu pass."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
