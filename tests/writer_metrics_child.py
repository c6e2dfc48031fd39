"""Run as a child process by test_writer_metrics.py: an agent process exporting the writer's metrics.

`python writer_metrics_child.py PORT`, with the settings in `STEPSTREAM_*`. It sets up the
OpenTelemetry Prometheus exporter exactly as docs/operations.md tells an application to (the
port aside), runs one agent whose prompt holds an image above the media threshold, then reaches
one durability point the broker cannot meet (an acknowledgement deadline of 0 s: the records are
not even handed to the producer by then), and flushes. It prints what it did as one JSON line,
then serves `/metrics` until its stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import UTC, datetime

from opentelemetry import metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import start_http_server
from pydantic_ai import Agent, BinaryContent

from stepstream import Settings, StepStreamUnavailable
from stepstream.producer import EventLog, StepPersistence
from stepstream.schemas import StepEvent

from agents import calls_then_answers

IMAGE = os.urandom(20_000)
"""Above the test's media threshold: the snapshot that holds the prompt moves it to S3."""


async def main() -> dict[str, object]:
    async with EventLog(Settings.from_env()) as log:
        agent = Agent(
            calls_then_answers('look', 1), capabilities=[StepPersistence(log=log, agent_name='metered')]
        )

        @agent.tool_plain
        def look() -> str:
            return 'a cat'

        await agent.run(['what is in this picture?', BinaryContent(IMAGE, media_type='image/png')])

        late = StepEvent(
            run_id='metered-late', seq=0, writer_id='metered', timestamp=datetime.now(UTC), kind='run_started'
        )
        try:
            await log.wait_acked([await log.append(late)], timeout=0)
        except StepStreamUnavailable as error:
            failure = type(error).__name__
        else:
            raise AssertionError('a durability point with a 0 s deadline was met')
        await log.flush()  # the late record is taken after all: every record sent is acknowledged
    return {'image_bytes': len(IMAGE), 'failure': failure}


if __name__ == '__main__':
    port = int(sys.argv[1])

    start_http_server(port)
    metrics.set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))

    print(json.dumps(asyncio.run(main())), flush=True)
    sys.stdin.read()  # serve /metrics until the test is done scraping
