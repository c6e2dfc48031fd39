"""Conversations over a real broker and projection (3 partitions: a conversation's runs in several
shards): `stepstream conversations` lists them newest activity first, pages, and agrees with the
runs it sums, as a user runs it (decision 0062)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic_ai import Agent
from test_decide_cli import cli

from stepstream import Settings
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader, continue_conversation
from stepstream.topics import murmur2_partition

from agents import answers

pytestmark = pytest.mark.broker

RUNS = [('a-1', 'conv-a'), ('a-2', 'conv-a'), ('a-3', 'conv-a'), ('b-1', 'conv-b'), ('a-4', 'conv-a')]


async def test_the_cli_lists_conversations_whose_runs_are_in_several_shards(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    assert len({murmur2_partition(run.encode(), 3) for run, c in RUNS if c == 'conv-a'}) > 1
    for run_id, conversation in RUNS:
        agent = Agent(
            answers(f'answer {run_id}'), capabilities=[StepPersistence(log=event_log, run_id=run_id)]
        )
        await agent.run(f'question {run_id}', conversation_id=conversation)
    await projector.wait_for(await event_log.flush())

    code, out, err = await cli(settings, db_path, 'conversations', '--json')
    assert code == 0, err
    found = json.loads(out)
    assert [(c['conversation_id'], c['runs'], c['latest_run_id']) for c in found] == [
        ('conv-a', 4, 'a-4'),
        ('conv-b', 1, 'b-1'),
    ]
    assert {c['last_status'] for c in found} == {'completed'} and not any(c['live'] for c in found)
    assert found[0]['usage']['model_requests'] == 4

    code, out, _ = await cli(settings, db_path, 'conversations', '--limit', '1')
    assert code == 0 and 'conv-a' in out and 'conv-b' not in out
    assert f'stepstream conversations --after {found[0]["cursor"]}' in out
    code, out, _ = await cli(settings, db_path, 'conversations', '--after', found[0]['cursor'], '--json')
    assert code == 0 and json.loads(out) == found[1:]
    code, _, err = await cli(settings, db_path, 'conversations', '--after', 'nonsense')
    assert code == 1 and 'not a place in the list of conversations' in err

    code, out, _ = await cli(settings, db_path, 'conversations', '--search', 'QUESTION b', '--json')
    assert code == 0 and [c['conversation_id'] for c in json.loads(out)] == ['conv-b']
    code, out, _ = await cli(settings, db_path, 'conversations', '--search', 'question 3', '--json')
    assert code == 0 and [c['conversation_id'] for c in json.loads(out)] == ['conv-a']  # 'question a-3'

    reader = ProjectionReader.of(projector)
    runs = await reader.list_runs(conversation_id='conv-a', newest_first=True)
    conversation = await reader.get_conversation('conv-a')
    assert conversation is not None and conversation.latest_run == runs[0]
    assert conversation.usage.input_tokens == sum(r.usage.input_tokens for r in runs)
    assert 'answer a-4' in str(await continue_conversation(reader, 'conv-a'))


async def test_the_cli_titles_archives_and_unarchives_a_conversation(
    settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    for run_id, conversation in RUNS[:4]:
        persistence = StepPersistence(log=event_log, run_id=run_id)
        await Agent(answers('ok'), capabilities=[persistence]).run(
            f'q {run_id}', conversation_id=conversation
        )
    await projector.wait_for(await event_log.flush())
    reader = ProjectionReader.of(projector)

    async def applied(conversation_id: str, **expected: object) -> None:
        await projector.catch_up()  # the CLI's mark, acknowledged before it exited, is applied
        found = await reader.get_conversation(conversation_id)
        assert found is not None
        assert {k: getattr(found, k) for k in expected} == expected

    code, out, err = await cli(settings, db_path, 'conversation', 'title', 'conv-a', 'Orders of May')
    assert code == 0, err
    assert "conversation conv-a titled 'Orders of May'" in out and 'keyed by run a-3' in out
    await applied('conv-a', title='Orders of May')
    code, _, err = await cli(settings, db_path, 'conversation', 'archive', 'conv-b')
    assert code == 0, err
    await applied('conv-b', archived=True)
    code, out, _ = await cli(settings, db_path, 'conversations', '--archived', 'false', '--json')
    assert [(c['conversation_id'], c['title']) for c in json.loads(out)] == [('conv-a', 'Orders of May')]
    code, out, _ = await cli(settings, db_path, 'conversations', '--archived', 'true', '--json')
    assert [c['conversation_id'] for c in json.loads(out)] == ['conv-b']
    code, _, err = await cli(settings, db_path, 'conversation', 'unarchive', 'conv-b')
    assert code == 0, err
    await applied('conv-b', archived=False)
    code, _, err = await cli(settings, db_path, 'conversation', 'archive', 'nowhere')
    assert code == 1 and "no run of conversation 'nowhere'" in err
