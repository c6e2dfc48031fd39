"""A run's records form a hash chain (issue 37, item 1; decision 0048).

Generated runs (several steps, parallel tool calls, tools that fail and are retried, a run that
fails, large values offloaded, delegates writing their own runs) on the in-memory log: in seq
order across both topics, each record of a run carries the `chain_hash` of the run's record
before it and the first carries none; heartbeats carry none. Changing any byte of a record's
body, dropping a record or swapping two breaks the link after it.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_ai import Agent, ModelRetry
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream.media import DiskMediaStore
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.producer._memory import StoredRecord
from stepstream.schemas import StepEvent, chain_hash, decode

pytestmark = pytest.mark.fast


def chains(log: InMemoryLog) -> dict[str, list[StoredRecord]]:
    """Each run's records in seq order (both topics), heartbeats left out."""
    runs: dict[str, list[tuple[int, StoredRecord]]] = defaultdict(list)
    for stored in log.records:
        assert stored.value is not None
        record = decode(stored.value)
        if isinstance(record, StepEvent) and record.kind == 'run_heartbeat':
            assert record.prev_hash is None  # not the run's trail
            continue
        runs[record.run_id].append((record.seq, stored))
    return {run: [s for _, s in sorted(items, key=lambda item: item[0])] for run, items in runs.items()}


def broken_at(records: list[bytes]) -> int | None:
    """The index of the first record whose link is not the hash of the one before it, or None."""
    previous: bytes | None = None
    for index, value in enumerate(records):
        if decode(value).prev_hash != previous:
            return index
        previous = chain_hash(value)
    return None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.integers(1, 4),
    parallel=st.integers(1, 3),
    retried=st.booleans(),
    fails=st.booleans(),
    large=st.booleans(),
)
def test_every_run_is_a_chain_of_its_records(
    steps: int, parallel: int, retried: bool, fails: bool, large: bool
) -> None:
    log = InMemoryLog()
    attempts: dict[str, int] = defaultdict(int)

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = sum(isinstance(m, ModelResponse) for m in messages)
        if done < steps:
            return ModelResponse(
                parts=[ToolCallPart('work', {'n': i}, f'call-{done}-{i}') for i in range(parallel)]
            )
        if fails:
            raise RuntimeError('the model gave up')
        return ModelResponse(parts=[TextPart('done')])

    with tempfile.TemporaryDirectory() as root:
        capability = StepPersistence(
            log=log, agent_name='chained', media_store=DiskMediaStore(Path(root)), media_threshold_bytes=2048
        )
        agent = Agent(FunctionModel(model), capabilities=[capability])
        helper = Agent(
            FunctionModel(lambda m, i: ModelResponse(parts=[TextPart('ok')])), capabilities=[capability]
        )

        @agent.tool_plain(retries=2)
        async def work(n: int) -> Any:
            attempts[f'{n}'] += 1
            if retried and attempts[f'{n}'] == 1:
                raise ModelRetry('once more')
            await helper.run(f'help {n}')  # a delegate: a run of its own, chained on its own
            attempts['helped'] += 1
            return 'x' * 5000 if large else n

        async def run() -> None:
            try:
                await agent.run('go', conversation_id='conv-chain')
            except RuntimeError:
                assert fails

        asyncio.run(run())

    runs = chains(log)
    assert len(runs) == 1 + attempts['helped']  # the run and its delegates
    for run_id, stored in runs.items():
        values = [s.value for s in stored if s.value is not None]
        assert [decode(v).seq for v in values] == list(range(len(values))), run_id  # no gap
        assert broken_at(values) is None, run_id
        assert decode(values[0]).prev_hash is None


def test_a_changed_byte_a_dropped_or_swapped_record_breaks_the_chain_after_it() -> None:
    log = InMemoryLog()
    agent = Agent(
        FunctionModel(
            lambda m, i: (
                ModelResponse(parts=[ToolCallPart('work', {}, 'c1')])
                if len(m) == 1
                else ModelResponse(parts=[TextPart('done')])
            )
        ),
        capabilities=[StepPersistence(log=log)],
    )

    @agent.tool_plain
    def work() -> str:
        return 'worked'

    asyncio.run(agent.run('go'))
    (values,) = [[s.value for s in stored if s.value is not None] for stored in chains(log).values()]
    assert len(values) > 5 and broken_at(values) is None
    altered = bytearray(values[3])
    altered[12] ^= 1  # a byte of the body (of its run id), not of its own link
    assert broken_at([*values[:3], bytes(altered), *values[4:]]) == 4
    assert broken_at([*values[:3], *values[4:]]) == 3
    assert broken_at([*values[:3], values[4], values[3], *values[5:]]) == 3
