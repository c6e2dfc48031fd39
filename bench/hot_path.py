"""What issue 14 added to the capability's hot path, one operation at a time (no broker, no agent).

`python -m bench.hot_path` prints the best of 15 timeit repeats of each operation the capability
now does per step: encoding a `model_request_completed` event with its usage (against one
without), building the usage from the response, reading the current span's context (every event),
two monotonic clock reads (a model request, a tool call), the durability-point span and the
producer's metric calls, as they run with no OpenTelemetry SDK configured.
"""

from __future__ import annotations

import time
import timeit
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace
from pydantic_ai.messages import ModelResponse, TextPart
from pydantic_ai.usage import RequestUsage

from stepstream.producer._run import usage_of
from stepstream.schemas import StepEvent, encode
from stepstream.telemetry import ack_latency, records_appended, span


def _best_ns(fn: Any, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=15)) / number * 1e9


def main() -> None:
    """Print each operation's time in nanoseconds."""
    envelope: dict[str, Any] = {
        'run_id': 'bench-0194f0c2-1111-7000-8000-000000000000',
        'seq': 12,
        'writer_id': '0123456789abcdef',
        'timestamp': datetime.now(UTC),
        'agent_name': 'bench',
        'conversation_id': 'conv-1',
        'kind': 'model_request_completed',
        'step_index': 3,
        'idempotency_key': '12:3:model_request_completed:',
    }
    response = ModelResponse(
        parts=[TextPart('x')],
        usage=RequestUsage(input_tokens=1000, output_tokens=50, cache_read_tokens=200),
        model_name='gpt-4o',
        provider_name='openai',
        finish_reason='stop',
    )
    plain = StepEvent(**envelope)
    with_usage = StepEvent(**envelope, usage=usage_of(response), duration_us=123_456)
    attributes = {'stepstream.topic': 'step-events'}

    def durability_span() -> None:
        with span('stepstream.durability_point', attributes={'stepstream.run_id': 'r'}):
            pass

    def span_context() -> None:
        context = trace.get_current_span().get_span_context()
        _ = context.is_valid

    rows = [
        ('encode model_request_completed, v2 fields only', _best_ns(lambda: encode(plain), 20_000)),
        (
            'encode model_request_completed with usage + duration',
            _best_ns(lambda: encode(with_usage), 20_000),
        ),
        ('usage_of(response)', _best_ns(lambda: usage_of(response), 50_000)),
        ('current span context (every event)', _best_ns(span_context, 100_000)),
        ('2 x perf_counter_ns', _best_ns(lambda: (time.perf_counter_ns(), time.perf_counter_ns()), 100_000)),
        ('durability-point span, no SDK', _best_ns(durability_span, 100_000)),
        ('records_appended.add, no SDK', _best_ns(lambda: records_appended.add(1, attributes), 100_000)),
        ('ack_latency.record, no SDK', _best_ns(lambda: ack_latency.record(0.001), 100_000)),
    ]
    print(f'encoded sizes: {len(encode(plain))} B without usage, {len(encode(with_usage))} B with')
    for name, ns in rows:
        print(f'{name:<55} {ns:>8.0f} ns')


if __name__ == '__main__':
    main()
