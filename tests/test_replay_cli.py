"""`stepstream replay` as a CI job runs it: runs recorded on the broker, projected, then replayed.

The agents replayed are imported by the command from a module in its working directory
(`--agent MODULE:ATTR`), as a team's CI imports its own code.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from pydantic_ai import Agent
from test_cli import cli

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.replay import assert_replays, recorded_runs

from waits import until

pytestmark = [pytest.mark.broker, pytest.mark.once]  # reads the projection: the same on either broker


async def until_run(projector: Projector, run_id: str) -> None:
    async def ended() -> bool:
        run = await ProjectionReader.of(projector).get_run(run_id)
        return run is not None and run.status == 'completed'

    await until(ended, f'the fork {run_id} to be projected')


AGENTS = """
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import FunctionModel


def planned(messages, info):
    done = sum(isinstance(m, ModelResponse) for m in messages)
    if done < 2:
        return ModelResponse(parts=[ToolCallPart('lookup', {'topic': f'topic-{done}'}, f'call-{done}')])
    return ModelResponse(parts=[TextPart('done')])


class Reroute(AbstractCapability):
    async def after_model_request(self, ctx, *, request_context, response):
        for part in response.parts:
            if isinstance(part, ToolCallPart) and part.args_as_dict() == {'topic': 'topic-0'}:
                part.args = {'topic': 'topic-9'}
        return response


def make(instructions, capabilities=()):
    agent = Agent(FunctionModel(planned), instructions=instructions, capabilities=list(capabilities))

    @agent.tool_plain
    def lookup(topic: str) -> str:
        return f'notes on {topic}'

    return agent


agent = make('Answer from the tools.')
newer = FunctionModel(lambda messages, info: ModelResponse(parts=[TextPart('newer answer')]))
changed = make('Answer in one word.')
rerouted = make('Answer from the tools.', [Reroute()])
not_an_agent = 42
"""


async def test_replay_prints_matches_and_divergences_and_exits_by_them(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path, tmp_path: Path
) -> None:
    (tmp_path / 'replay_agents.py').write_text(AGENTS)
    namespace: dict[str, object] = {}
    exec(AGENTS, namespace)  # the same code, recorded here through StepPersistence
    recorded = namespace['agent']
    assert isinstance(recorded, Agent)
    runs = []
    for i in range(3):
        result = await recorded.run(
            'go',
            conversation_id=f'conv-{i}',
            capabilities=[StepPersistence(log=event_log, agent_name='tides')],
        )
        runs.append(f'tides-{result.run_id}')
    await projector.wait_for(await event_log.flush())

    code, out, err = await cli(settings, db_path, 'replay', runs[0], '--agent', 'replay_agents:agent')
    assert code == 0, err
    assert out.startswith(f'{runs[0]}: matched after 3 step(s), tools recorded')
    code, out, _ = await cli(
        settings, db_path, 'replay', runs[0], '--agent', 'replay_agents:agent', '--tools', 'live', '--json'
    )
    report = json.loads(out)
    assert code == 0 and (report['outcome'], report['steps'], report['tools']) == ('matched', 3, 'live')

    code, out, _ = await cli(
        settings, db_path, 'replay', runs[1], '--agent', 'replay_agents:changed', '--json'
    )
    report = json.loads(out)
    assert code == 1 and report['outcome'] == 'diverged'
    divergence = report['divergence']
    assert (divergence['step'], divergence['kind']) == (1, 'instructions')
    assert '+"Answer in one word."' in divergence['diff']

    code, out, _ = await cli(
        settings,
        db_path,
        'replay',
        '--agent-name',
        'tides',
        '--last',
        '2',
        '--agent',
        'replay_agents:changed',
    )
    lines = out.splitlines()
    assert code == 1
    assert lines[:2] == [
        f'diverged     {runs[2]} at step 1: instructions',
        f'diverged     {runs[1]} at step 1: instructions',
    ]
    assert lines[2] == '2 run(s): 0 matched, 2 diverged, 0 stopped in doubt, 0 erased'
    # A capability now rewrites a call the model made (issue 47): the batch fails, naming the call's step.
    code, out, _ = await cli(
        settings,
        db_path,
        'replay',
        '--agent-name',
        'tides',
        '--last',
        '2',
        '--agent',
        'replay_agents:rerouted',
    )
    assert code == 1, out
    assert out.splitlines()[:2] == [
        f'diverged     {runs[2]} at step 1: tool_arguments',
        f'diverged     {runs[1]} at step 1: tool_arguments',
    ]
    code, out, _ = await cli(
        settings, db_path, 'replay', runs[0], '--agent', 'replay_agents:rerouted', '--tools', 'live', '--json'
    )
    divergence = json.loads(out)['divergence']
    assert code == 1 and (divergence['kind'], divergence['tool_name']) == ('tool_arguments', 'lookup')
    assert (divergence['recorded'], divergence['replayed']) == ({'topic': 'topic-0'}, {'topic': 'topic-9'})
    code, out, _ = await cli(
        settings, db_path, 'replay', '--conversation', 'conv-0', '--agent', 'replay_agents:agent'
    )
    assert code == 0 and out.splitlines()[-1].startswith('1 run(s): 1 matched')

    # The pytest helper: recorded runs as parametrized cases, each replayed (synchronous, as at collection).
    here = settings.replace(db_path=str(db_path))
    assert await asyncio.to_thread(recorded_runs, agent_name='tides', last=2, settings=here) == [
        runs[2],
        runs[1],
    ]
    matched = await asyncio.to_thread(assert_replays, recorded, runs[0], settings=here)
    assert matched.outcome == 'matched'
    with pytest.raises(AssertionError, match='step 1: instructions'):
        await asyncio.to_thread(assert_replays, namespace['changed'], runs[0], settings=here)

    # A fork at step 2 with another model: a new run, linked to the recorded one by its metadata.
    code, out, err = await cli(
        settings,
        db_path,
        'replay',
        runs[0],
        '--agent',
        'replay_agents:agent',
        '--from-step',
        '2',
        '--model',
        'replay_agents:newer',
        '--json',
    )
    report = json.loads(out)
    assert code == 0 and report['outcome'] == 'forked', (out, err)
    await until_run(projector, report['forked_run_id'])
    fork = await ProjectionReader.of(projector).require_run(report['forked_run_id'])
    assert fork.metadata['stepstream.forked_from'] == runs[0] and fork.status == 'completed'
    code, _, err = await cli(
        settings, db_path, 'replay', runs[0], '--agent', 'replay_agents:agent', '--from-step', '2'
    )
    assert code == 2 and '--from-step and --model go together' in err

    for args, says in [
        (['replay', runs[0], '--agent', 'replay_agents:not_an_agent'], 'is a int, not a pydantic_ai Agent'),
        (['replay', runs[0], '--agent', 'no_such_module:agent'], "cannot import 'no_such_module'"),
        (['replay', runs[0], '--agent', 'replay_agents'], 'must be MODULE:ATTR'),
        (['replay', '--agent', 'replay_agents:agent'], 'give RUN, or select runs'),
        (
            [
                'replay',
                runs[0],
                '--agent',
                'replay_agents:agent',
                '--from-step',
                '2',
                '--model',
                'nosuch:model',
            ],
            "--model 'nosuch:model' is neither MODULE:ATTR nor a model Pydantic AI knows",
        ),
        (
            ['replay', runs[0], '--agent-name', 'tides', '--agent', 'replay_agents:agent'],
            'give RUN, or select runs',
        ),
    ]:
        code, _, err = await cli(settings, db_path, *args)
        assert code == 2 and says in err, (args, err)
