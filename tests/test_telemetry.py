"""OpenTelemetry: spans and metrics through the API, read with the SDK's in-memory exporters; without an
SDK nothing is recorded and events carry no trace ids."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic_ai import Agent

from stepstream import Settings
from stepstream.kafka_client import client_options
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import StepEvent, decode
from stepstream.serve import app_for, running
from stepstream.topics import murmur2_partition

from agents import calls_then_answers

pytestmark = pytest.mark.broker


@dataclass
class Telemetry:
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader

    def points(self, name: str) -> list[Any]:
        data = self.metrics.get_metrics_data()
        assert data is not None
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]


async def _step_records(settings: Settings, run_id: str) -> list[tuple[StepEvent, dict[str, bytes]]]:
    """The run's step events as the topic holds them, each with its Kafka headers."""
    partition = TopicPartition(
        settings.topics.step_events_topic, murmur2_partition(run_id.encode(), settings.topics.partitions)
    )
    consumer = AIOKafkaConsumer(**client_options(settings.kafka), enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([partition])
        await consumer.seek_to_beginning(partition)
        end = (await consumer.end_offsets([partition]))[partition]
        records = []
        while await consumer.position(partition) < end:
            for batch in (await consumer.getmany(partition, timeout_ms=1000)).values():
                records.extend(r for r in batch if r.key == run_id.encode())
    finally:
        await consumer.stop()
    decoded = [(decode(r.value), dict(r.headers)) for r in records if r.value is not None]
    return [(event, headers) for event, headers in decoded if isinstance(event, StepEvent)]


@pytest.fixture(scope='module')
def sdk() -> Iterator[Telemetry]:
    """The SDK, installed once per process (OpenTelemetry allows one global provider)."""
    spans = InMemorySpanExporter()
    reader = InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        pytest.skip('another tracer provider was installed in this process first')
    yield Telemetry(spans, reader)


async def test_spans_metrics_and_trace_ids_under_an_sdk(
    sdk: Telemetry, settings: Settings, event_log: EventLog, projector: Projector
) -> None:
    sdk.spans.clear()
    agent = Agent(
        calls_then_answers('lookup', 2), capabilities=[StepPersistence(log=event_log, agent_name='traced')]
    )

    @agent.tool_plain
    def lookup() -> str:
        return 'found'

    with trace.get_tracer('the-application').start_as_current_span('handle request') as outer:
        await agent.run('go', conversation_id='conv-traced')
    await projector.wait_for(await event_log.flush())
    reader = ProjectionReader.of(projector)
    [run] = await reader.list_runs(conversation_id='conv-traced')
    events = await reader.list_events(run.run_id)

    # Every event names the trace it was written in: the application's, so a run links to it.
    trace_id = f'{outer.get_span_context().trace_id:032x}'
    assert {e.trace_id for e in events} == {trace_id}
    assert all(e.span_id is not None and len(e.span_id) == 16 for e in events)
    # Each record's `traceparent` names the span the event was written in, although the log
    # sends it later, from a durability point's span (decision 0025).
    written = await _step_records(settings, run.run_id)
    assert len(written) == len(events)
    assert all(
        headers['traceparent'].decode().split('-')[1:3] == [event.trace_id, event.span_id]
        for event, headers in written
    ), [(event.kind, event.span_id, headers.get('traceparent')) for event, headers in written]

    # The explorer links each event to its trace, in the viewer the settings name.
    viewer = settings.replace(trace_url='https://traces.example/trace/{trace_id}?span={span_id}')
    async with (
        running(app_for(viewer, reader=reader), port=0) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        page = (await client.get(f'/runs/{run.run_id}')).text
    links = re.findall(r'href="https://traces\.example/trace/([0-9a-f]{32})\?span=([0-9a-f]{16})"', page)
    assert len(links) == len(events)
    assert {t for t, _ in links} == {trace_id} and {s for _, s in links} == {e.span_id for e in events}

    # One span per durability point, children in that trace, naming the run.
    finished = sdk.spans.get_finished_spans()
    points = [s for s in finished if s.name == 'stepstream.durability_point']
    durable = [
        e for e in events if e.kind in ('run_started', 'tool_call_started', 'snapshot_saved', 'run_completed')
    ]
    assert len(points) == len(durable)
    assert all(s.context.trace_id == outer.get_span_context().trace_id for s in points)
    assert all(s.attributes['stepstream.run_id'] == run.run_id for s in points)  # type: ignore[index]
    batches = [s for s in finished if s.name == 'stepstream.projector.batch']
    assert batches and sum(s.attributes['stepstream.applied'] for s in batches) >= run.event_count  # type: ignore[index, misc]

    # Metrics: every record appended, acknowledged (with its latency) and applied.
    appended = sum(p.value for p in sdk.points('stepstream.producer.records_appended'))
    by_topic = {
        p.attributes['stepstream.topic']: p.value for p in sdk.points('stepstream.producer.records_appended')
    }
    assert (
        by_topic['step-events'] >= len(events) and by_topic['tool-effects'] >= 4
    )  # two calls, two transitions each
    acked = sum(p.count for p in sdk.points('stepstream.producer.ack_latency'))
    applied = sum(p.value for p in sdk.points('stepstream.projector.records_applied'))
    assert appended >= run.event_count and acked >= run.event_count and applied >= run.event_count
    lags = {
        (p.attributes['stepstream.topic'], p.attributes['stepstream.partition']): p.value
        for p in sdk.points('stepstream.projector.lag')
    }
    home = murmur2_partition(run.run_id.encode(), settings.topics.partitions)
    assert (settings.topics.step_events_topic, home) in lags and (
        settings.topics.tool_effects_topic,
        home,
    ) in lags
    assert all(value >= 0 for value in lags.values())

    # A record the projector cannot apply is counted by reason.
    before = sum(
        p.value
        for p in sdk.points('stepstream.projector.dead_lettered')
        if p.attributes['stepstream.reason'] == 'not_a_record'
    )
    producer = AIOKafkaProducer(**client_options(settings.kafka))
    await producer.start()
    try:
        sent = await producer.send_and_wait(
            settings.topics.step_events_topic, b'not an avro record', key=b'poison'
        )
    finally:
        await producer.stop()
    await projector.wait_for({TopicPartition(sent.topic, sent.partition): sent.offset + 1})
    after = sum(
        p.value
        for p in sdk.points('stepstream.projector.dead_lettered')
        if p.attributes['stepstream.reason'] == 'not_a_record'
    )
    assert after == before + 1


def test_without_an_sdk_nothing_is_recorded_and_events_carry_no_trace() -> None:
    """A fresh process with only the API: the no-op tracer, and events without trace ids."""
    script = textwrap.dedent(
        """
        import asyncio, sys, tempfile
        sys.path.insert(0, 'tests')
        from opentelemetry import trace
        from pydantic_ai import Agent
        from agents import calls_then_answers
        from stepstream.media import DiskMediaStore
        from stepstream.producer import StepPersistence
        from stepstream.producer._memory import InMemoryLog

        async def main():
            log = InMemoryLog()
            with tempfile.TemporaryDirectory() as tmp:
                persistence = StepPersistence(log=log, agent_name='plain', media_store=DiskMediaStore(tmp))
                agent = Agent(calls_then_answers('lookup', 1), capabilities=[persistence])
                agent.tool_plain(lambda: 'found', name='lookup')
                with trace.get_tracer('app').start_as_current_span('handle request') as span:
                    assert not span.is_recording()
                    await agent.run('go')
            events = [r.record for r in log.records if hasattr(r.record, 'kind')]
            assert events and all(e.trace_id is None and e.span_id is None for e in events)
            print(len(events), type(trace.get_tracer_provider()).__name__)

        asyncio.run(main())
        """
    )
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    count, provider = done.stdout.split()
    assert int(count) > 5 and provider == 'ProxyTracerProvider'
