"""Every record a deterministic run stores, before and after a change: the same bytes, or where not.

```sh
git worktree add /tmp/before <commit>
.venv/bin/python -m bench.same_bytes /tmp/before      # exits 1 at the first record that differs
```

A change to the write path's cost (record building, the codec, the headers, the in-memory log)
must not change what is written. This runs the same agent runs on an `InMemoryLog` in one process
per tree (`before` imports `stepstream` from the given checkout, laid out as installed, as
`bench.interleave` does; `after` from this tree), with every source of variation fixed: Pydantic
AI's clock and run ids, the capability's clock and timers, and a tracer whose trace and span ids
count up, so that `traceparent` headers and trace fields are written too. It compares every
stored record's topic, partition, offset, key, value and headers.

The runs: workload 1 (`bench.workload`, 30 steps) with metadata and a conversation id, inside a
span; the same with `capture_frontier=True`; a run whose tool fails and whose retry succeeds;
a run whose tool call is refused by the model's retry limit (`run_failed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.interleave import HERE, installed_layout

STEPS = 30


def _fix_clocks() -> None:
    """Make Pydantic AI's and the capability's clocks and ids count up from fixed values."""
    import pydantic_ai._utils as utils
    import pydantic_ai._uuid as uuids

    # The writer's modules whose clocks go into records (the capability, the run, its calls and ends);
    # not the log's timers, whose readings depend on the event loop.
    recording = ('_capability', '_run', '_calls', '_ends')
    clocked = []
    for name in recording:  # a tree before one of them existed has the others
        with contextlib.suppress(ModuleNotFoundError):
            clocked.append(importlib.import_module(f'stepstream.producer.{name}'))

    ticks = itertools.count()
    start = datetime(2026, 1, 1, tzinfo=UTC)

    def now() -> datetime:
        return start + timedelta(milliseconds=next(ticks))

    # Replace the code of the functions themselves: dataclass default factories hold them.
    utils.__dict__['_stepstream_now'] = now
    utils.now_utc.__code__ = (lambda: _stepstream_now()).__code__  # type: ignore[name-defined]  # noqa: F821
    ids = itertools.count(1)
    import uuid

    uuids.__dict__['_stepstream_uuid'] = lambda: uuid.UUID(int=next(ids))
    uuids.uuid7.__code__ = (lambda: _stepstream_uuid()).__code__  # type: ignore[name-defined]  # noqa: F821

    class FixedDatetime(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> FixedDatetime:  # type: ignore[override]
            return now()  # type: ignore[return-value]

    nanos = itertools.count(0, 1_234_567)
    fake_time = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time)})
    fake_time.perf_counter_ns = lambda: next(nanos)
    fake_time.monotonic = lambda: next(nanos) / 1e9
    for module in clocked:  # one clock for all of them, read in the order the run reads it
        if getattr(module, 'datetime', None) is datetime:
            module.datetime = FixedDatetime
        if getattr(module, 'time', None) is time:
            module.time = fake_time


def _tracer() -> Any:
    """A tracer whose ids count up (the SDK's, with a deterministic id generator)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class Counting(IdGenerator):
        def __init__(self) -> None:
            self.next = itertools.count(1)

        def generate_span_id(self) -> int:
            return next(self.next)

        def generate_trace_id(self) -> int:
            return 0xABC0000 + next(self.next)

    return TracerProvider(id_generator=Counting()).get_tracer('bench.same_bytes')


async def child() -> None:
    """Run the deterministic runs and print one digest line per stored record."""
    _fix_clocks()
    from pydantic_ai import Agent, ModelRetry
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel
    from pydantic_ai.usage import RequestUsage

    from bench.workload import StepClock, build_agent
    from stepstream.media import DiskMediaStore
    from stepstream.producer import InMemoryLog, StepPersistence

    log = InMemoryLog()
    tracer = _tracer()
    with tempfile.TemporaryDirectory() as media:
        store = DiskMediaStore(media)

        def persistence(**options: Any) -> StepPersistence[None]:
            return StepPersistence(log=log, agent_name='same-bytes', media_store=store, **options)

        with tracer.start_as_current_span('outer'):
            agent = build_agent(STEPS, StepClock(), [persistence(metadata={'tenant': 't1'})])
            await agent.run('Look up the archive records one by one.', conversation_id='conv-1')
        agent = build_agent(STEPS // 3, StepClock(), [persistence(capture_frontier=True)])
        await agent.run('Look up the archive records one by one.')

        async def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            done = (len(messages) - 1) // 2
            if done < 3:
                return ModelResponse(
                    parts=[ToolCallPart('flaky', {'n': done}, tool_call_id=f'c{done}')],
                    usage=RequestUsage(input_tokens=10, output_tokens=2),
                )
            return ModelResponse(
                parts=[TextPart('done')], usage=RequestUsage(input_tokens=10, output_tokens=2)
            )

        flaky: Agent[None, str] = Agent(FunctionModel(respond), capabilities=[persistence()], retries=1)

        @flaky.tool_plain(name='flaky')
        def flaky_tool(n: int) -> str:
            """Fails on its first call."""
            if n == 0:
                raise ModelRetry('try again')
            return f'ok {n}'

        await flaky.run('go')

        def broken(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            raise RuntimeError('the model is down')

        failing: Agent[None, str] = Agent(FunctionModel(broken), capabilities=[persistence()])
        with contextlib.suppress(RuntimeError):
            await failing.run('go')
    for stored in log.records:
        digest = hashlib.sha256(stored.value).hexdigest()
        print(
            json.dumps(
                [
                    stored.topic,
                    stored.partition,
                    stored.offset,
                    stored.key.decode(),
                    digest,
                    stored.headers and [[k, v.decode()] for k, v in stored.headers],
                ]
            ),
            flush=True,
        )


def records(tree: Path) -> list[str]:
    """The digest lines of one tree's process."""
    env = {**os.environ, 'PYTHONPATH': f'{installed_layout(tree)}{os.pathsep}{HERE}', 'PYTHONHASHSEED': '0'}
    with tempfile.TemporaryDirectory() as empty:  # not a checkout: its folders would shadow the layout
        done = subprocess.run(
            [sys.executable, '-m', 'bench.same_bytes', '--child'],
            cwd=empty,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
    return done.stdout.splitlines()


def main() -> None:
    """Compare the records of the given checkout (before) with this tree's (after)."""
    if sys.argv[1:2] == ['--child']:
        asyncio.run(child())
        return
    if len(sys.argv) != 2:
        raise SystemExit('usage: python -m bench.same_bytes <checkout of the before commit>')
    before, after = records(Path(sys.argv[1]).resolve()), records(HERE)
    for index, (old, new) in enumerate(zip(before, after, strict=False)):
        if old != new:
            print(f'record {index} differs:\n  before {old}\n  after  {new}')
            raise SystemExit(1)
    if len(before) != len(after):
        print(f'before stored {len(before)} records, after {len(after)}')
        raise SystemExit(1)
    traced = sum('traceparent' in line for line in after)
    print(
        f'the same {len(after)} records (topic, partition, offset, key, value, headers; '
        f'{traced} with traceparent)'
    )


if __name__ == '__main__':
    main()
