"""StepPersistence behaviour, each through a real Agent run.

What the capability writes is checked on an `InMemoryLog` applied by the projector's own rules
(`MemoryProjection`: the fast tier); what the log and the projector add on the way (concurrent runs
on one shared producer, specs that build a log) is checked through the broker and the projector.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent, ModelRetry, RunContext
from pydantic_ai.capabilities import AbstractCapability, ProcessHistory
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import UsageLimits

from stepstream import Settings
from stepstream.producer import (
    REDACTION_KEY,
    EventLog,
    InMemoryLog,
    SnapshotSaved,
    StepLog,
    StepPersistence,
    annotate_tool_effect,
    is_provider_valid,
)
from stepstream.producer._snapshots import DeltaTracker
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader, continue_run, inspect_recovery
from stepstream.schemas import encode

from agents import answers, calls_then_answers, tool_returns, turns_then_answers
from memory_projection import MemoryProjection


@pytest.fixture
async def event_log() -> AsyncIterator[InMemoryLog]:
    log = InMemoryLog(Settings(partitions=3))
    yield log
    await log.close()


@pytest.fixture
def projector(event_log: InMemoryLog) -> MemoryProjection:
    return MemoryProjection(event_log)


@pytest.fixture
async def broker_log(settings: Settings) -> AsyncIterator[EventLog]:
    async with EventLog(settings) as log:
        yield log


@pytest.fixture
async def broker_projector(settings: Settings, db_path: Path) -> AsyncIterator[Projector]:
    async with Projector(settings, db_path=db_path) as running:
        yield running


async def settle(log: StepLog, projector: MemoryProjection | Projector) -> ProjectionReader:
    await projector.wait_for(await log.flush())
    return ProjectionReader.of(projector)


@pytest.mark.fast
async def test_events_carry_lineage_metadata_and_step(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    capability = StepPersistence(log=event_log, agent_name='librarian', metadata={'team': 'docs'})
    agent = Agent(calls_then_answers('lookup'), capabilities=[capability])

    @agent.tool_plain
    def lookup() -> str:
        return 'found'

    result = await agent.run('find', conversation_id='conv-meta')
    reader = await settle(event_log, projector)
    [run] = await reader.list_runs(conversation_id='conv-meta')
    assert run.run_id == f'librarian-{result.run_id}'
    assert run.metadata == {'team': 'docs', REDACTION_KEY: 'default/2'}  # the policy that wrote it
    events = await reader.list_events(run.run_id)
    assert events[0].metadata == run.metadata
    assert all(e.metadata == {'team': 'docs'} and e.agent_name == 'librarian' for e in events[1:])
    assert all(e.conversation_id == 'conv-meta' for e in events)
    assert [e.kind for e in events] == [
        'run_started',
        'model_request_started',
        'model_request_completed',
        'tool_call_started',
        'tool_call_completed',
        'snapshot_saved',
        'model_request_started',
        'model_request_completed',
        'snapshot_saved',
        'run_completed',
    ]
    tool_events = [e for e in events if e.kind.startswith('tool_call')]
    assert {(e.tool_name, e.tool_call_id) for e in tool_events} == {('lookup', 'call-0')}
    assert [e.step_index for e in events if e.kind == 'model_request_started'] == [1, 2]


@pytest.mark.fast
async def test_without_agent_name_the_context_run_id_is_used(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    agent = Agent(answers(), capabilities=[StepPersistence(log=event_log)])
    result = await agent.run('hi', conversation_id='conv-ctx')
    reader = await settle(event_log, projector)
    [run] = await reader.list_runs(conversation_id='conv-ctx')
    assert run.run_id == result.run_id


@pytest.mark.fast
async def test_concurrent_delegates_get_their_parent(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    delegate = Agent(answers('part'), capabilities=[StepPersistence(log=event_log, agent_name='worker')])
    orchestrator = Agent(
        calls_then_answers('fan_out'), capabilities=[StepPersistence(log=event_log, agent_name='boss')]
    )

    delegated: list[str] = []

    @orchestrator.tool_plain
    async def fan_out() -> str:
        results = await asyncio.gather(*(delegate.run(f'part {i}') for i in range(5)))
        delegated.extend(f'worker-{r.run_id}' for r in results)  # `{agent_name}-{ctx.run_id}`
        return ','.join(r.output for r in results)

    await orchestrator.run('go', conversation_id='conv-fan')
    reader = await settle(event_log, projector)
    [boss] = await reader.list_runs(conversation_id='conv-fan')
    children = await reader.list_runs(parent_run_id=boss.run_id)
    # Each delegate the tool started, and only those: concurrent runs find their own parent.
    assert sorted(c.run_id for c in children) == sorted(delegated) and len(set(delegated)) == 5
    assert all(c.agent_name == 'worker' and c.parent_run_id == boss.run_id for c in children)
    tree = [r.run_id for r in await reader.run_tree(boss.run_id)]
    assert tree[0] == boss.run_id and sorted(tree[1:]) == sorted(delegated)
    assert (await reader.root_of(children[2].run_id)).run_id == boss.run_id  # type: ignore[union-attr]


@pytest.mark.fast
async def test_explicit_parent_overrides_inference(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    delegate = Agent(
        answers(),
        capabilities=[StepPersistence(log=event_log, run_id='remote-1', parent_run_id='elsewhere-9')],
    )
    outer = Agent(
        calls_then_answers('call'), capabilities=[StepPersistence(log=event_log, agent_name='outer')]
    )

    @outer.tool_plain
    async def call() -> str:
        return (await delegate.run('x')).output

    await outer.run('go')
    reader = await settle(event_log, projector)
    assert (await reader.get_run('remote-1')).parent_run_id == 'elsewhere-9'  # type: ignore[union-attr]


@pytest.mark.fast
async def test_runs_of_a_conversation_are_listed_in_start_order(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    agent = Agent(answers(), capabilities=[StepPersistence(log=event_log, agent_name='chat')])
    ids = [f'chat-{(await agent.run(f"turn {i}", conversation_id="conv-order")).run_id}' for i in range(3)]
    reader = await settle(event_log, projector)
    runs = await reader.list_runs(conversation_id='conv-order')
    # The turns ran one after another: the listing gives them in the order they were run.
    assert [r.run_id for r in runs] == ids and len(set(ids)) == 3


@pytest.mark.fast
async def test_run_without_tools_is_saved_by_the_after_run_fallback(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    agent = Agent(answers('plain'), capabilities=[StepPersistence(log=event_log, run_id='no-tools')])
    result = await agent.run('hello')
    reader = await settle(event_log, projector)
    assert await continue_run(reader, run_id='no-tools') == result.all_messages()


@pytest.mark.fast
async def test_run_stream_is_saved_after_the_last_boundary(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        yield 'streamed '
        yield 'answer'

    agent = Agent(
        FunctionModel(stream_function=stream), capabilities=[StepPersistence(log=event_log, run_id='st-1')]
    )
    async with agent.run_stream('hi') as response:
        text = await response.get_output()
    assert text == 'streamed answer'
    reader = await settle(event_log, projector)
    snapshot = await reader.latest_snapshot('st-1')
    assert snapshot is not None
    assert snapshot.messages == response.all_messages()
    assert (await reader.get_run('st-1')).status == 'completed'  # type: ignore[union-attr]


@pytest.mark.fast
async def test_snapshot_folds_in_the_pending_tool_return(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    agent = Agent(
        calls_then_answers('work', calls=3), capabilities=[StepPersistence(log=event_log, run_id='fold')]
    )

    @agent.tool_plain
    def work() -> str:
        return 'w'

    result = await agent.run('go')
    reader = await settle(event_log, projector)
    snapshots = await reader.list_snapshots('fold')
    # One per settled tool cycle (each ends with the tool-return request) plus the final one.
    assert [len(tool_returns(s.messages)) for s in snapshots] == [1, 2, 3, 3]
    assert all(isinstance(s.messages[-1].parts[0], ToolReturnPart) for s in snapshots[:3])
    assert snapshots[-1].messages == result.all_messages()
    assert [s.snapshot_seq for s in snapshots] == [0, 1, 2, 3]
    all_messages = result.all_messages()
    for s in snapshots[:3]:
        # Every intermediate point is a prefix of the final history (with run ids stamped later).
        assert [m.kind for m in s.messages] == [m.kind for m in all_messages[: len(s.messages)]]


@dataclass
class SnapshotListener(AbstractCapability[Any]):
    """Records every `SnapshotSaved` event with the history the run held when it arrived."""

    seen: list[tuple[SnapshotSaved, list[ModelMessage]]] = field(default_factory=list)

    async def on_event(self, ctx: RunContext[Any], *, event: Any) -> None:
        if isinstance(event, SnapshotSaved):
            self.seen.append((event, list(ctx.messages)))


@pytest.mark.fast
async def test_snapshot_saved_capability_event(event_log: InMemoryLog) -> None:
    listener = SnapshotListener()
    agent = Agent(
        calls_then_answers('work'), capabilities=[StepPersistence(log=event_log, run_id='evt'), listener]
    )

    @agent.tool_plain
    def work() -> str:
        return 'w'

    await agent.run('go')
    # Events emitted after the event stream closed (the after_run fallback) are not delivered.
    event, _ = listener.seen[0]
    assert (event.persistence_run_id, event.snapshot_seq, event.state, event.step_index) == (
        'evt',
        0,
        'complete',
        1,
    )


@pytest.mark.fast
async def test_capture_frontier_saves_inputs_and_tool_call_frontiers(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    agent = Agent(
        calls_then_answers('work'),
        capabilities=[StepPersistence(log=event_log, run_id='frontier', capture_frontier=True)],
    )

    @agent.tool_plain
    def work() -> str:
        return 'w'

    await agent.run('go')
    reader = await settle(event_log, projector)
    every = await reader.list_snapshots('frontier', include_interrupted=True)
    states = [s.state for s in every]
    assert 'interrupted' in states  # the accepted tool call, before it ran
    first = every[0]
    assert isinstance(first.messages[-1], ModelRequest) and isinstance(
        first.messages[-1].parts[0], UserPromptPart
    )
    frontier = next(s for s in every if s.state == 'interrupted')
    assert isinstance(frontier.messages[-1], ModelResponse)
    assert isinstance(frontier.messages[-1].parts[0], ToolCallPart)


@pytest.mark.fast
async def test_rewritten_history_reconstructs_exactly(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    def keep_recent(messages: list[ModelMessage]) -> list[ModelMessage]:
        # A compaction-like processor: drops old turns and rewrites the first request.
        # Keeps the last call/return pair, so the history stays provider-valid.
        if len(messages) <= 4:
            return messages
        first = ModelRequest(parts=[UserPromptPart(f'(summary of {len(messages) - 2} messages)')])
        return [first, *messages[-2:]]

    agent = Agent(
        turns_then_answers('work', 5),  # the processor hides old returns, so the model counts turns
        capabilities=[ProcessHistory(keep_recent), StepPersistence(log=event_log, run_id='rewrite')],
    )

    @agent.tool_plain
    def work() -> str:
        return 'w'

    result = await agent.run('go')
    reader = await settle(event_log, projector)
    snapshot = await reader.latest_snapshot('rewrite')
    assert snapshot is not None and snapshot.messages == result.all_messages()
    events = await reader.list_events('rewrite')
    prefix_lens = [e.snapshot.prefix_len for e in events if e.snapshot is not None]
    assert prefix_lens[0] == 0 and max(prefix_lens) > 0
    # The processor rewrote the first request at some point: a later snapshot shares less.
    assert any(b < a for a, b in itertools.pairwise(prefix_lens))


@pytest.mark.fast
async def test_failed_tool_leaves_an_interrupted_snapshot(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    def two_calls(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(tool_returns(messages)) == 0 and len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart('warm_up', {}, tool_call_id='w0')])
        return ModelResponse(
            parts=[
                ToolCallPart('fast', {}, tool_call_id='ok-1'),
                ToolCallPart('explode', {}, tool_call_id='bad-1'),
            ]
        )

    agent = Agent(FunctionModel(two_calls), capabilities=[StepPersistence(log=event_log, run_id='boom')])

    @agent.tool_plain
    def warm_up() -> str:
        return 'warm'

    @agent.tool_plain
    async def fast() -> str:
        return 'fast done'

    @agent.tool_plain
    async def explode() -> str:
        await asyncio.sleep(0.05)  # `fast` completes first
        raise RuntimeError('disk on fire')

    with pytest.raises(RuntimeError, match='disk on fire'):
        await agent.run('go')
    reader = await settle(event_log, projector)
    run = await reader.get_run('boom')
    assert run is not None and run.status == 'failed' and 'disk on fire' in (run.error or '')
    assert (await reader.get_tool_effect('boom', 'ok-1')).status == 'completed'  # type: ignore[union-attr]
    failed = await reader.get_tool_effect('boom', 'bad-1')
    assert failed is not None and failed.status == 'failed' and 'disk on fire' in (failed.error or '')

    interrupted = await reader.latest_snapshot('boom', include_interrupted=True)
    assert interrupted is not None and interrupted.state == 'interrupted'
    assert not is_provider_valid(interrupted.messages)
    complete = await continue_run(reader, run_id='boom')
    assert complete != interrupted.messages
    assert is_provider_valid(complete) and [p.tool_name for p in tool_returns(complete)] == ['warm_up']
    assert await continue_run(reader, run_id='boom', include_interrupted=True) == interrupted.messages

    report = await inspect_recovery(reader, run_id='boom')
    assert report.run is not None and report.run.status == 'failed'
    assert report.latest_snapshot is not None and report.latest_snapshot.state == 'interrupted'
    assert (
        report.latest_complete_snapshot is not None and report.latest_complete_snapshot.messages == complete
    )
    assert report.unresolved == []
    assert sorted(report.completed_tools) == ['fast', 'warm_up'] and report.failed_tools == ['explode']


@pytest.mark.fast
async def test_model_failure_is_recorded(event_log: InMemoryLog, projector: MemoryProjection) -> None:
    def broken(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise ConnectionError('provider down')

    agent = Agent(FunctionModel(broken), capabilities=[StepPersistence(log=event_log, run_id='model-down')])
    with pytest.raises(ConnectionError):
        await agent.run('go')
    reader = await settle(event_log, projector)
    kinds = [e.kind for e in await reader.list_events('model-down')]
    assert kinds == ['run_started', 'model_request_started', 'model_request_failed', 'run_failed']
    with pytest.raises(LookupError, match='model-down'):
        await continue_run(reader, run_id='model-down')


@pytest.mark.fast
async def test_retry_prompt_settles_its_call(event_log: InMemoryLog, projector: MemoryProjection) -> None:
    attempts: list[int] = []
    agent = Agent(calls_then_answers('flaky'), capabilities=[StepPersistence(log=event_log, run_id='retry')])

    @agent.tool_plain
    def flaky() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise ModelRetry('try again')
        return 'ok'

    result = await agent.run('go')
    reader = await settle(event_log, projector)
    assert (await reader.latest_snapshot('retry')).messages == result.all_messages()  # type: ignore[union-attr]
    assert is_provider_valid(result.all_messages())


@pytest.mark.fast
async def test_cancelled_run_leaves_a_usable_trail(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    first_done, second_entered = asyncio.Event(), asyncio.Event()
    agent = Agent(
        calls_then_answers('slow', calls=2), capabilities=[StepPersistence(log=event_log, run_id='cx')]
    )

    @agent.tool_plain
    async def slow() -> str:
        if first_done.is_set():
            second_entered.set()  # its `started` is acknowledged: the body runs after it
            await asyncio.sleep(3600)
        first_done.set()
        return 'first done'

    task = asyncio.create_task(agent.run('go'))
    await asyncio.wait_for(second_entered.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    reader = await settle(event_log, projector)
    run = await reader.get_run('cx')
    assert run is not None and run.status == 'cancelled' and 'CancelledError' in (run.error or '')
    [open_effect] = await reader.list_unresolved_tool_effects('cx')
    assert open_effect.tool_call_id == 'call-1' and open_effect.unknown_after_crash
    history = await continue_run(reader, run_id='cx')
    assert [p.tool_call_id for p in tool_returns(history)] == ['call-0']


@pytest.mark.fast
async def test_annotate_outside_a_persisted_tool_is_a_no_op(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    agent = Agent(calls_then_answers('plain_tool'))  # no StepPersistence

    @agent.tool
    async def plain_tool(ctx: RunContext[None]) -> str:
        await annotate_tool_effect(ctx, idempotency_key='k')
        return 'ok'

    await agent.run('go')
    reader = await settle(event_log, projector)
    # Nothing reached the log: a stray record would be parked (never listed) or dead-lettered,
    # and would move the stored offsets on.
    status = await reader.status()
    assert not any(status.offsets.values()), status.offsets
    assert (status.parked_records, status.dead_lettered) == (0, 0)
    assert await reader.list_runs() == []


@pytest.mark.fast
async def test_annotate_in_an_unpersisted_agent_inside_a_persisted_tool_writes_nothing(
    event_log: InMemoryLog, projector: MemoryProjection, caplog: pytest.LogCaptureFixture
) -> None:
    inner = Agent(calls_then_answers('charge'))  # no StepPersistence; its call ids repeat the outer's

    @inner.tool
    async def charge(ctx: RunContext[None]) -> str:
        await annotate_tool_effect(ctx, idempotency_key='inner-charge', effect_summary='charges a card')
        return 'charged'

    outer = Agent(
        calls_then_answers('delegate'), capabilities=[StepPersistence(log=event_log, run_id='outer-1')]
    )

    @outer.tool_plain
    async def delegate() -> str:
        return (await inner.run('pay')).output

    with caplog.at_level('DEBUG', logger='stepstream.producer'):
        await outer.run('go')
    reader = await settle(event_log, projector)
    effect = await reader.get_tool_effect('outer-1', 'call-0')
    assert effect is not None and effect.tool_name == 'delegate' and effect.status == 'completed'
    assert (effect.idempotency_key, effect.effect_summary) == (None, None)
    run = await reader.get_run('outer-1')
    assert run is not None and run.gaps == [] and run.event_count == run.last_seq + 1
    assert 'outside a recorded tool call' in caplog.text


@pytest.mark.broker
async def test_one_log_many_concurrent_runs_keep_per_run_order(
    broker_log: EventLog, broker_projector: Projector
) -> None:
    event_log, projector = broker_log, broker_projector
    agent = Agent(
        calls_then_answers('step', calls=3), capabilities=[StepPersistence(log=event_log, agent_name='c')]
    )

    @agent.tool_plain
    async def step() -> str:
        await asyncio.sleep(0)
        return 's'

    await asyncio.gather(*(agent.run(f'run {i}', conversation_id='conv-many') for i in range(20)))
    reader = await settle(event_log, projector)
    runs = await reader.list_runs(conversation_id='conv-many')
    assert len(runs) == 20
    assert projector.duplicates_ignored == 0
    for run in runs:
        assert run.status == 'completed' and run.gaps == [] and run.event_count == run.last_seq + 1
        snapshot = await reader.latest_snapshot(run.run_id)
        assert snapshot is not None and len(tool_returns(snapshot.messages)) == 3


@pytest.mark.broker
async def test_from_spec_uses_a_shared_log(settings: Settings, broker_projector: Projector) -> None:
    projector = broker_projector
    spec = {
        'bootstrap_servers': settings.kafka.bootstrap_servers,
        'topic_prefix': settings.topics.topic_prefix,
        'agent_name': 's',
    }
    capability = StepPersistence.from_spec(**spec)
    assert StepPersistence.from_spec(**spec).log is capability.log
    try:
        agent = Agent(answers(), capabilities=[capability])
        await agent.run('hi', conversation_id='conv-spec')
        await projector.wait_for(await capability.log.flush())
        [run] = await ProjectionReader.of(projector).list_runs(conversation_id='conv-spec')
        assert run.agent_name == 's'
    finally:
        await EventLog.close_shared()
    with pytest.raises(ValueError, match=r"unknown StepPersistence spec option\(s\) \['backend'\]"):
        StepPersistence.from_spec(backend='sqlite')


@pytest.mark.broker
async def test_specs_for_different_principals_get_different_shared_logs(settings: Settings) -> None:
    """A log connects as one SASL user: two users of one cluster must not share its connection."""
    spec = {
        'bootstrap_servers': settings.kafka.bootstrap_servers,
        'topic_prefix': settings.topics.topic_prefix,
        'security_protocol': 'SASL_PLAINTEXT',
        'sasl_mechanism': 'SCRAM-SHA-512',
        'sasl_password': 'secret',
    }
    try:
        alice = StepPersistence.from_spec(**spec, sasl_username='alice').log
        bob = StepPersistence.from_spec(**spec, sasl_username='bob').log
        assert alice is not bob
        assert isinstance(alice, EventLog) and isinstance(bob, EventLog)
        assert (alice.settings.kafka.sasl_username, bob.settings.kafka.sasl_username) == ('alice', 'bob')
        assert StepPersistence.from_spec(**spec, sasl_username='alice', agent_name='other').log is alice
        slower = StepPersistence.from_spec(**spec, sasl_username='alice', ack_timeout_s=60.0).log
        assert (
            slower is not alice
            and isinstance(slower, EventLog)
            and slower.settings.kafka.ack_timeout_s == 60.0
        )
    finally:
        await EventLog.close_shared()


@pytest.mark.fast
def test_compaction_transcript_handle_is_the_run_id(event_log: InMemoryLog) -> None:
    assert StepPersistence(log=event_log, run_id='handle-1').compaction_transcript_handle() == 'handle-1'


@pytest.mark.fast
async def test_snapshot_records_stay_flat_across_a_long_run(
    event_log: InMemoryLog, projector: MemoryProjection
) -> None:
    agent = Agent(
        calls_then_answers('step', calls=200), capabilities=[StepPersistence(log=event_log, run_id='long')]
    )

    @agent.tool_plain
    def step() -> str:
        return 'x' * 200

    await agent.run('go', usage_limits=UsageLimits(request_limit=1000))
    reader = await settle(event_log, projector)
    sizes = [len(encode(e)) for e in await reader.list_events('long') if e.snapshot is not None]
    assert len(sizes) == 201
    assert sizes[199] <= 2 * sizes[9]
    final = await reader.latest_snapshot('long')
    assert final is not None and len(tool_returns(final.messages)) == 200


@pytest.mark.fast
class TestIsProviderValid:
    def call(self, *ids: str) -> ModelResponse:
        return ModelResponse(parts=[ToolCallPart('t', {}, tool_call_id=i) for i in ids])

    def ret(self, *ids: str) -> ModelRequest:
        return ModelRequest(parts=[ToolReturnPart('t', 'r', tool_call_id=i) for i in ids])

    def test_rules(self) -> None:
        user = ModelRequest(parts=[UserPromptPart('hi')])
        text = ModelResponse(parts=[TextPart('t')])
        assert is_provider_valid([])
        assert is_provider_valid([user, text])
        assert is_provider_valid([user, self.call('a', 'b'), self.ret('a', 'b'), text])
        assert not is_provider_valid([user, self.call('a')])  # open call
        assert not is_provider_valid([user, self.ret('a')])  # orphan return
        assert not is_provider_valid([user, self.call('a'), self.ret('a'), self.ret('a')])  # duplicate
        assert not is_provider_valid([user, self.ret('a'), self.call('a')])  # out of order

    def test_tool_bound_retry_prompt_resolves_its_call(self) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter('ignore')  # deprecated, but still accepted in caller histories
            from pydantic_ai.messages import RetryPromptPart

            retry = ModelRequest(parts=[RetryPromptPart('bad args', tool_name='t', tool_call_id='a')])
            stray = ModelRequest(parts=[RetryPromptPart('bad args', tool_name='t', tool_call_id='zzz')])
        assert is_provider_valid([self.call('a'), retry])
        assert not is_provider_valid([self.call('a'), stray])


@pytest.mark.fast
class TestDeltaTracker:
    """The planner against the plain definitions it shortcuts: shared prefix and validity."""

    @staticmethod
    def history(turns: int) -> list[ModelMessage]:
        messages: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart('go')])]
        for i in range(turns):
            messages.append(ModelResponse(parts=[ToolCallPart('t', {}, tool_call_id=f'c{i}')]))
            messages.append(ModelRequest(parts=[ToolReturnPart('t', 'r', tool_call_id=f'c{i}')]))
        return messages

    def test_append_only_history_sends_only_the_new_tail(self) -> None:
        tracker = DeltaTracker()
        live = self.history(3)
        first = tracker.plan(live)
        assert (first.prefix_len, len(first.tail_json), first.valid) == (0, 7, True)
        tracker.commit(first)
        live.extend(self.history(4)[7:])
        second = tracker.plan(live)
        assert (second.prefix_len, len(second.tail_json), second.valid) == (7, 2, True)
        tracker.commit(second)
        assert tracker.unchanged(tracker.plan(live))

    def test_a_message_stamped_after_saving_is_patched_not_sent_again(self) -> None:
        tracker = DeltaTracker()
        live = self.history(2)
        tracker.commit(tracker.plan(live))
        live[-1].run_id = 'stamped-later'  # what the graph does to a folded tool-return request
        plan = tracker.plan(live)
        assert (plan.prefix_len, plan.tail_json, plan.patch) == (
            len(live),
            [],
            [(4, {'run_id': 'stamped-later'})],
        )
        assert not tracker.unchanged(plan)  # a patch alone is still a snapshot to save
        tracker.commit(plan)
        assert tracker.unchanged(tracker.plan(live))

    def test_a_message_whose_parts_changed_in_place_is_sent_again(self) -> None:
        tracker = DeltaTracker()
        live = self.history(2)
        tracker.commit(tracker.plan(live))
        live[-1].parts[0].content = 'rewritten'  # type: ignore[union-attr]
        live[-1].run_id = 'stamped-later'
        plan = tracker.plan(live)
        assert plan.prefix_len == len(live) - 1 and not plan.patch
        assert b'rewritten' in plan.tail_json[0] and b'stamped-later' in plan.tail_json[0]

    def test_rewritten_history_and_validity_match_the_definitions(self) -> None:
        tracker = DeltaTracker()
        live = self.history(5)
        tracker.commit(tracker.plan(live))
        rewritten = [ModelRequest(parts=[UserPromptPart('summary')]), *live[-2:]]
        plan = tracker.plan(rewritten)
        assert plan.prefix_len == 0 and plan.valid == is_provider_valid(rewritten)
        tracker.commit(plan)
        open_call = [*rewritten, ModelResponse(parts=[ToolCallPart('t', {}, tool_call_id='open')])]
        plan = tracker.plan(open_call)
        assert plan.prefix_len == len(rewritten) and not plan.valid
        orphan = [*rewritten, ModelRequest(parts=[ToolReturnPart('t', 'r', tool_call_id='nobody')])]
        assert not tracker.plan(orphan).valid and not is_provider_valid(orphan)
