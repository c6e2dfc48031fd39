"""Replay (issue 38): an agent re-executed against its recorded run, with no model called.

Each case records a real `Agent` run on the in-memory log, projects it (`MemoryProjection`, the
projector's own `Applier`), then replays an agent against it: the same agent (matches), or one
changed the way a team changes code (diverges, at the step and of the kind the change causes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import httpx
import pytest
from pydantic import AfterValidator
from pydantic_ai import Agent, BinaryContent, ModelRetry
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream.media import DiskMediaStore
from stepstream.producer import FORKED_AT_STEP, FORKED_FROM, InMemoryLog, StepPersistence
from stepstream.producer._run import RunWriter
from stepstream.readmodel import ProjectionReader
from stepstream.replay import fork_run_from_step, load_recording, replay_run
from stepstream.serve import app_for
from stepstream.settings import Settings

from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast

PLAN = [('lookup', {'topic': 'tides'}), ('lookup', {'topic': 'moon'}), ('work', {'n': 3})]
"""The recorded model's calls, one a step; it answers at step 4."""


def planned(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    done = sum(isinstance(m, ModelResponse) for m in messages)
    if done < len(PLAN):
        name, args = PLAN[done]
        return ModelResponse(parts=[ToolCallPart(name, args, f'call-{done}')])
    return ModelResponse(parts=[TextPart('the tides follow the moon')])


def build(
    persistence: StepPersistence[Any] | None,
    *,
    instructions: str = 'Answer from the tools.',
    work: Callable[..., Any] | None = None,
    lookup: Callable[..., Any] | None = None,
) -> Agent[None, str]:
    """The agent under test; each keyword changes one thing about its code."""
    agent = Agent(
        FunctionModel(planned),
        instructions=instructions,
        capabilities=[persistence] if persistence is not None else [],
    )

    def default_lookup(topic: str) -> str:
        return f'notes on {topic}'

    def default_work(n: int) -> int:
        return n * 2

    agent.tool_plain(name='lookup')(lookup or default_lookup)
    agent.tool_plain(name='work')(work or default_work)
    return agent


class Recorded:
    def __init__(self, tmp_path: Path) -> None:
        self.log = InMemoryLog()
        self.media = DiskMediaStore(tmp_path / 'media')
        self.projection = MemoryProjection(self.log)

    def persistence(self) -> StepPersistence[Any]:
        return StepPersistence(
            log=self.log, agent_name='tides', media_store=self.media, media_threshold_bytes=1024
        )

    async def reader(self) -> ProjectionReader:
        await self.projection.wait_for(await self.log.flush())
        return ProjectionReader(self.projection.shard, media_store=self.media)

    async def record(self, agent: Agent[None, Any], prompt: Any = 'why tides?') -> str:
        result = await agent.run(prompt, conversation_id='conv-replay')
        return f'tides-{result.run_id}'


@pytest.fixture
def recorded(tmp_path: Path) -> Recorded:
    return Recorded(tmp_path)


async def test_an_unchanged_agent_matches_and_writes_nothing(recorded: Recorded) -> None:
    run_id = await recorded.record(build(recorded.persistence()))
    reader = await recorded.reader()
    started = [e for e in await reader.list_events(run_id) if e.kind == 'model_request_started']
    assert len(started) == 4 and len({e.request_fingerprint for e in started}) == 1
    assert [e.request_definitions is not None for e in started] == [True, False, False, False]  # once
    assert json.loads(started[0].request_definitions or '')['tools'][0]['name'] == 'lookup'
    stored = len(recorded.log.records)
    report = await replay_run(build(recorded.persistence()), run_id, reader=reader)
    assert report.outcome == 'matched' and report.ok, report.text()
    assert report.steps == 4 and report.divergence is None
    assert len(recorded.log.records) == stored  # StepPersistence wrote nothing while replaying
    live = await replay_run(build(None), run_id, reader=reader, tools='live')
    assert live.outcome == 'matched', live.text()


async def test_changed_instructions_diverge_at_the_first_request(recorded: Recorded) -> None:
    run_id = await recorded.record(build(recorded.persistence()))
    report = await replay_run(
        build(None, instructions='Answer briefly.'), run_id, reader=await recorded.reader()
    )
    assert report.outcome == 'diverged' and not report.ok
    divergence = report.divergence
    assert divergence is not None and (divergence.step, divergence.kind) == (1, 'instructions')
    assert divergence.recorded == 'Answer from the tools.' and divergence.replayed == 'Answer briefly.'
    assert '-"Answer from the tools."' in divergence.diff and '+"Answer briefly."' in divergence.diff


async def test_a_tool_that_no_longer_takes_its_arguments_diverges_at_its_step(recorded: Recorded) -> None:
    run_id = await recorded.record(build(recorded.persistence()))

    report = await replay_run(build(None, work=stricter_work), run_id, reader=await recorded.reader())
    divergence = report.divergence
    assert divergence is not None, report.text()
    assert (divergence.step, divergence.kind) == (3, 'tool_arguments')  # the call at step 3 has n=3
    assert (divergence.tool_name, divergence.tool_call_id) == ('work', 'call-2')
    assert divergence.recorded == {'n': 3}
    assert 'n must be below 3' in divergence.replayed['error']


async def test_a_changed_tool_definition_or_setting_diverges_at_the_first_request(recorded: Recorded) -> None:
    run_id = await recorded.record(build(recorded.persistence()))
    reader = await recorded.reader()

    def work(count: int) -> int:  # `n` renamed: the definition the model is shown changed
        return count * 2

    renamed = await replay_run(build(None, work=work), run_id, reader=reader)
    divergence = renamed.divergence
    assert divergence is not None and (divergence.step, divergence.kind) == (1, 'tool_definitions')
    assert list(divergence.recorded) == ['work'] and 'count' in divergence.diff

    def lookup(topic: str) -> str:
        """Look a topic up in the almanac."""  # a description the model now reads
        return f'notes on {topic}'

    described = await replay_run(build(None, lookup=lookup), run_id, reader=reader)
    assert described.divergence is not None and described.divergence.kind == 'tool_definitions'
    assert described.divergence.replayed['lookup']['description'] == 'Look a topic up in the almanac.'

    tuned = build(None)
    tuned.model_settings = {'temperature': 0.2}
    report = await replay_run(tuned, run_id, reader=reader)
    assert report.divergence is not None and (report.divergence.step, report.divergence.kind) == (
        1,
        'settings',
    )
    assert (report.divergence.recorded, report.divergence.replayed) == ({}, {'temperature': 0.2})

    typed = Agent(FunctionModel(planned), instructions='Answer from the tools.', output_type=int)
    typed.tool_plain(name='lookup')(lookup_notes)
    typed.tool_plain(name='work')(double)
    report = await replay_run(typed, run_id, reader=reader)
    assert report.divergence is not None and report.divergence.kind == 'output_type', report.text()


def below_three(n: int) -> int:
    if n >= 3:
        raise ValueError('n must be below 3')
    return n


def stricter_work(n: Annotated[int, AfterValidator(below_three)]) -> int:  # `work`'s schema, stricter
    return n * 2


def lookup_notes(topic: str) -> str:
    return f'notes on {topic}'


def double(n: int) -> int:
    return n * 2


async def test_a_live_tool_whose_result_changed_is_tool_drift(recorded: Recorded) -> None:
    run_id = await recorded.record(build(recorded.persistence()))
    reader = await recorded.reader()

    def lookup(topic: str) -> str:
        return f'new notes on {topic}'

    agent = build(None, lookup=lookup)
    recorded_mode = await replay_run(agent, run_id, reader=reader)
    assert recorded_mode.outcome == 'matched', recorded_mode.text()  # the tool did not run
    report = await replay_run(agent, run_id, reader=reader, tools='live')
    divergence = report.divergence
    assert divergence is not None and (divergence.step, divergence.kind) == (1, 'tool_result')
    assert (divergence.recorded, divergence.replayed) == ('notes on tides', 'new notes on tides')


async def test_a_run_written_before_definitions_were_recorded(recorded: Recorded) -> None:
    """Schema v5 writers recorded no definitions: that check is skipped and said so, and a tool the
    agent no longer has is named when the recording calls it."""
    original = RunWriter.event

    async def older_writer(self: RunWriter, ctx: Any, kind: Any, **fields: Any) -> None:
        fields.pop('definitions', None)
        await original(self, ctx, kind, **fields)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(RunWriter, 'event', older_writer)
        run_id = await recorded.record(build(recorded.persistence()))
    reader = await recorded.reader()
    agent = Agent(FunctionModel(planned), instructions='Answer from the tools.')
    agent.tool_plain(name='lookup')(lookup_notes)  # `work` removed
    report = await replay_run(agent, run_id, reader=reader)
    divergence = report.divergence
    assert divergence is not None and (divergence.step, divergence.kind) == (4, 'tool_name'), report.text()
    assert divergence.recorded['tool_name'] == 'work'
    assert report.notes and report.notes[0].startswith('written before schema v6')
    unchanged = await replay_run(build(None), run_id, reader=reader)
    assert unchanged.outcome == 'matched' and unchanged.notes == report.notes


async def test_more_and_fewer_steps_than_recorded(recorded: Recorded) -> None:
    strict: list[bool] = [True]

    def agent_with_validator(persistence: StepPersistence[Any] | None) -> Agent[None, str]:
        agent = build(persistence)

        @agent.output_validator
        def checked(output: str) -> str:
            if strict[0]:
                strict[0] = False
                raise ModelRetry('cite a source')
            return output

        return agent

    # recorded: the validator asks once for a retry, so the model answers twice (5 responses)
    run_id = await recorded.record(agent_with_validator(recorded.persistence()))
    reader = await recorded.reader()
    fewer = await replay_run(build(None), run_id, reader=reader)  # accepts at once: a request is missing
    assert fewer.divergence is not None and fewer.divergence.kind == 'missing_request', fewer.text()
    assert fewer.divergence.step == 5

    def always_retries(output: str) -> str:
        raise ModelRetry('cite two sources')

    more_agent = build(None)
    more_agent.output_validator(always_retries)
    more = await replay_run(more_agent, run_id, reader=reader)  # the recorded answer retried again
    assert more.divergence is not None, more.text()
    assert (more.divergence.step, more.divergence.kind) == (5, 'request_content')


async def test_recorded_definitions_that_are_not_json_skip_that_check(recorded: Recorded) -> None:
    """Anything may be on a topic: garbage where the definitions should be is no crash and no divergence."""
    original = RunWriter.event

    async def garbling_writer(self: RunWriter, ctx: Any, kind: Any, **fields: Any) -> None:
        if fields.get('definitions') is not None:
            fields['definitions'] = '{not json'
        await original(self, ctx, kind, **fields)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(RunWriter, 'event', garbling_writer)
        run_id = await recorded.record(build(recorded.persistence()))
    report = await replay_run(build(None), run_id, reader=await recorded.reader())
    assert report.outcome == 'matched' and report.notes, report.text()


async def test_a_delegate_tree_replays_with_the_delegates_recorded_result(recorded: Recorded) -> None:
    persistence = recorded.persistence()
    helper = Agent(
        FunctionModel(lambda m, i: ModelResponse(parts=[TextPart('helped')])), capabilities=[persistence]
    )

    async def lookup(topic: str) -> str:
        return (await helper.run(f'help with {topic}')).output

    run_id = await recorded.record(build(persistence, lookup=lookup))
    reader = await recorded.reader()
    assert len(await reader.run_tree(run_id)) == 3  # the run and its two delegates
    calls: list[str] = []

    def must_not_run(topic: str) -> str:
        calls.append(topic)
        return 'x'

    report = await replay_run(build(None, lookup=must_not_run), run_id, reader=reader)
    assert report.outcome == 'matched' and calls == [], report.text()


async def test_with_live_tools_a_delegate_is_replayed_against_its_own_recording(recorded: Recorded) -> None:
    persistence = recorded.persistence()
    helper = Agent(
        FunctionModel(lambda m, i: ModelResponse(parts=[TextPart('helped')])),
        instructions='Help.',
        capabilities=[persistence],
    )

    async def lookup(topic: str) -> str:
        return (await helper.run(f'help with {topic}')).output

    run_id = await recorded.record(build(persistence, lookup=lookup))
    reader = await recorded.reader()
    stored = len(recorded.log.records)

    def refuse(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise AssertionError('the delegate is replayed: its model is never called')

    def replayed_with(instructions: str) -> Agent[None, str]:
        later = Agent(FunctionModel(refuse), instructions=instructions, capabilities=[recorded.persistence()])

        async def lookup(topic: str) -> str:
            return (await later.run(f'help with {topic}')).output

        return build(None, lookup=lookup)

    report = await replay_run(replayed_with('Help.'), run_id, reader=reader, tools='live')
    assert report.outcome == 'matched', report.text()
    changed = await replay_run(replayed_with('Help briefly.'), run_id, reader=reader, tools='live')
    divergence = changed.divergence
    assert divergence is not None, changed.text()
    assert (divergence.step, divergence.kind) == (1, 'instructions')
    (first_delegate, _) = [r.run_id for r in await reader.run_tree(run_id) if r.parent_run_id == run_id]
    assert divergence.detail.startswith(f'in delegate {first_delegate}: ')
    assert len(recorded.log.records) == stored  # neither the run nor its delegates wrote


async def test_an_offloaded_image_is_served_exactly(recorded: Recorded, tmp_path: Path) -> None:
    image = BinaryContent(b'\x89PNG\r\n\x1a\n' + bytes(range(256)) * 40, media_type='image/png')
    run_id = await recorded.record(build(recorded.persistence()), ['what is this?', image])
    reader = await recorded.reader()
    assert [p for p in (tmp_path / 'media').rglob('*') if p.is_file()]  # the image was offloaded
    recording = await load_recording(reader, run_id)
    prompt = recording.user_prompt
    assert isinstance(prompt, list) and (prompt[1].data, prompt[1].media_type) == (image.data, 'image/png')
    report = await replay_run(build(None), run_id, reader=reader)
    assert report.outcome == 'matched', report.text()


async def test_a_run_that_crashed_mid_tool_replays_up_to_the_call_in_doubt(recorded: Recorded) -> None:
    crashed: list[Any] = []
    persistence = recorded.persistence()

    async def work(n: int) -> int:  # the process dies in here: the log holds what was written before
        crashed.extend(recorded.log.records)
        raise RuntimeError('killed')  # what follows in the log is cut off below

    with pytest.raises(RuntimeError, match='killed'):
        await recorded.record(build(persistence, work=work))
    prefix = MemoryProjection(SimpleNamespace(records=crashed, settings=recorded.log.settings))  # type: ignore[arg-type]
    await prefix.wait_for()
    reader = ProjectionReader(prefix.shard, media_store=recorded.media)
    (run,) = await reader.list_runs()
    (effect,) = await reader.list_unresolved_tool_effects(run.run_id)
    assert effect.tool_name == 'work'
    ran: list[int] = []

    def work_live(n: int) -> int:
        ran.append(n)
        return n

    report = await replay_run(build(None, work=work_live), run.run_id, reader=reader, tools='live')
    assert report.outcome == 'in_doubt' and report.ok and ran == [], report.text()
    assert report.steps == 2 and report.detail.startswith('the recording ends at step 3')
    state = 'unknown_after_crash' if effect.unknown_after_crash else 'in flight'  # its run is not stale yet
    assert f"tool 'work' ({effect.tool_call_id}, {state}) started and no recorded end" in report.detail


async def test_a_run_that_failed_in_a_tool_replays_to_the_failure(recorded: Recorded) -> None:
    def work(n: int) -> int:
        raise RuntimeError('disk on fire')

    with pytest.raises(RuntimeError, match='disk on fire'):
        await recorded.record(build(recorded.persistence(), work=work))
    reader = await recorded.reader()
    (run,) = await reader.list_runs()
    assert run.status == 'failed'
    report = await replay_run(build(None, work=work), run.run_id, reader=reader)
    assert report.outcome == 'matched' and report.steps == 3, report.text()
    assert report.detail == "the recorded call 'work' (call-2) raised: RuntimeError('disk on fire')"
    live = await replay_run(build(None, work=work), run.run_id, reader=reader, tools='live')
    assert live.outcome == 'matched' and 'raised at step 3, as recorded' in live.detail, live.text()
    fixed = await replay_run(build(None), run.run_id, reader=reader, tools='live')  # the tool works now
    divergence = fixed.divergence
    assert divergence is not None and (divergence.step, divergence.kind) == (3, 'tool_result')
    assert divergence.replayed == 6


async def test_an_unknown_run_is_reported_not_replayed(recorded: Recorded) -> None:
    await recorded.record(build(recorded.persistence()))
    report = await replay_run(build(None), 'tides-nope', reader=await recorded.reader())
    assert report.outcome == 'unreplayable' and not report.ok and 'no run' in report.detail


async def test_a_fork_serves_the_recording_to_its_step_then_a_live_model_writes_a_new_run(
    recorded: Recorded,
) -> None:
    run_id = await recorded.record(build(recorded.persistence()))
    reader = await recorded.reader()
    asked: list[int] = []

    def newer_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked.append(sum(isinstance(m, ModelResponse) for m in messages))
        return ModelResponse(parts=[TextPart('the moon pulls the sea')])  # answers at once

    report = await fork_run_from_step(
        build(recorded.persistence()),  # its own StepPersistence stays muted: the fork writes once
        run_id,
        reader=reader,
        from_step=3,
        model=FunctionModel(newer_model),
        log=recorded.log,
    )
    assert report.outcome == 'forked' and report.ok and report.steps == 2, report.text()
    assert asked == [2]  # the live model was asked once, at step 3, after two recorded responses
    fork = report.forked_run_id
    assert fork is not None and fork != run_id
    reader = await recorded.reader()
    run = await reader.require_run(fork)
    assert run.status == 'completed' and run.agent_name == 'tides'
    assert (run.metadata[FORKED_FROM], run.metadata[FORKED_AT_STEP]) == (run_id, '3')
    original = await load_recording(reader, run_id)
    forked = await load_recording(reader, fork)
    assert len(forked.responses) == 3 and forked.responses[:2] == original.responses[:2]  # identical state
    assert forked.responses[2].parts[0].content == 'the moon pulls the sea'  # type: ignore[union-attr]
    assert len(await reader.list_runs()) == 2  # the recorded run and the fork: nothing else written
    transport = httpx.ASGITransport(app=app_for(Settings(), reader=reader))
    async with httpx.AsyncClient(transport=transport, base_url='http://explorer') as client:
        page = (await client.get(f'/runs/{fork}')).text
        origin = (await client.get(f'/runs/{run_id}')).text
    assert f'forked from <a href="/runs/{run_id}">{run_id}</a> at step 3' in page  # the fork links its origin
    assert 'class="forks"' in origin and f'/runs/{fork}' in origin.split('class="forks"')[1].split('</dd>')[0]
