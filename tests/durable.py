"""What every durable-execution test checks once its engine ran (or recovered) the persisted agent.

The engines differ in how a run is started, killed and recovered (test_durable_exec.py for DBOS,
test_durable_temporal.py, test_durable_prefect.py); the log they leave must not: one completed
run with one writer, every `seq` applied once, nothing dead-lettered or parked, the trail of the
same agent run without an engine, and the attempt marks of decision 0008.
"""

from __future__ import annotations

import asyncio
import signal

from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import BinaryContent, ModelRequest, ToolReturnPart, UserPromptPart

from stepstream import Settings
from stepstream.producer import ATTEMPT_KEY, EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.schemas import RunRecord, StepEvent

from agents import calls_then_answers
from durable_agent import IMAGE_BYTES, TOOL_OUTPUT_CHARS, image

Trail = list[tuple[object, ...]]


async def kill_at(process: asyncio.subprocess.Process, expected: bytes, timeout: float = 120) -> None:
    """Wait until the child prints `expected` (it then waits forever), then SIGKILL it."""
    try:
        assert process.stdout is not None
        while True:
            line = await asyncio.wait_for(process.stdout.readline(), timeout)
            assert line, f'the child ended before printing {expected!r}'
            if line == expected:
                break
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
        await process.wait()
    assert process.returncode == -signal.SIGKILL


async def the_run(reader: ProjectionReader, conversation_id: str) -> tuple[RunRecord, list[StepEvent]]:
    """The one run of `conversation_id`: completed, one writer, every seq applied once, nothing lost."""
    [run] = await reader.list_runs(conversation_id=conversation_id)
    assert run.status == 'completed' and run.conflicting_writers == [] and run.gaps == []
    events = await reader.list_events(run.run_id)
    assert run.event_count == run.last_seq + 1  # every seq, of both topics, applied once
    assert {e.writer_id for e in events} == {run.registration_id}
    status = await reader.status()
    assert status.dead_lettered == 0, status.dead_lettered_by_reason
    assert status.parked_records == 0
    return run, events


def shape(events: list[StepEvent]) -> Trail:
    """What a trail says, without what differs between any two runs (ids, times)."""
    return [
        (e.seq, e.kind, e.step_index, e.tool_call_id, e.tool_name, e.error, e.snapshot and e.snapshot.state)
        for e in events
    ]


def plain_agent(event_log: EventLog | None, step_doc: str | None = None) -> Agent[None, str]:
    """The engines' agent and tool, with no engine (persisted to `event_log`, if given).

    `step_doc` is the tool's docstring in the engine's child, which the model is shown.
    """
    agent = Agent(
        calls_then_answers('step', calls=2),
        capabilities=[StepPersistence(log=event_log, agent_name='worker')] if event_log is not None else [],
    )

    async def step(ctx: RunContext[None]) -> str:
        return f'{ctx.tool_call_id} done'

    step.__doc__ = step_doc
    agent.tool(step)
    return agent


async def trail_without_engine(event_log: EventLog, projector: Projector) -> Trail:
    """The same agent, tool and prompt, run plainly: the trail an engine's run must match."""
    await plain_agent(event_log).run('go', conversation_id='plain')
    await projector.wait_for(await event_log.flush())
    [run] = await ProjectionReader.of(projector).list_runs(conversation_id='plain')
    return shape(await ProjectionReader.of(projector).list_events(run.run_id))


def assert_recovered_after(events: list[StepEvent], kind: str, tool_call_id: str | None) -> None:
    """Attempt 1 wrote up to the `(kind, tool_call_id)` event, unmarked; every later event is attempt 2."""
    cut = next(i for i, e in enumerate(events) if (e.kind, e.tool_call_id) == (kind, tool_call_id))
    assert all(ATTEMPT_KEY not in e.metadata for e in events[: cut + 1])
    assert all(e.metadata.get(ATTEMPT_KEY) == '2' for e in events[cut + 1 :])


async def assert_tool_kill_recovered(
    reader: ProjectionReader,
    projector: Projector,
    event_log: EventLog,
    conversation_id: str,
    effects: list[str],
    step_doc: str | None = None,
) -> None:
    """A run killed inside tool call-1, recovered: one run, the plain trail, call-1 completed by attempt 2.

    And it replays against the plain agent (whose tool has the child's `step_doc`).
    """
    run, events = await the_run(reader, conversation_id)
    assert shape(events) == await trail_without_engine(event_log, projector)
    assert_recovered_after(events, 'tool_call_started', 'call-1')
    cut = next(i for i, e in enumerate(events) if (e.kind, e.tool_call_id) == ('tool_call_started', 'call-1'))
    assert (events[cut + 1].kind, events[cut + 1].tool_call_id) == ('tool_call_completed', 'call-1')
    effect = await reader.get_tool_effect(run.run_id, 'call-1')
    assert effect is not None and effect.status == 'completed'
    assert await reader.list_unresolved_tool_effects(run.run_id) == []
    assert effects == ['call-0', 'call-1']  # each side effect happened once
    assert projector.dead_lettered == 0
    # Replay (issue 38): the run the engine wrote and recovered replays against the plain agent.
    from stepstream.replay import replay_run

    report = await replay_run(plain_agent(None, step_doc), run.run_id, reader=reader)
    assert report.outcome == 'matched' and report.steps == 3, report.text()


async def assert_write_kill_recovered(
    reader: ProjectionReader,
    projector: Projector,
    event_log: EventLog,
    conversation_id: str,
    effects: list[str],
) -> None:
    """A run killed inside the first snapshot's durable write: the write sent again is duplicates only."""
    duplicates = projector.duplicates_ignored
    run, events = await the_run(reader, conversation_id)
    assert shape(events) == await trail_without_engine(event_log, projector)
    # The interrupted write's records (effect and event of call-0, the snapshot) were sealed by
    # the first attempt; everything after them is written by attempt 2.
    assert_recovered_after(events, 'snapshot_saved', None)
    assert duplicates > 0, 'the recovered write re-sent the records the killed one had sent'
    assert projector.dead_lettered == 0
    assert effects == ['call-0', 'call-1']
    assert await reader.list_unresolved_tool_effects(run.run_id) == []


async def assert_clean_big_run(
    reader: ProjectionReader, projector: Projector, event_log: EventLog, conversation_id: str
) -> RunRecord:
    """A run without a crash, with a 1 MB image and 200 KB tool outputs: the plain trail, media intact."""
    run, events = await the_run(reader, conversation_id)
    assert run.agent_name == 'worker'
    assert all(ATTEMPT_KEY not in e.metadata for e in events)
    assert shape(events) == await trail_without_engine(event_log, projector)
    assert projector.duplicates_ignored == 0
    for event in events:  # the large values went to the media store, not into records
        assert event.snapshot is None or len(event.snapshot.messages) < 64 * 1024
    snapshot = await reader.latest_snapshot(run.run_id)
    assert snapshot is not None
    requests = [m for m in snapshot.messages if isinstance(m, ModelRequest)]
    [prompt] = [p for p in requests[0].parts if isinstance(p, UserPromptPart)]
    assert isinstance(prompt.content, list)
    [picture] = [c for c in prompt.content if isinstance(c, BinaryContent)]
    assert len(picture.data) == IMAGE_BYTES and picture.data == image()
    returns = [p for m in requests for p in m.parts if isinstance(p, ToolReturnPart)]
    assert [len(str(r.content)) for r in returns] == [TOOL_OUTPUT_CHARS, TOOL_OUTPUT_CHARS]
    return run


def _signing_key() -> str:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    key = Ed25519PrivateKey.generate()
    return key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode()


SIGNING_KEY = _signing_key()
"""The writers' key of the engine tests that kill a durable write: the write sent again is signed alike."""


def signed(settings: Settings) -> Settings:
    """`settings` whose writers sign their chain heads with `SIGNING_KEY`."""
    return settings.replace(signing_key=SIGNING_KEY)


async def assert_audited(settings: Settings, conversation_id: str) -> None:
    """`audit verify --conversation` from the topics: every run intact, signed to its end, complete.

    Under an engine a recovered run writes its records again byte for byte, signed heads included
    (Ed25519 is deterministic): the copies sent twice are one record each, and the chain holds.
    """
    from stepstream.audit import audit_log
    from stepstream.signing import Signer, TrustedKeys

    signer = Signer.from_pem(SIGNING_KEY.encode())
    keys = TrustedKeys({signer.key_id: signer.private_key.public_key()})
    report = await audit_log(settings, keys=keys, conversation_id=conversation_id)
    assert report.runs, f'no run of conversation {conversation_id!r} in the log'
    for verdict in report.runs:
        integrity = verdict.integrity
        assert integrity is not None and integrity.ok, verdict
        assert integrity.chain == 'intact' and integrity.signed_through == integrity.records, verdict
        assert verdict.completeness == 'complete', verdict
    assert report.integrity_ok and report.completeness_ok
