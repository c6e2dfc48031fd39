"""OpenTelemetry spans and metrics of the producer and the projector, through `opentelemetry-api` only.

Without an SDK configured (the default) the API hands out no-op tracers and meters: nothing is
recorded or exported, and each call costs well under a microsecond (docs/benchmarks/history/issue-14.md). An
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

import contextlib

from opentelemetry import metrics, trace
from opentelemetry.trace import NoOpTracer, Span
from opentelemetry.util.types import Attributes

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
