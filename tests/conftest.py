"""Shared fixtures: one real embedded stack (Tansu + SeaweedFS) for the session; and the tiers.

Tests share the broker but never a topic: each test gets its own topic prefix, so they cannot
see each other's records, and its own RocksDB directory.

Each test is in one tier, by a pytest marker on its module or on itself (pyproject.toml lists
them): collection fails on a test in none, and on a `fast` one that asks for `stack`.
"""

from __future__ import annotations

import os
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


TIERS = ('fast', 'broker', 'engines', 'browser')
"""The tiers a test pass selects by (pyproject.toml's `markers` says what each means): every test
has exactly one, on its module (`pytestmark`) or on itself; `soak` may go with `broker`, or stand
alone for a test only `make soak` runs."""

ONCE = {'fast', 'once', 'engines', 'browser'}
"""Marks of tests that run once, in the Tansu pass: what they prove does not depend on the broker
(`fast`, which uses none; `once`, a broker-tier test whose answer does not depend on which), or
each starts an engine's processes for a minute or more (`engines`), or what a page shows does not
depend on the broker (`browser`; test_serve checks the API on both)."""


def tier_error(item: pytest.Item) -> str | None:
    """Why `item` is in no tier or the wrong one, or None."""
    marks = {mark.name for mark in item.iter_markers()}
    tiers = sorted(marks.intersection(TIERS))
    if len(tiers) > 1:
        return f'marked {", ".join(tiers)}: one tier only'
    if not tiers and 'soak' not in marks:
        return f'no tier marker: mark its module (`pytestmark`) or it with one of {", ".join(TIERS)}'
    if tiers == ['fast'] and 'stack' in getattr(item, 'fixturenames', ()):
        return 'marked fast but asks for the `stack` fixture (a broker and S3): mark it broker'
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    errors = [f'{item.nodeid}: {error}' for item in items if (error := tier_error(item))]
    if errors:
        raise pytest.UsageError('tests outside the tiers (tests/conftest.py):\n' + '\n'.join(errors))
    soak_only = pytest.mark.skip(reason='a soak test: `make soak` runs it (STEPSTREAM_SOAK_KILLS)')
    skip = pytest.mark.skip(reason='does not touch the broker: it runs in the Tansu pass')
    skip_engine = pytest.mark.skip(reason="tests an engine's journal, not the broker: runs in the Tansu pass")
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        if not marks.intersection(TIERS) and not os.environ.get('STEPSTREAM_SOAK_KILLS'):
            item.add_marker(soak_only)
        if BROKER == 'kafka' and 'engines' in marks:
            item.add_marker(skip_engine)
        elif BROKER == 'kafka' and marks.intersection(ONCE):
            item.add_marker(skip)
