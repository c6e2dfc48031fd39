"""What the services expose to Prometheus and Kubernetes: `/metrics`, `/healthz`, `/readyz`.

Every metric is declared once, in `CATALOGUE`: its Prometheus name, type, help and labels. The
projector and `serve` build their instruments from it (`counter`, `histogram`, `gauge`), the
shipped alerts and dashboard name only metrics in it (tests/test_alerts.py), and
docs/operations.md lists it. Labels are bounded: topics, partition numbers, DLQ reasons, run
statuses, routes; never a run id.

The writer runs inside the agent's own process and reports through the OpenTelemetry API
(`stepstream.telemetry`); the `writer` entries below are the names the OpenTelemetry Prometheus
exporter gives those instruments (docs/operations.md shows the three lines that export them).

A long-running process serves the three paths with `ProbeServer` (the projector's
`--metrics-port`) or as routes of its application (`serve`). Probes are asked on the process's
event loop: `/healthz` answers 200 while the loop turns (a no-op scheduled on it runs within the
probe's timeout) and the process has not stopped on an error; `/readyz` answers 200 while
`Probes.ready` says so (a projector member: it holds a shard for every partition the group
assigned it, and is within `max_lag` records of the log's end). Both answer JSON, and 503 when not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socketserver
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from stepstream.schemas import RUN_STATUSES

log = logging.getLogger('stepstream.metrics')

Kind = Literal['counter', 'gauge', 'histogram']
Source = Literal['projector', 'serve', 'writer']

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds: a batch's apply, a request's answer."""
FRESHNESS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
"""Seconds from a record's timestamp to its apply: milliseconds live, up to an hour catching up."""


@dataclass(frozen=True)
class Metric:
    """One metric as Prometheus shows it (a counter's samples add `_total`, a histogram's `_bucket`...)."""

    name: str
    kind: Kind
    help: str
    source: Source
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = field(default=LATENCY_BUCKETS, repr=False)

    @property
    def samples(self) -> tuple[str, ...]:
        """The sample names a scrape shows for it.

        `_created` (when a counter or histogram started) comes from the Prometheus client in our
        processes; the OpenTelemetry exporter of a writer's process shows none.
        """
        created = ('created',) if self.source != 'writer' else ()
        if self.kind == 'counter':
            return tuple(f'{self.name}_{suffix}' for suffix in ('total', *created))
        if self.kind == 'histogram':
            return tuple(f'{self.name}_{suffix}' for suffix in ('bucket', 'count', 'sum', *created))
        return (self.name,)


CATALOGUE: dict[str, Metric] = {
    m.name: m
    for m in (
        # -- the projector (each process; a group's members each show their own shards) --------
        Metric(
            'stepstream_projector_records_applied',
            'counter',
            'Records applied to the projection (repeats and dead letters not counted).',
            'projector',
        ),
        Metric(
            'stepstream_projector_duplicates_ignored',
            'counter',
            'Records already applied, seen again (a redelivery) and ignored.',
            'projector',
        ),
        Metric(
            'stepstream_projector_dead_letters',
            'counter',
            'Records sent to the DLQ, by reason (the reasons are a fixed set: DLQ_REASONS).',
            'projector',
            ('reason',),
        ),
        Metric(
            'stepstream_projector_batch_apply_seconds',
            'histogram',
            'Time to stage and commit one consumed batch to its shards (DLQ acknowledgement included).',
            'projector',
        ),
        Metric(
            'stepstream_projector_freshness_seconds',
            'histogram',
            "From a record's timestamp to its batch committed; one observation per partition and "
            'batch, for its oldest record.',
            'projector',
            buckets=FRESHNESS_BUCKETS,
        ),
        Metric(
            'stepstream_projector_lag_records',
            'gauge',
            'Records of a partition not applied yet: its end offset minus the position applied.',
            'projector',
            ('topic', 'partition'),
        ),
        Metric(
            'stepstream_projector_lag_seconds',
            'gauge',
            'How long the oldest record not applied yet has been in the partition, as this process saw '
            'the end offset move (0 when caught up).',
            'projector',
            ('topic', 'partition'),
        ),
        Metric('stepstream_projector_partitions', 'gauge', 'Partitions of each log topic.', 'projector'),
        Metric(
            'stepstream_projector_partitions_assigned',
            'gauge',
            'Partition numbers this process was given (by its group, or all of them alone).',
            'projector',
        ),
        Metric('stepstream_projector_shards_owned', 'gauge', 'Shards this process holds open.', 'projector'),
        Metric(
            'stepstream_projector_shards_missing',
            'gauge',
            'Partitions assigned to this process whose shard is not open yet (opening or restoring).',
            'projector',
        ),
        Metric(
            'stepstream_projector_ready',
            'gauge',
            '1 while /readyz answers 200: every assigned shard open and within the lag allowed.',
            'projector',
        ),
        Metric(
            'stepstream_projector_parked_records',
            'gauge',
            "Records waiting for their run's run_started, which has not arrived.",
            'projector',
        ),
        Metric(
            'stepstream_projector_checkpoints',
            'counter',
            'Shard checkpoints, by outcome: uploaded to S3, or failed (a member in a group).',
            'projector',
            ('outcome',),
        ),
        Metric(
            'stepstream_projector_checkpoint_age_seconds',
            'gauge',
            'Since the newest checkpoint of an owned shard was uploaded (or the shard was taken, before '
            'its first); the oldest over the owned shards.',
            'projector',
        ),
        Metric(
            'stepstream_runs',
            'gauge',
            f"Runs in this process's shards by status ({', '.join(RUN_STATUSES)}).",
            'projector',
            ('status',),
        ),
        Metric(
            'stepstream_effects_unresolved',
            'gauge',
            'Tool calls started and not ended: in_flight (run live) or unknown_after_crash (in doubt).',
            'projector',
            ('state',),
        ),
        Metric(
            'stepstream_effects_in_doubt_oldest_age_seconds',
            'gauge',
            'Since the oldest tool call in doubt (unknown_after_crash) started; 0 when there is none.',
            'projector',
        ),
        Metric(
            'stepstream_deferred_calls',
            'gauge',
            'Deferred tool calls waiting for a decision, by kind (approval, question, external).',
            'projector',
            ('kind',),
        ),
        Metric(
            'stepstream_deferred_oldest_age_seconds',
            'gauge',
            'Since the oldest deferred call still waiting was deferred; 0 when none waits.',
            'projector',
        ),
        # -- serve -----------------------------------------------------------------------------
        Metric(
            'stepstream_serve_requests',
            'counter',
            'Requests answered, by route template, method and status code.',
            'serve',
            ('route', 'method', 'code'),
        ),
        Metric(
            'stepstream_serve_request_seconds',
            'histogram',
            'Time to answer a request, by route template.',
            'serve',
            ('route',),
        ),
        # -- the writer, in the agent's process (OpenTelemetry instruments, as exported) ------------
        Metric(
            'stepstream_producer_records_appended',
            'counter',
            'Records given to the producer, by topic (step-events, tool-effects); a resend counts again.',
            'writer',
            ('stepstream_topic',),
        ),
        Metric(
            'stepstream_producer_ack_latency_seconds',
            'histogram',
            'From send to the acknowledgement (acks=all); its count is the acknowledgements.',
            'writer',
        ),
        Metric(
            'stepstream_producer_send_failures',
            'counter',
            'Durability points that failed: the broker did not acknowledge, by error type.',
            'writer',
            ('error_type',),
        ),
        Metric(
            'stepstream_media_offloads',
            'counter',
            'Payloads written to the media store instead of the log.',
            'writer',
        ),
        Metric(
            'stepstream_media_offloaded_bytes',
            'counter',
            'Bytes of the payloads written to the media store.',
            'writer',
        ),
    )
}


def process_registry() -> CollectorRegistry:
    """A registry of one process's metrics, with the client's process, platform and GC collectors."""
    registry = CollectorRegistry()
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    return registry


def counter(registry: CollectorRegistry, name: str) -> Counter:
    """The counter `name` of the catalogue, registered in `registry`."""
    spec = _spec(name, 'counter')
    return Counter(spec.name, spec.help, spec.labels, registry=registry)


def histogram(registry: CollectorRegistry, name: str) -> Histogram:
    """The histogram `name` of the catalogue, registered in `registry`."""
    spec = _spec(name, 'histogram')
    return Histogram(spec.name, spec.help, spec.labels, registry=registry, buckets=spec.buckets)


def counter_family(name: str, values: Mapping[tuple[str, ...], float]) -> CounterMetricFamily:
    """A scrape's counter `name` of the catalogue, one value per tuple of label values."""
    spec = _spec(name, 'counter')
    family = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    for labels, value in values.items():
        family.add_metric(list(labels), value)
    return family


def gauge(name: str, values: Mapping[tuple[str, ...], float] | float) -> GaugeMetricFamily:
    """A scrape's gauge `name` of the catalogue: one value, or one per tuple of label values."""
    spec = _spec(name, 'gauge')
    if not isinstance(values, Mapping):
        return GaugeMetricFamily(spec.name, spec.help, value=values)
    family = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
    for labels, value in values.items():
        family.add_metric(list(labels), value)
    return family


def _spec(name: str, kind: Kind) -> Metric:
    spec = CATALOGUE[name]
    if spec.kind != kind:
        raise TypeError(f'{name} is a {spec.kind}, not a {kind}')
    return spec


# -- probes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """A probe's answer: whether it passes, and why (the JSON body of `/healthz` and `/readyz`)."""

    ok: bool
    detail: dict[str, Any]


class Probes(Protocol):
    """What a process answers its probes with; both run on the process's event loop."""

    def healthy(self) -> Verdict:
        """Alive: False only when the process stopped working for good (an orchestrator restarts it)."""
        ...

    async def ready(self) -> Verdict:
        """Ready for traffic and in step with the log (an orchestrator routes to it)."""
        ...


PROBE_TIMEOUT_S = 5.0
"""A probe whose coroutine does not run on the loop within this long fails: the loop does not turn."""


def on_loop(
    loop: asyncio.AbstractEventLoop, make: Callable[[], Awaitable[Verdict]], timeout: float = PROBE_TIMEOUT_S
) -> Verdict:
    """Ask a probe on `loop` from another thread; a loop that does not run it in `timeout` fails it."""

    async def ask() -> Verdict:
        return await make()

    future = asyncio.run_coroutine_threadsafe(ask(), loop)
    try:
        return future.result(timeout)
    except FutureTimeout:
        future.cancel()
        return Verdict(False, {'error': f'the event loop did not turn within {timeout:g} s'})
    except Exception as exc:  # a probe that raises fails, with why
        return Verdict(False, {'error': repr(exc)})


async def probe_health(probes: Probes) -> Verdict:
    """`/healthz`: running at all proves the loop turns; then the process's own verdict."""
    return probes.healthy()


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: not logged
        pass


class ProbeServer:
    """`/metrics`, `/healthz` and `/readyz` on a port of their own, served from a thread.

    The scrape and the probes do not depend on the loop to be answered, only to pass: a loop
    that is stuck fails `/healthz` (and `/readyz`) with a reason instead of leaving the request
    hanging. `port=0` takes a free port (`url` says which).

    ```python
    server = ProbeServer(registry, probes, asyncio.get_running_loop(), port=9464).start()
    ...
    server.stop()
    ```
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        probes: Probes,
        loop: asyncio.AbstractEventLoop,
        *,
        host: str = '127.0.0.1',
        port: int = 0,
    ) -> None:
        """Bind `host:port` now (a taken port raises `OSError` here, before anything starts)."""
        self.registry, self.probes, self.loop = registry, probes, loop
        self._metrics = make_wsgi_app(registry)
        self._server = make_server(host, port, self._app, server_class=_Server, handler_class=_QuietHandler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name='stepstream-metrics', daemon=True
        )

    @property
    def url(self) -> str:
        """The base URL it listens at."""
        host, port = (str(part) for part in self._server.server_address[:2])
        shown = f'[{host}]' if ':' in host else host
        return f'http://{shown}:{port}'

    def start(self) -> ProbeServer:
        """Serve in a daemon thread; returns itself."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get('PATH_INFO', '')
        if path == '/healthz':
            verdict = on_loop(self.loop, lambda: probe_health(self.probes))
        elif path == '/readyz':
            verdict = on_loop(self.loop, self.probes.ready)
        elif path == '/metrics':
            return self._metrics(environ, start_response)
        else:
            start_response('404 Not Found', [('Content-Type', 'text/plain')])
            return [b'/metrics, /healthz or /readyz\n']
        body = json.dumps({'ok': verdict.ok, **verdict.detail}, default=str).encode()
        status = '200 OK' if verdict.ok else '503 Service Unavailable'
        start_response(status, [('Content-Type', 'application/json'), ('Content-Length', str(len(body)))])
        return [body]


__all__ = [
    'CATALOGUE',
    'Collector',
    'Metric',
    'ProbeServer',
    'Probes',
    'Verdict',
    'counter',
    'counter_family',
    'gauge',
    'histogram',
    'on_loop',
    'probe_health',
    'process_registry',
]
