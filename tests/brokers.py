"""Which embedded broker this test pass runs on, and marks for behaviour only one of them has.

`make test` runs the suite twice: on Tansu (the default) and on Apache Kafka
(`STEPSTREAM_EMBEDDED_BROKER=kafka`). A test that only makes sense on one says why.
"""

from __future__ import annotations

import os

import pytest

BROKER = os.environ.get('STEPSTREAM_EMBEDDED_BROKER') or 'tansu'
BROKER_LOG = 'kafka.log' if BROKER == 'kafka' else 'tansu.log'


def kafka_only(why: str) -> pytest.MarkDecorator:
    """Skip on Tansu, saying which of its gaps the test needs filled."""
    return pytest.mark.skipif(BROKER != 'kafka', reason=f'Tansu {why}')


def tansu_only(why: str) -> pytest.MarkDecorator:
    """Skip on Apache Kafka, saying why the test is about Tansu alone."""
    return pytest.mark.skipif(BROKER != 'tansu', reason=why)
