"""OpenTelemetry spans and metrics of the producer and the projector, through `opentelemetry-api` only.

Without an SDK configured (the default) the API hands out no-op tracers and meters: nothing is
recorded or exported, and each call costs well under a microsecond (docs/benchmarks.md). An
application that configures one (Logfire, an OTLP exporter, the SDK's in-memory exporters in
tests) gets:

- spans `stepstream.durability_point` (a run waiting for the broker to acknowledge its records:
  a tool's `started`, a snapshot, the end of the run) and `stepstream.projector.batch` (one
  consumed batch staged and committed);
- metrics `stepstream.producer.records_appended` and `stepstream.producer.ack_latency` (seconds
  from send to acks=all), `stepstream.projector.records_applied`,
  `stepstream.projector.dead_lettered` (by reason) and `stepstream.projector.lag` (per topic and
  partition: the high watermark minus what is applied, after each batch).

Every step event also stores the trace and span id it was written under (schema v3).
"""

from __future__ import annotations

from opentelemetry import metrics, trace

tracer = trace.get_tracer('stepstream')
_meter = metrics.get_meter('stepstream')

records_appended = _meter.create_counter(
    'stepstream.producer.records_appended', unit='{record}', description='Records sent to the broker.'
)
ack_latency = _meter.create_histogram(
    'stepstream.producer.ack_latency', unit='s', description='From send to the acknowledgement (acks=all).'
)
records_applied = _meter.create_counter(
    'stepstream.projector.records_applied', unit='{record}', description='Records applied to the projection.'
)
records_dead_lettered = _meter.create_counter(
    'stepstream.projector.dead_lettered', unit='{record}', description='Records sent to the DLQ, by reason.'
)
lag = _meter.create_gauge(
    'stepstream.projector.lag',
    unit='{record}',
    description='Records of a partition not applied yet (high watermark minus position), after a batch.',
)
