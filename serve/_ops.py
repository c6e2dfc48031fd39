"""`/metrics`, `/healthz` and `/readyz` of `stepstream serve` (docs/operations.md).

Open without the bearer token, like the explorer's login page: they hold counts and verdicts,
never a run's content or id. A service that is a group member (`serve --group`) answers with its
projector's registry and probes (`ProjectorObserver`); a reader alone is ready while every shard
of the projection can be read here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from stepstream import metrics
from stepstream.metrics import Probes, Verdict, probe_health
from stepstream.readmodel import ProjectionReader

OPS_PATHS = ('/metrics', '/healthz', '/readyz')

router = APIRouter(include_in_schema=False)


class ReaderProbes:
    """A reader alone: alive while its loop answers; ready while every shard is readable here."""

    def __init__(self, reader: ProjectionReader) -> None:
        """Probe the projection `reader` reads."""
        self.reader = reader

    def healthy(self) -> Verdict:
        """Answering at all is the proof: the route runs on the service's loop."""
        return Verdict(True, {})

    async def ready(self) -> Verdict:
        """Every shard of the projection is readable (none missing, a projection made)."""
        status = await self.reader.status()
        detail = {'shards': status.shards, 'missing': status.missing_shards, 'state': status.state}
        if status.state is None or not status.shards:
            return Verdict(False, {**detail, 'error': 'no projection here yet'})
        if status.missing_shards:
            return Verdict(False, {**detail, 'error': 'shards missing (moving, or not made yet)'})
        return Verdict(True, detail)


class Instruments:
    """The service's registry: its request counter and latency, and the process collectors."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """Add to `registry` (a member's projector registry), or make one."""
        self.registry = registry if registry is not None else metrics.process_registry()
        self._requests = metrics.counter(self.registry, 'stepstream_serve_requests')
        self._seconds = metrics.histogram(self.registry, 'stepstream_serve_request_seconds')

    async def observe(self, request: Request, answer: Callable[[], Awaitable[Response]]) -> Response:
        """Answer `request` and count it under its route's template (never its path: no run ids)."""
        started = time.perf_counter()
        response = await answer()
        route = getattr(request.scope.get('route'), 'path', None) or 'unmatched'
        self._requests.labels(route, request.method, str(response.status_code)).inc()
        self._seconds.labels(route).observe(time.perf_counter() - started)
        return response


def _verdict(verdict: Verdict) -> JSONResponse:
    return JSONResponse({'ok': verdict.ok, **verdict.detail}, status_code=200 if verdict.ok else 503)


@router.get('/metrics')
async def scrape(request: Request) -> Response:
    """The Prometheus text format (collected in a thread: a member's gauges are read on this loop)."""
    instruments: Instruments = request.app.state.instruments
    body = await asyncio.to_thread(generate_latest, instruments.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get('/healthz')
async def healthz(request: Request) -> JSONResponse:
    """200 while the service's loop turns (this runs on it) and its projector, if any, has not failed."""
    probes: Probes = request.app.state.probes
    return _verdict(await probe_health(probes))


@router.get('/readyz')
async def readyz(request: Request) -> JSONResponse:
    """200 while the service can answer for its shards (a member: holds them and is within its lag)."""
    probes: Probes = request.app.state.probes
    return _verdict(await probes.ready())
