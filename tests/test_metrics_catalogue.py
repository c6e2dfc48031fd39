"""The metric catalogue, the lag clock and the probes' loop check, without a broker."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepstream.metrics import CATALOGUE, Verdict, on_loop
from stepstream.projector._metrics import LAG_SAMPLES, LagClock

pytestmark = [pytest.mark.fast, pytest.mark.once]

DOCS = Path(__file__).resolve().parent.parent / 'docs' / 'operations.md'


def test_every_metric_is_named_by_prometheus_conventions_and_documented() -> None:
    text = DOCS.read_text()
    for name, metric in CATALOGUE.items():
        assert re.fullmatch(r'stepstream_[a-z][a-z0-9_]*[a-z0-9]', name), name
        assert not name.endswith('_total'), f'{name}: the client adds _total to a counter'
        if 'seconds' in name or 'bytes' in name:
            assert name.endswith(('_seconds', '_bytes')), f'{name}: the unit goes last'
        assert 'run_id' not in metric.labels and 'run' not in metric.labels, f'{name}: unbounded label'
        assert metric.help.endswith(('.', ')')), name
        shown = metric.samples[0] if metric.kind == 'counter' else name
        assert f'`{shown}`' in text, f'docs/operations.md does not list {shown}'


@given(
    st.lists(st.tuples(st.floats(0.001, 5.0), st.integers(0, 20)), min_size=1, max_size=400),
    st.data(),
)
def test_the_lag_clock_is_a_lower_bound_exact_to_its_samples(
    steps: list[tuple[float, int]], data: st.DataObject
) -> None:
    """Records arrive over time; the end is sampled now and then; seconds behind never overstates.

    Each step: some time passes, `n` records arrive at that instant, and the end may be sampled.
    """
    clock, now, end = LagClock(), 0.0, 0
    arrived: list[float] = []  # offset -> when it arrived
    samples: list[tuple[int, float]] = []
    for gap, n in steps:
        now += gap
        arrived += [now] * n
        end += n
        if data.draw(st.booleans()):
            clock.seen(end, now)
            samples.append((end, now))
    later = now + data.draw(st.floats(0.0, 10.0))
    applied = data.draw(st.integers(0, end))
    behind = clock.seconds_behind(applied, later)
    if applied == end or not any(e > applied for e, _ in samples):
        assert behind == 0.0
        return
    truth = later - arrived[applied]
    assert behind <= truth + 1e-9  # a lower bound: the record may have arrived before the sample
    first_seen = next(t for e, t in samples if e > applied)
    if len(samples) <= LAG_SAMPLES:
        assert behind == pytest.approx(later - first_seen)  # exact to the samples kept
    else:
        assert behind >= later - first_seen - 1e-9 or behind <= truth


def test_a_probe_fails_when_the_loop_does_not_turn() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:

        async def fine() -> Verdict:
            return Verdict(True, {})

        assert on_loop(loop, fine).ok
        blocked = threading.Event()
        loop.call_soon_threadsafe(lambda: (blocked.set(), time.sleep(1.5)))
        blocked.wait()
        stuck = on_loop(loop, fine, timeout=0.5)
        assert not stuck.ok and 'did not turn' in stuck.detail['error']

        async def broken() -> Verdict:
            raise RuntimeError('the reader is closed')

        failed = on_loop(loop, broken)
        assert not failed.ok and 'the reader is closed' in failed.detail['error']
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
