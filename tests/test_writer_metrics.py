"""The writer's metrics as an agent process exports them to Prometheus.

A child process (writer_metrics_child.py) sets up the OpenTelemetry Prometheus exporter as
docs/operations.md tells an application to, runs a real agent against the broker and S3 with an
image above the media threshold, and fails one durability point. Its `/metrics` must show every
`writer` entry of `stepstream.metrics.CATALOGUE` under that name, type, help and labels, with the
counts of what the child did: the records the topics hold, one acknowledgement each, the
failure by its error type, and the image's bytes moved to the media store.

OpenTelemetry allows one global meter provider per process (test_telemetry.py installs one with
an in-memory reader), hence the child.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from stepstream import Settings
from stepstream.kafka_client import client_options
from stepstream.metrics import CATALOGUE
from stepstream.telemetry import ACK_LATENCY_BUCKETS

from processes import HOST, free_port

pytestmark = [pytest.mark.broker, pytest.mark.once]

CHILD = Path(__file__).with_name('writer_metrics_child.py')

SCOPE_LABELS = {'otel_scope_name', 'otel_scope_version', 'otel_scope_schema_url'}
"""Labels the exporter puts on every series it exports, naming the meter (`stepstream`)."""

WRITER = {name: spec for name, spec in CATALOGUE.items() if spec.source == 'writer'}


async def _records_by_topic(settings: Settings) -> dict[str, int]:
    """The records each log topic holds (its end offsets: the test's topics are its own)."""
    consumer = AIOKafkaConsumer(**client_options(settings.kafka), enable_auto_commit=False)
    await consumer.start()
    try:
        held = {}
        for label, topic in (
            ('step-events', settings.topics.step_events_topic),
            ('tool-effects', settings.topics.tool_effects_topic),
        ):
            partitions = [TopicPartition(topic, p) for p in range(settings.topics.partitions)]
            held[label] = sum((await consumer.end_offsets(partitions)).values())
        return held
    finally:
        await consumer.stop()


async def _scrape(settings: Settings, log: Path) -> tuple[dict[str, Any], str]:
    """Run the child until it has done its work; what it reports and one scrape of its `/metrics`."""
    port = free_port()
    env = {**os.environ, **settings.to_env(), 'PYTHONPATH': str(CHILD.parent)}
    with log.open('wb') as errors:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            str(CHILD),
            str(port),
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=errors,
        )
    assert child.stdin is not None and child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 120)
        assert line, f'the child exited ({await child.wait()}) before its report: {log.read_text()[-3000:]}'
        async with httpx.AsyncClient() as client:
            scrape = await client.get(f'http://{HOST}:{port}/metrics')
        scrape.raise_for_status()
        return json.loads(line), scrape.text
    finally:
        child.stdin.close()
        if await asyncio.wait_for(child.wait(), 60) != 0:
            raise AssertionError(f'the child failed: {log.read_text()[-3000:]}')


async def test_an_agent_process_exports_the_catalogued_writer_metrics(
    settings: Settings, tmp_path: Path
) -> None:
    settings = settings.replace(media_threshold_bytes=4096)
    report, body = await _scrape(settings, tmp_path / 'child.log')
    families = {family.name: family for family in text_string_to_metric_families(body)}

    # Every writer metric of the catalogue, as catalogued: name, type, help, sample names, labels.
    for name, spec in WRITER.items():
        assert name in families, f'{name} not exported; the scrape has {sorted(families)}'
        family = families[name]
        assert (family.type, family.documentation) == (spec.kind, spec.help), name
        # The OpenTelemetry exporter writes no `_created` samples (prometheus_client's own metrics do).
        assert {s.name for s in family.samples} == {n for n in spec.samples if not n.endswith('_created')}
        for sample in family.samples:
            assert set(sample.labels) - SCOPE_LABELS - {'le'} == set(spec.labels), sample
            assert sample.labels['otel_scope_name'] == 'stepstream', sample
    assert 'target_info' in families  # the exporter's own: the process's resource attributes

    def values(name: str, sample: str | None = None) -> list[Sample]:
        wanted = sample or WRITER[name].samples[0]
        return [s for s in families[name].samples if s.name == wanted]

    # Every record the topics hold was counted once, on its topic, and acknowledged once.
    held = await _records_by_topic(settings)
    appended = {s.labels['stepstream_topic']: s.value for s in values('stepstream_producer_records_appended')}
    assert appended == held and held['step-events'] > 5 and held['tool-effects'] >= 2, (appended, held)
    latency = 'stepstream_producer_ack_latency_seconds'
    [acknowledged] = values(latency, f'{latency}_count')
    assert acknowledged.value == sum(held.values())
    bounds = [float(s.labels['le']) for s in values(latency, f'{latency}_bucket')]
    assert bounds == [*ACK_LATENCY_BUCKETS, math.inf] == [*WRITER[latency].buckets, math.inf]

    # The durability point the broker did not meet, by the class of the error the caller got.
    failures = {s.labels['error_type']: s.value for s in values('stepstream_producer_send_failures')}
    assert report['failure'] == 'StepStreamUnavailable' and failures == {'StepStreamUnavailable': 1.0}

    # The image went to the media store, not the log (the only value above the threshold).
    [offloads] = values('stepstream_media_offloads')
    [offloaded] = values('stepstream_media_offloaded_bytes')
    assert offloads.value >= 1 and offloaded.value == offloads.value * report['image_bytes'], (
        offloads,
        offloaded,
    )
