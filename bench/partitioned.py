"""Workload 7: the partitioned projection: rebuild in 1 and 2 processes, one member against two,
and failover time from a member's SIGKILL to its partitions being served again.

    python -m bench --only partitioned          # as `make bench` runs it
    BENCH_QUICK=1 python -m bench --only partitioned

The log is filled as workload 3 fills it (pre-encoded records, `synthetic.many_runs`). Members
are `stepstream projector --group` processes; their CPU time is read from /proc when they stop.
Failover is timed from the SIGKILL to the line in which another member says it owns the dead
member's partitions (after restoring a checkpoint, or after replaying the partition from offset
zero when there is none) and then to that partition's shard being caught up.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Scale, fresh, say
from bench.projector_throughput import fill
from stepstream import Settings
from stepstream.projector import rebuild
from stepstream.readmodel import ProjectionReader
from stepstream.topics import Position

CLOCK_TICKS = os.sysconf('SC_CLK_TCK')


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a live process, from /proc."""
    fields = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class _Member:
    """One `stepstream projector --group` process and the partitions it says it owns."""

    def __init__(self, settings: Settings, group: str, db_path: Path, checkpoint_interval: float) -> None:
        self.settings, self.group, self.db_path = settings, group, db_path
        self.checkpoint_interval = checkpoint_interval
        self.owned: list[int] = []
        self.changed = asyncio.Event()
        self.process: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        env = {**os.environ, **self.settings.replace(db_path=str(self.db_path)).to_env()}
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, '-m', 'stepstream.cli', 'projector', '--group', self.group,
            '--checkpoint-interval', str(self.checkpoint_interval), '--session-timeout', '6',
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors='replace')
            if line.startswith('projector: owns partitions '):
                self.owned = [
                    int(p) for p in line.split('[', 1)[1].strip().rstrip(']').split(',') if p.strip()
                ]
                self.changed.set()

    def cpu(self) -> float:
        assert self.process is not None
        return _cpu_seconds(self.process.pid)

    async def end(self, sig: int = signal.SIGTERM) -> None:
        assert self.process is not None
        self.process.send_signal(sig)
        await self.process.wait()
        if self._task is not None:
            await self._task


async def _until(condition: Any, timeout: float = 600.0) -> float:
    """Wait for `condition()` (a bool, or an awaitable of one) to hold; returns the seconds waited."""
    t0 = time.perf_counter()
    while not await _holds(condition):
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError('the benchmark waited too long')
        await asyncio.sleep(0.02)
    return time.perf_counter() - t0


async def _holds(condition: Any) -> bool:
    result = condition()
    return bool(await result) if inspect.isawaitable(result) else bool(result)


def _applied(path: Path) -> dict[tuple[str, int], int]:
    try:
        reader = ProjectionReader.open(path)
    except Exception:  # no shard yet
        return {}
    try:
        status = asyncio.run(reader.status())
    finally:
        reader.close()
    return dict(status.offsets)


def _reached(applied: dict[Any, int], position: Position) -> bool:
    return all(applied.get((tp.topic, tp.partition), 0) >= offset for tp, offset in position.items())


async def members(settings: Settings, count: int, position: Position, workdir: Path) -> dict[str, Any]:
    """`count` members in one directory apply the whole log; wall time and CPU per member."""
    group = f'{settings.topics.topic_prefix}.m{count}'
    path = Path(tempfile.mkdtemp(prefix=f'members{count}-', dir=workdir))
    crew = [_Member(settings, group, path, 0) for _ in range(count)]
    for member in crew:
        await member.start()
    # Timed from the moment the group has settled (every partition owned, each member with a
    # share), so process start and group joins are not counted; records applied before it are.
    partitions = sorted({tp.partition for tp in position})
    await _until(
        lambda: sorted(p for m in crew for p in m.owned) == partitions and all(m.owned for m in crew)
    )
    t0 = time.perf_counter()
    cpu0 = [m.cpu() for m in crew]
    before = sum((await asyncio.to_thread(_applied, path)).values())
    while True:
        applied = await asyncio.to_thread(_applied, path)
        if _reached(applied, position):
            elapsed = time.perf_counter() - t0
            cpu = [m.cpu() - c for m, c in zip(crew, cpu0, strict=True)]
            break
        await asyncio.sleep(0.05)
    total = sum(position.values()) - before
    for member in crew:
        await member.end()
    return {
        'members': count, 'records': total, 'seconds': elapsed, 'records_per_s': total / elapsed,
        'cpu_seconds': cpu,
    }  # fmt: skip


async def failover(
    settings: Settings, position: Position, trials: int, checkpoints: bool, workdir: Path
) -> dict[str, Any]:
    """Kill one of two members (each with its own directory) and time until its partitions are
    owned again (and caught up)."""
    group = f'{settings.topics.topic_prefix}.f{int(checkpoints)}'
    interval = 1.0 if checkpoints else 0.0
    owned_again, caught_up = [], []
    host = 0

    def new_member() -> _Member:
        nonlocal host
        host += 1
        return _Member(settings, group, workdir / f'{group}-{host}', interval)

    crew = [new_member(), new_member()]
    for member in crew:
        await member.start()
    await _until(lambda: sorted(p for m in crew for p in m.owned) == list(range(settings.topics.partitions)))
    if checkpoints:  # let every shard be checkpointed once
        await asyncio.sleep(interval * 4)
    for _ in range(trials):
        victim, survivor = crew[0], crew[1]
        lost = list(victim.owned)
        t0 = time.perf_counter()
        await victim.end(signal.SIGKILL)
        await _until(lambda lost=lost, s=survivor: set(lost) <= set(s.owned))
        owned_again.append(time.perf_counter() - t0)
        # Caught up: the survivor's shards reach the end of the log.
        wanted = {tp: offset for tp, offset in position.items() if tp.partition in lost}
        await _until(lambda s=survivor, w=wanted: _caught_up(s.db_path, w))
        caught_up.append(time.perf_counter() - t0)
        replacement = new_member()
        await replacement.start()
        crew = [survivor, replacement]
        await _until(lambda r=replacement, s=survivor: bool(r.owned) and bool(s.owned))
        if checkpoints:
            await asyncio.sleep(interval * 4)
    for member in crew:
        await member.end()
    return {
        'checkpoints': checkpoints,
        'trials': trials,
        'owned_again_s': _percentiles(owned_again),
        'caught_up_s': _percentiles(caught_up),
    }


async def _caught_up(path: Path, position: Position) -> bool:
    return _reached(await asyncio.to_thread(_applied, path), position)


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {'p50': statistics.median(ordered), 'p99': p99, 'max': ordered[-1]}


async def run(settings: Settings, scale: Scale, workdir: Path) -> dict[str, Any]:
    run_settings = fresh(settings, 'w7')
    say(f'  filling the log with {scale.rebuild_records:,} records ...')
    _, position, filled = await fill(run_settings, scale.rebuild_records)
    out: dict[str, Any] = {'fill': filled, 'rebuild': []}
    for jobs in (1, 2):
        into = Path(tempfile.mkdtemp(prefix=f'jobs{jobs}-', dir=workdir)) / 'projection'
        t0 = time.perf_counter()
        await rebuild(run_settings, into, jobs=jobs)
        elapsed = time.perf_counter() - t0
        out['rebuild'].append({'jobs': jobs, 'records': filled['records'], 'seconds': elapsed})
        say(f'  rebuild --jobs {jobs}      {filled["records"]:,} records in {elapsed:.1f}s')
    out['members'] = []
    for count in (1, 2):
        result = await members(run_settings, count, position, workdir)
        out['members'].append(result)
        cpu = ', '.join(f'{c:.1f}' for c in result['cpu_seconds'])
        rate = result['records_per_s']
        say(f'  {count} member(s)          {rate:10,.0f} records/s, CPU s per member: {cpu}')
    trials = 3 if scale.quick else 8
    small = fresh(settings, 'w7f')
    _, small_end, _ = await fill(small, 20_000)
    out['failover'] = []
    for checkpoints in (False, True):
        result = await failover(small, small_end, trials, checkpoints, workdir)
        out['failover'].append(result)
        say(
            f'  failover ({"with" if checkpoints else "no"} checkpoint)  owned again p50 '
            f'{result["owned_again_s"]["p50"]:.1f}s p99 {result["owned_again_s"]["p99"]:.1f}s; '
            f'caught up p50 {result["caught_up_s"]["p50"]:.1f}s p99 {result["caught_up_s"]["p99"]:.1f}s'
        )
    return out
