"""OpenTelemetry spans and metrics of the producer and the projector, through `opentelemetry-api` only.

Without an SDK configured (the default) the API hands out no-op tracers and meters: nothing is
recorded or exported, and each call costs well under a microsecond (docs/benchmarks/history/issue-14.md). An
application that configures one (Logfire, an OTLP exporter, the OpenTelemetry Prometheus exporter
as docs/operations.md shows, the SDK's in-memory exporters in tests) gets:

- spans `stepstream.durability_point` (a run waiting for the broker to acknowledge its records:
  a tool's `started`, a snapshot, the end of the run) and `stepstream.projector.batch` (one
  consumed batch staged and committed);
- the writer's metrics, in the agent's process: `stepstream.producer.records_appended` (records
  given to the producer, by `stepstream.topic`: `step-events` or `tool-effects`; a resend counts
  again), `stepstream.producer.ack_latency` (seconds from send to acks=all, one observation per
  record acknowledged), `stepstream.producer.send_failures` (a durability point, `flush` or
  conversation key the broker did not acknowledge in time or refused, once per failure, by
  `error.type`: the class of the error raised, `StepStreamUnavailable`, `SchemaRegistryError` or
  `AccessDenied`), `stepstream.media.offloads` and `stepstream.media.offloaded_bytes` (each
  payload a snapshot moved to the media store instead of the log, as given to the store: once
  per distinct payload of a snapshot, sealed bytes with erasure on, whether or not the store
  already held it). `stepstream.metrics.CATALOGUE` lists the names the Prometheus exporter gives
  them (its `writer` entries);
- the projector's: `stepstream.projector.records_applied`, `stepstream.projector.dead_lettered`
  (by reason) and `stepstream.projector.lag` (per topic and partition: the high watermark minus
  what is applied, after each batch).

Each writer metric is counted where its event happens (a send, an acknowledgement, a failure
raised, an upload), never per step otherwise. Every step event also stores the trace and span id
it was written under (schema v3).
"""

from __future__ import annotations

import contextlib

from opentelemetry import metrics, trace
from opentelemetry.trace import NoOpTracer, Span
from opentelemetry.util.types import Attributes

tracer = trace.get_tracer('stepstream')
_meter = metrics.get_meter('stepstream')

records_appended = _meter.create_counter(
    'stepstream.producer.records_appended',
    unit='{record}',
    description='Records given to the producer, by topic (step-events, tool-effects); a resend counts again.',
)
ACK_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds: the SDK's default buckets (0 to 10000) are made for milliseconds, and would put every
acknowledgement in the first one."""
_ACK_LATENCY = (
    'stepstream.producer.ack_latency',
    's',
    'From send to the acknowledgement (acks=all); its count is the acknowledgements.',
)
try:
    ack_latency = _meter.create_histogram(
        *_ACK_LATENCY, explicit_bucket_boundaries_advisory=ACK_LATENCY_BUCKETS
    )
except TypeError:  # opentelemetry-api before 1.23 takes no advice: the SDK's default buckets
    ack_latency = _meter.create_histogram(*_ACK_LATENCY)
send_failures = _meter.create_counter(
    'stepstream.producer.send_failures',
    unit='{failure}',
    description='Durability points that failed: the broker did not acknowledge, by error type.',
)
media_offloads = _meter.create_counter(
    'stepstream.media.offloads',
    unit='{payload}',
    description='Payloads written to the media store instead of the log.',
)
media_offloaded_bytes = _meter.create_counter(
    'stepstream.media.offloaded_bytes',
    unit='By',
    description='Bytes of the payloads written to the media store.',
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


def failed(error: BaseException) -> None:
    """Count a write the broker did not acknowledge (`send_failures`), by the class of `error` raised."""
    send_failures.add(1, {'error.type': type(error).__name__})


_NO_SPAN: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def span(name: str, attributes: Attributes = None) -> contextlib.AbstractContextManager[Span | None]:
    """A span named `name` for a `with` block; it gives None while no SDK is set up.

    Starting even a no-op span costs microseconds (a context attach and detach), and the capability
    opens one at every durability point of every step: with the API's default provider nothing could
    record it, so it is not started.
    """
    # The API's proxy tracer resolves to the SDK's once one is set (tests set it late), else to a
    # no-op; `get_tracer_provider()` would cost an `os.environ` lookup on every call.
    if isinstance(getattr(tracer, '_tracer', tracer), NoOpTracer):
        return _NO_SPAN
    return tracer.start_as_current_span(name, attributes=attributes)
