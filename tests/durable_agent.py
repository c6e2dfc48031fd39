"""The persisted agent every durable-execution child process runs (DBOS, Temporal, Prefect).

One scenario for all engines: a model that calls the tool `step` twice, then answers. Flags (read
from the child's command line) choose where the child stops, so that the parent can SIGKILL it
there and let the engine recover the run in a new process:

- `--hang`: the second tool call (`call-1`) prints `in-tool call-1` and never returns;
- `--hang-write`: the durable write of the first snapshot prints `in-write` once the records
  before it in the same write are acknowledged by the broker, and never returns;
- `--big`: the prompt carries a 1 MB image and each tool returns 200 KB of text.

The tool's side effect appends one line per call to EFFECTS_FILE (through the engine's own
step, activity or task), so the file shows how many times each effect really happened.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import BinaryContent, UserContent

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.producer._protocol import Ack
from stepstream.schemas import LogRecord, StepEvent

from agents import calls_then_answers

FLAGS = set(sys.argv[1:])
HANG_TOOL = '--hang' in FLAGS
HANG_WRITE = '--hang-write' in FLAGS
BIG = '--big' in FLAGS

IMAGE_BYTES = 1_000_000
TOOL_OUTPUT_CHARS = 200_000


@functools.cache
def image() -> bytes:
    """1 MB of bytes that do not repeat: a PNG signature, then SHAKE-256 output."""
    signature = b'\x89PNG\r\n\x1a\n'
    return signature + hashlib.shake_256(b'stepstream').digest(IMAGE_BYTES - len(signature))


def prompt() -> str | Sequence[UserContent]:
    """What the run is asked: with `--big`, with a 1 MB image."""
    if BIG:
        return ['go', BinaryContent(image(), media_type='image/png')]
    return 'go'


def tool_output(call_id: str) -> str:
    """What the tool returns: with `--big`, 200 KB of text."""
    done = f'{call_id} done'
    return done + '.' * (TOOL_OUTPUT_CHARS - len(done)) if BIG else done


async def effect(effects: Path, call_id: str) -> str:
    """The side effect: one line in `effects`; with `--hang`, call-1 stops here first."""
    if HANG_TOOL and call_id == 'call-1':
        print('in-tool call-1', flush=True)
        await asyncio.Event().wait()  # SIGKILLed here, in the middle of the side effect
    with effects.open('a') as file:
        file.write(f'{call_id}\n')
    return tool_output(call_id)


class HangsInWrite(EventLog):
    """An `EventLog` on the real broker that, with `--hang-write`, stops inside the first snapshot's write.

    The records before the snapshot in the same durable write are acknowledged first, so the
    killed write leaves part of its records in the log, which the recovered write sends again.
    """

    async def append(self, record: LogRecord) -> Ack:
        """Append; with `--hang-write`, stop before the first snapshot record once the rest is acked."""
        snapshot = record.snapshot if isinstance(record, StepEvent) else None
        if HANG_WRITE and snapshot is not None and snapshot.snapshot_seq == 0:
            await self.flush()
            print('in-write', flush=True)
            await asyncio.Event().wait()  # SIGKILLed here, in the middle of the durable write
        return await super().append(record)


def make_log() -> EventLog:
    """The process's one log, on the settings the parent passed in `STEPSTREAM_*` variables."""
    return HangsInWrite(Settings.from_env())


def make_agent(log: EventLog, durability: AbstractCapability[None] | None, name: str) -> Agent[None, str]:
    """The persisted agent under `durability` (None for a deprecated wrapper); the caller adds `step`."""
    capabilities: list[AbstractCapability[None]] = [StepPersistence(log=log, agent_name='worker')]
    if durability is not None:
        capabilities.append(durability)
    return Agent(calls_then_answers('step', calls=2), name=name, capabilities=capabilities)
