"""Replay sees what capabilities change (issue 47, item 6): a held-out table of code changes.

An on-call agent is recorded paging two teams in parallel, looking a runbook up, then answering.
Each row replays an agent against that recording with its capabilities changed the way a team
changes them (a routing table, a filter, a guard), and says what replay must report: a match for
code that does what the recording did, and otherwise the kind, the step, the call and both
values of the first divergence. A row that diverges also never runs the tool the changed code
would have called wrongly (`--tools live` rows check the tool's calls).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic_ai import Agent, ModelRetry
from pydantic_ai.capabilities import AbstractCapability, ProcessEventStream
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.readmodel import ProjectionReader
from stepstream.replay import ReplayReport, fork_run_from_step, replay_run

from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast

ANSWER = 'paged payments and storage; runbook attached'


def on_call(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Step 1 pages two teams at once (severity as text: the tool parses it), step 2 looks a runbook
    up (arguments as JSON text, as most providers send them), step 3 answers."""
    done = sum(isinstance(m, ModelResponse) for m in messages)
    if done == 0:
        return ModelResponse(
            parts=[
                ToolCallPart('page', {'team': 'payments', 'severity': '2'}, 'call-a'),
                ToolCallPart('page', {'team': 'storage', 'severity': 3}, 'call-b'),
            ]
        )
    if done == 1:
        return ModelResponse(parts=[ToolCallPart('runbook', '{"topic": "db"}', 'call-c')])
    return ModelResponse(parts=[TextPart(ANSWER)])


def calls(response: ModelResponse) -> list[ToolCallPart]:
    return [p for p in response.parts if isinstance(p, ToolCallPart)]


@dataclass
class Routing(AbstractCapability[Any]):
    """The on-call routing table: a page for one team goes to another (empty: pages go where asked)."""

    table: dict[str, str] = field(default_factory=dict)

    async def after_model_request(
        self, ctx: Any, *, request_context: Any, response: ModelResponse
    ) -> ModelResponse:
        for call in calls(response):
            if call.tool_name == 'page':
                args = call.args_as_dict()
                call.args = {**args, 'team': self.table.get(args['team'], args['team'])}
        return response


@dataclass
class Rewrite(AbstractCapability[Any]):
    """Any change to a response after the model answered, as a function of the response."""

    change: Callable[[ModelResponse], None]

    async def after_model_request(
        self, ctx: Any, *, request_context: Any, response: ModelResponse
    ) -> ModelResponse:
        self.change(response)
        return response


@dataclass
class Wrapped(AbstractCapability[Any]):
    """The same, from `wrap_model_request`: it sits outside the replay's own capability."""

    change: Callable[[ModelResponse], None]

    async def wrap_model_request(self, ctx: Any, *, request_context: Any, handler: Any) -> ModelResponse:
        response = await handler(request_context)
        self.change(response)
        return response


@dataclass
class Guard(AbstractCapability[Any]):
    """Changes a call's arguments on their way to the tool (`before_tool_execute`, or before validation)."""

    change: Callable[[str, dict[str, Any]], dict[str, Any]]
    before_validation: bool = False

    async def before_tool_validate(self, ctx: Any, *, call: ToolCallPart, tool_def: Any, args: Any) -> Any:
        if not self.before_validation:
            return args
        return self.change(call.tool_name, json.loads(args) if isinstance(args, str) else dict(args))

    async def before_tool_execute(self, ctx: Any, *, call: ToolCallPart, tool_def: Any, args: Any) -> Any:
        return args if self.before_validation else self.change(call.tool_name, dict(args))


@dataclass
class Reject(AbstractCapability[Any]):
    """A guard that sends the first answer back to the model (`ModelRetry` from `after_model_request`)."""

    rejected: bool = False

    async def for_run(self, ctx: Any) -> Reject:
        return Reject()  # its state is the run's

    async def after_model_request(
        self, ctx: Any, *, request_context: Any, response: ModelResponse
    ) -> ModelResponse:
        if not self.rejected and any(isinstance(p, TextPart) for p in response.parts):
            self.rejected = True
            raise ModelRetry('check the answer against the runbook')
        return response


def same(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return dict(args)  # a copy, equal: what reaches the tool did not change


def gentler(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {**args, 'severity': 1} if args.get('team') == 'payments' else args


def rename_runbook(response: ModelResponse) -> None:
    for call in calls(response):
        if call.tool_name == 'runbook':
            call.tool_name = 'wiki'


def drop_storage(response: ModelResponse) -> None:
    response.parts = [
        p for p in response.parts if not (isinstance(p, ToolCallPart) and 'storage' in str(p.args))
    ]


def add_exec_page(response: ModelResponse) -> None:
    if any('payments' in str(c.args) for c in calls(response)):
        response.parts.append(ToolCallPart('page', {'team': 'exec', 'severity': 1}, 'call-x'))


def soften_answer(response: ModelResponse) -> None:
    for part in response.parts:
        if isinstance(part, TextPart):
            part.content = part.content.replace('paged', 'notified')


def as_text(response: ModelResponse) -> None:
    for call in calls(response):  # the same arguments, rebuilt as JSON text with other spacing
        call.args = json.dumps(call.args_as_dict(), indent=2)


def stamp_answer(response: ModelResponse) -> None:
    for part in response.parts:
        if isinstance(part, TextPart):
            part.content += ' [reviewed]'


def storage_to_platform(response: ModelResponse) -> None:
    for call in calls(response):
        if call.tool_name == 'page' and call.args_as_dict()['team'] == 'storage':
            call.args = {**call.args_as_dict(), 'team': 'platform'}


async def listen(ctx: Any, events: AsyncIterable[Any]) -> None:
    async for _ in events:
        pass


class World:
    """The recording, and agents built like it with other capabilities."""

    def __init__(self) -> None:
        self.log = InMemoryLog()
        self.projection = MemoryProjection(self.log)
        self.paged: list[tuple[str, int]] = []
        """What the `page` tool was called with by the agents replayed with live tools."""

    def agent(
        self,
        capabilities: list[AbstractCapability[Any]],
        *,
        persisted: bool = False,
        instructions: str = 'Page the owners.',
    ) -> Agent[None, str]:
        persistence = [StepPersistence(log=self.log, agent_name='oncall')] if persisted else []
        agent = Agent(
            FunctionModel(on_call), instructions=instructions, capabilities=[*capabilities, *persistence]
        )

        @agent.tool_plain
        def page(team: str, severity: int) -> str:
            self.paged.append((team, severity))
            return f'paged {team} at severity {severity}'

        @agent.tool_plain
        def runbook(topic: str) -> str:
            return f'runbook for {topic}'

        @agent.tool_plain
        def wiki(topic: str) -> str:
            return f'wiki page on {topic}'

        return agent

    async def record(self, capabilities: list[AbstractCapability[Any]]) -> tuple[str, ProjectionReader]:
        result = await self.agent(capabilities, persisted=True).run(
            'the database is down', conversation_id='inc-1'
        )
        await self.projection.wait_for(await self.log.flush())
        self.paged.clear()
        return f'oncall-{result.run_id}', ProjectionReader(self.projection.shard)


@dataclass
class Row:
    """One held-out case: the code replayed, and what replay must say about it."""

    name: str
    replayed: list[AbstractCapability[Any]]
    kind: str | None = None
    """None: it matches."""
    step: int | None = None
    call: tuple[str, str] | None = None
    """The (tool name, recorded call id) the divergence names."""
    recorded: Any = None
    replayed_value: Any = None
    tools: str = 'recorded'
    instructions: str = 'Page the owners.'
    recorded_with: list[AbstractCapability[Any]] = field(default_factory=lambda: [Routing()])
    steps: int = 3
    """The steps a match serves."""


ROWS = [
    Row('unchanged code matches', [Routing()]),
    Row('unchanged code matches with live tools', [Routing()], tools='live'),
    Row(
        'unchanged capabilities that change nothing match (a copy of the arguments, JSON text for a dict)',
        [Routing(), Guard(same), Rewrite(as_text)],
    ),
    Row(
        'a guard that sends the answer back once (ModelRetry), unchanged: matches',
        [Routing(), Reject()],
        recorded_with=[Routing(), Reject()],
        steps=4,
    ),
    Row(
        'that guard removed: the run ends before the request its retry made',
        [Routing()],
        'missing_request',
        4,
        recorded_with=[Routing(), Reject()],
    ),
    Row(
        'the routing table pages another team: tool_arguments, both values',
        [Routing({'payments': 'platform'})],
        'tool_arguments',
        1,
        ('page', 'call-a'),
        {'team': 'payments', 'severity': '2'},
        {'team': 'platform', 'severity': '2'},
    ),
    Row(
        'parallel calls, only the second rerouted: that call is named',
        [Routing({'storage': 'platform'})],
        'tool_arguments',
        1,
        ('page', 'call-b'),
        {'team': 'storage', 'severity': 3},
        {'team': 'platform', 'severity': 3},
    ),
    Row(
        'the same rewrite from wrap_model_request, outside the replay: what entered the history',
        [Routing(), Wrapped(storage_to_platform)],
        'tool_arguments',
        1,
        ('page', 'call-b'),
        {'team': 'storage', 'severity': 3},
        {'team': 'platform', 'severity': 3},
    ),
    Row(
        'a call renamed by a capability: response',
        [Routing(), Rewrite(rename_runbook)],
        'response',
        2,
    ),
    Row('a call dropped: response', [Routing(), Rewrite(drop_storage)], 'response', 1),
    Row('a call added: response', [Routing(), Rewrite(add_exec_page)], 'response', 1),
    Row('the answer rewritten: response', [Routing(), Rewrite(soften_answer)], 'response', 3),
    Row(
        'before_tool_execute lowers a severity: executed differs from recorded',
        [Routing(), Guard(gentler)],
        'tool_arguments',
        1,
        ('page', 'call-a'),
        {'team': 'payments', 'severity': 2},  # the recorded call as the tool validates it ('2' is 2)
        {'team': 'payments', 'severity': 1},
    ),
    Row(
        'before_tool_validate lowers it: the same',
        [Routing(), Guard(gentler, before_validation=True)],
        'tool_arguments',
        1,
        ('page', 'call-a'),
        {'team': 'payments', 'severity': 2},
        {'team': 'payments', 'severity': 1},
    ),
    Row(
        'changed instructions and a rerouting: the request diverges first',
        [Routing({'payments': 'platform'})],
        'instructions',
        1,
        instructions='Page the owners, politely.',
    ),
    Row(
        'live tools, rerouted: diverges before the page is sent',
        [Routing({'payments': 'platform'})],
        'tool_arguments',
        1,
        ('page', 'call-a'),
        {'team': 'payments', 'severity': '2'},
        {'team': 'platform', 'severity': '2'},
        tools='live',
    ),
    Row(
        'live tools, a guard lowers a severity: diverges before the page is sent',
        [Routing(), Guard(gentler)],
        'tool_arguments',
        1,
        ('page', 'call-a'),
        {'team': 'payments', 'severity': 2},
        {'team': 'payments', 'severity': 1},
        tools='live',
    ),
    Row(
        'streamed (a capability listens to events), unchanged: matches',
        [Routing(), ProcessEventStream(listen)],
    ),
    Row(
        'streamed, rerouted: tool_arguments',
        [Routing({'storage': 'platform'}), ProcessEventStream(listen)],
        'tool_arguments',
        1,
        ('page', 'call-b'),
        {'team': 'storage', 'severity': 3},
        {'team': 'platform', 'severity': 3},
    ),
]


@pytest.mark.parametrize('row', ROWS, ids=[row.name for row in ROWS])
async def test_the_held_out_table(row: Row) -> None:
    world = World()
    run_id, reader = await world.record(row.recorded_with)
    agent = world.agent(row.replayed, instructions=row.instructions)
    report = await replay_run(agent, run_id, reader=reader, tools=row.tools)  # type: ignore[arg-type]
    if row.kind is None:
        assert report.outcome == 'matched' and report.ok and report.steps == row.steps, report.text()
        if row.tools == 'live':
            assert sorted(world.paged) == [('payments', 2), ('storage', 3)]  # the tools ran, as recorded
        return
    divergence = report.divergence
    assert report.outcome == 'diverged' and not report.ok and divergence is not None, report.text()
    assert (divergence.kind, divergence.step) == (row.kind, row.step), report.text()
    if row.call is not None:
        assert (divergence.tool_name, divergence.tool_call_id) == row.call
        assert (divergence.recorded, divergence.replayed) == (row.recorded, row.replayed_value)
    assert all(team != 'platform' and severity != 1 for team, severity in world.paged)  # never sent
    assert json.loads(json.dumps(report.to_json()))['divergence']['kind'] == row.kind


async def test_a_response_divergence_carries_both_responses() -> None:
    world = World()
    run_id, reader = await world.record([Routing()])
    renamed = await replay_run(world.agent([Routing(), Rewrite(rename_runbook)]), run_id, reader=reader)
    divergence = renamed.divergence
    assert divergence is not None and divergence.kind == 'response', renamed.text()
    assert [p['tool_name'] for p in divergence.recorded] == ['runbook']
    assert [p['tool_name'] for p in divergence.replayed] == ['wiki']
    assert '-    "tool_name": "runbook"' in divergence.diff and '+    "tool_name": "wiki"' in divergence.diff
    assert 'step 2: response' in renamed.text()

    dropped = await replay_run(world.agent([Routing(), Rewrite(drop_storage)]), run_id, reader=reader)
    assert dropped.divergence is not None
    assert [c['args']['team'] for c in dropped.divergence.recorded] == ['payments', 'storage']
    assert [c['args']['team'] for c in dropped.divergence.replayed] == ['payments']

    softened = await replay_run(world.agent([Routing(), Rewrite(soften_answer)]), run_id, reader=reader)
    assert softened.divergence is not None and softened.steps == 3
    assert softened.divergence.recorded == [{'content': ANSWER, **text_rest(softened.divergence.recorded[0])}]
    assert softened.divergence.replayed[0]['content'] == ANSWER.replace('paged', 'notified')


def text_rest(part: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in part.items() if k != 'content'}


async def test_the_limits_of_serving_the_response_as_it_entered_the_history() -> None:
    """The known limits (docs/replay.md): the log holds each response after the recorded code's
    capabilities, not the model's own answer, and that is what replay serves to the code's.

    A capability that is not idempotent (it appends, whatever it is given) changes it a second
    time: unchanged code diverges. A capability removed, whose change is already in the recorded
    response, is not seen: the code without it matches."""
    world = World()
    run_id, reader = await world.record([Routing(), Rewrite(stamp_answer)])
    report = await replay_run(world.agent([Routing(), Rewrite(stamp_answer)]), run_id, reader=reader)
    assert report.divergence is not None and (report.divergence.kind, report.divergence.step) == (
        'response',
        3,
    )
    assert report.divergence.replayed[0]['content'] == ANSWER + ' [reviewed] [reviewed]'

    world = World()
    run_id, reader = await world.record([Routing({'payments': 'platform'})])
    removed = await replay_run(world.agent([Routing()]), run_id, reader=reader)
    assert removed.outcome == 'matched', removed.text()


async def test_retries_failures_and_delegates_under_capabilities_still_match() -> None:
    """Unchanged code with capabilities on every hook: a tool that asks for a retry, one that fails,
    a delegate run from a tool; recorded and live tools, and a delegate whose own capability changed."""
    log = InMemoryLog()
    projection = MemoryProjection(log)
    asked: list[str] = []

    def helper_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(parts=[ToolCallPart('page', {'team': 'payments', 'severity': 2}, 'h-1')])
        return ModelResponse(parts=[TextPart('helped')])

    def refuse(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise AssertionError('a replayed delegate is served its recording: its model is never called')

    def helper(capabilities: list[AbstractCapability[Any]], model: Any) -> Agent[None, str]:
        agent = Agent(
            FunctionModel(model),
            capabilities=[*capabilities, StepPersistence(log=log, agent_name='helper')],
        )

        @agent.tool_plain
        def page(team: str, severity: int) -> str:
            return f'paged {team}'

        return agent

    def main_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = sum(isinstance(m, ModelResponse) for m in messages)
        plan = [
            [ToolCallPart('lookup', {'topic': 'db'}, 'm-1')],  # asks for a retry
            [ToolCallPart('lookup', {'topic': 'payments-db'}, 'm-2'), ToolCallPart('flaky', {}, 'm-3')],
            [ToolCallPart('delegate', {'task': 'page payments'}, 'm-4')],
        ]
        return (
            ModelResponse(parts=plan[done]) if done < len(plan) else ModelResponse(parts=[TextPart('done')])
        )

    def main(
        capabilities: list[AbstractCapability[Any]],
        helper_capabilities: list[AbstractCapability[Any]],
        model: Any,
    ) -> Agent[None, str]:
        agent = Agent(
            FunctionModel(model),
            capabilities=[*capabilities, StepPersistence(log=log, agent_name='main')],
        )
        delegate_agent = helper(helper_capabilities, helper_model if model is main_model else refuse)

        @agent.tool_plain
        def lookup(topic: str) -> str:
            asked.append(topic)
            if topic == 'db':
                raise ModelRetry('which database?')
            return f'notes on {topic}'

        @agent.tool_plain
        def flaky() -> str:
            from pydantic_ai.exceptions import ToolFailed

            raise ToolFailed('the pager is down')

        @agent.tool_plain
        async def delegate(task: str) -> str:
            return (await delegate_agent.run(task)).output

        return agent

    unchanged = [Routing(), Guard(same), Rewrite(as_text)]
    result = await main(unchanged, [Routing()], main_model).run('go', conversation_id='inc-2')
    await projection.wait_for(await log.flush())
    reader = ProjectionReader(projection.shard)
    run_id = f'main-{result.run_id}'
    for tools in ('recorded', 'live'):
        report = await replay_run(main(unchanged, [Routing()], refuse), run_id, reader=reader, tools=tools)  # type: ignore[arg-type]
        assert report.outcome == 'matched' and report.steps == 4, (tools, report.text())
    assert asked == ['db', 'payments-db', 'db', 'payments-db']  # recorded: not run; live: run, as recorded
    rerouted = await replay_run(
        main(unchanged, [Routing({'payments': 'platform'})], refuse), run_id, reader=reader, tools='live'
    )
    divergence = rerouted.divergence
    assert divergence is not None and (divergence.kind, divergence.step) == ('tool_arguments', 1), (
        rerouted.text()
    )
    assert divergence.detail.startswith('in delegate ') and divergence.replayed['team'] == 'platform'


async def test_a_fork_replays_capabilities_then_hands_them_the_live_model() -> None:
    world = World()
    run_id, reader = await world.record([Routing({'payments': 'platform'})])

    def newer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if sum(isinstance(m, ModelResponse) for m in messages) == 1:
            return ModelResponse(parts=[ToolCallPart('page', {'team': 'payments', 'severity': 1}, 'new-1')])
        return ModelResponse(parts=[TextPart('paged platform')])

    report: ReplayReport = await fork_run_from_step(
        world.agent([Routing({'payments': 'platform'})]),
        run_id,
        reader=reader,
        from_step=2,
        model=FunctionModel(newer),
        log=world.log,
    )
    assert report.outcome == 'forked' and report.steps == 1, report.text()
    assert ('platform', 1) in world.paged  # the live step's call went through the routing table
