"""What registry mode (issue 26) costs per record, and what it adds to the default path.

`python -m bench.wire_format` prints the best of 15 timeit repeats, taken interleaved so that the
machine's noise falls on every row alike:

- the default path: `encode_record` (id rules, single-object encoding, size check), which registry
  mode leaves as it was (`schemas/_codec.py`, `_writer.py` and `producer/_protocol.py` are unchanged);
- registry mode on the producer: the same, then reframed with a cached schema id (`to_confluent`),
  which `EventLog` does as it hands the record to the producer;
- the projector, per record of a 500-record batch: the scan the default path now pays
  (`WireFormats.read` over single-object records: nothing to resolve), and turning Confluent
  records back into single-object form with their schema versions cached.
"""

from __future__ import annotations

import asyncio
import timeit
from datetime import UTC, datetime
from typing import Any

from stepstream import Settings
from stepstream.producer._protocol import MAX_RECORD_BYTES, encode_record
from stepstream.projector._apply import EVENTS, SourceRecord
from stepstream.projector._wire import WireFormats
from stepstream.schemas import STEP_EVENT_SCHEMA, StepEvent, to_confluent

BATCH = 500


def main() -> None:
    """Print each operation's time in nanoseconds (per record)."""
    event = StepEvent(
        run_id='bench-0194f0c2-1111-7000-8000-000000000000',
        seq=12,
        writer_id='0123456789abcdef',
        timestamp=datetime.now(UTC),
        agent_name='bench',
        conversation_id='conv-1',
        kind='model_request_completed',
        step_index=3,
        idempotency_key='12:3:model_request_completed:',
        duration_us=123_456,
    )
    plain = encode_record(event, MAX_RECORD_BYTES)
    framed = to_confluent(plain, 7)
    # A registry that is never asked: the id's version is cached, as after the first record.
    wire = WireFormats(Settings(schema_registry_url='http://127.0.0.1:9'))
    assert wire.registry is not None
    wire.registry._versions[7] = STEP_EVENT_SCHEMA
    default_batch = [SourceRecord(EVENTS, 0, i, b'k', plain) for i in range(BATCH)]
    confluent_batch = [SourceRecord(EVENTS, 0, i, b'k', framed) for i in range(BATCH)]
    loop = asyncio.new_event_loop()

    def read(batch: list[SourceRecord]) -> Any:
        return loop.run_until_complete(wire.read(batch, lambda: False))

    assert [r.value for r in read(confluent_batch)] == [plain] * BATCH
    rows: dict[str, tuple[Any, int, int]] = {
        'encode_record (default, unchanged)': (lambda: encode_record(event, MAX_RECORD_BYTES), 20_000, 1),
        'encode_record + to_confluent (registry mode)': (
            lambda: to_confluent(encode_record(event, MAX_RECORD_BYTES), 7),
            20_000,
            1,
        ),
        'projector: scan of single-object records (default)': (lambda: read(default_batch), 200, BATCH),
        'projector: Confluent -> single-object, ids cached': (lambda: read(confluent_batch), 200, BATCH),
    }
    best = {name: float('inf') for name in rows}
    for _ in range(15):
        for name, (fn, number, per) in rows.items():
            best[name] = min(best[name], timeit.timeit(fn, number=number) / number / per * 1e9)
    loop.run_until_complete(wire.close())
    loop.close()
    print(f'record: {len(plain)} B single-object, {len(framed)} B Confluent')
    for name, ns in best.items():
        print(f'{name:<55} {ns:>8.0f} ns')


if __name__ == '__main__':
    main()
