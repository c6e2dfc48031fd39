"""`AppliedPosition` (what `Projector.wait_for` waits on) and `ApplyMetrics.rate`, without a broker.

The same waits are proven end to end on the broker by every test that reads its writes
(tests/test_projector.py, test_e2e.py); these pin the rules a live projector relies on.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.structs import TopicPartition

from stepstream.errors import StepStreamError
from stepstream.projector._metrics import RATE_WINDOW_S, ApplyMetrics
from stepstream.projector._progress import AppliedPosition

pytestmark = pytest.mark.fast

A, B = TopicPartition('events', 0), TopicPartition('effects', 0)


async def test_a_waiter_wakes_only_once_every_partition_of_its_position_is_applied() -> None:
    applied = AppliedPosition()
    waiter = asyncio.create_task(applied.wait_for({A: 5, B: 2}, timeout=30))
    await applied.advance({A: 5})
    await asyncio.sleep(0)  # a turn of the loop: the waiter would have run if woken
    assert not waiter.done()
    await applied.advance({B: 2})
    await asyncio.wait_for(waiter, 5)
    assert applied.position == {A: 5, B: 2}
    await applied.wait_for({A: 3}, timeout=0)  # reached already: returns without waiting


async def test_waiters_for_different_positions_wake_in_the_order_applied() -> None:
    applied = AppliedPosition()
    woken: list[int] = []

    async def wait(offset: int) -> None:
        await applied.wait_for({A: offset}, timeout=30)
        woken.append(offset)

    waiters = [asyncio.create_task(wait(offset)) for offset in (3, 1, 2)]
    for offset in (1, 2, 3):
        await applied.advance({A: offset})
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert woken == list(range(1, offset + 1))
    await asyncio.gather(*waiters)


async def test_a_timeout_names_what_lags_and_leaves_no_waiter_behind() -> None:
    applied = AppliedPosition()
    await applied.advance({A: 4})
    with pytest.raises(TimeoutError, match=r'events\[0\]\': \(4, 9\)'):
        await applied.wait_for({A: 9}, timeout=0.01)
    assert applied._waiters == []


async def test_a_cancelled_waiter_is_forgotten_and_the_others_still_wake() -> None:
    applied = AppliedPosition()
    cancelled = asyncio.create_task(applied.wait_for({A: 1}, timeout=30))
    kept = asyncio.create_task(applied.wait_for({A: 1}, timeout=30))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await applied.advance({A: 1})
    await asyncio.wait_for(kept, 5)
    assert applied._waiters == []


async def test_a_failure_wakes_every_waiter_with_it_unless_its_position_was_reached() -> None:
    applied = AppliedPosition()
    await applied.advance({A: 2})
    waiter = asyncio.create_task(applied.wait_for({A: 3}, timeout=30))
    await asyncio.sleep(0)
    await applied.fail(RuntimeError('disk full'))
    with pytest.raises(StepStreamError, match='disk full'):
        await asyncio.wait_for(waiter, 5)
    with pytest.raises(StepStreamError, match='disk full'):
        await applied.wait_for({A: 3}, timeout=30)  # after the failure: at once, not after 30 s
    await applied.wait_for({A: 2}, timeout=30)  # applied before the failure: still readable


def test_the_rate_counts_the_batches_of_the_last_window(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics, clock = ApplyMetrics(), [1000.0]
    monkeypatch.setattr('stepstream.projector._metrics.time.monotonic', lambda: clock[0])
    assert metrics.rate(0, 10)['rate'] == 10.0  # within the first second: per second at least
    clock[0] += 4
    assert metrics.rate(0, 30)['rate'] == 10.0  # 40 records over 4 s
    assert metrics.rate(1, 7)['rate'] == 7.0  # each partition its own
    clock[0] += RATE_WINDOW_S - 2
    assert metrics.rate(0, 20)['rate'] == round(50 / (RATE_WINDOW_S - 2), 1)  # the first left the window
    metrics.forget(0)
    assert metrics.rate(0, 5)['rate'] == 5.0
