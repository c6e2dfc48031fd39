"""Reading a long run's snapshots costs what its deltas cost: list_snapshots vs list_events.

    .venv/bin/python -m bench.snapshot_reads [STEPS]

Builds one run of STEPS tool steps (a snapshot per step, each delta adding a tool call and its
return) straight into a projection through the projector's apply rules, then times
`list_events` and `list_snapshots` of that run and reports the peak RSS growth of each.
"""

from __future__ import annotations

import asyncio
import resource
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta

from pydantic_ai.messages import (
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from stepstream.projector._apply import EVENTS, Applier, SourceRecord
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import SnapshotDelta, StepEvent, encode
from stepstream.storage import Shard
from stepstream.topics import murmur2_partition

RUN = 'long-run'
T0 = datetime(2026, 11, 30, tzinfo=UTC)


def records(steps: int) -> list[SourceRecord]:
    partition = murmur2_partition(RUN.encode(), 1)
    out = []
    seq = 0

    def add(kind: str, snapshot: SnapshotDelta | None = None) -> None:
        nonlocal seq
        event = StepEvent(
            run_id=RUN,
            seq=seq,
            writer_id='w',
            timestamp=T0 + timedelta(milliseconds=seq),
            kind=kind,  # type: ignore[arg-type]
            step_index=seq,
            snapshot=snapshot,
        )
        out.append(SourceRecord(EVENTS, partition, seq, RUN.encode(), encode(event)))
        seq += 1

    add('run_started')
    history_len = 0
    for step in range(steps):
        tail = [ModelRequest(parts=[UserPromptPart('go')])] if step == 0 else []
        tail += [
            ModelResponse(parts=[ToolCallPart('work', {'n': step}, tool_call_id=f'c{step}')]),
            ModelRequest(parts=[ToolReturnPart('work', f'result {step} ' * 20, tool_call_id=f'c{step}')]),
        ]
        add('model_request_started')
        add('model_request_completed')
        add(
            'snapshot_saved',
            SnapshotDelta(
                snapshot_seq=step,
                state='complete',
                prefix_len=history_len,
                messages=ModelMessagesTypeAdapter.dump_json(tail).decode(),
            ),
        )
        history_len += len(tail)
    add('run_completed')
    return out


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main(steps: int) -> None:
    with tempfile.TemporaryDirectory() as path:
        db = Shard.open(path, create=True)
        txn, _ = Applier(('e', 'x'), partitions=1).stage(db, records(steps))
        txn.commit()
        reader = ProjectionReader(db)
        base = rss_mb()
        start = time.perf_counter()
        events = await reader.list_events(RUN)
        events_s = time.perf_counter() - start
        after_events = rss_mb()
        start = time.perf_counter()
        snapshots = await reader.list_snapshots(RUN)
        snapshots_s = time.perf_counter() - start
        after_snapshots = rss_mb()
        start = time.perf_counter()
        page = await reader.list_snapshots(RUN, after=steps - 51, limit=50)
        page_s = time.perf_counter() - start
        db.close()
    print(f'{steps} steps: {len(events)} events in {events_s:.2f} s (peak RSS +{after_events - base:.0f} MB)')
    print(
        f'{len(snapshots)} snapshots ({len(snapshots[-1].messages)} messages in the last) '
        f'in {snapshots_s:.2f} s '
        f'(peak RSS +{after_snapshots - after_events:.0f} MB)'
    )
    print(f'last page of {len(page)} snapshots in {page_s:.2f} s')


if __name__ == '__main__':
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
