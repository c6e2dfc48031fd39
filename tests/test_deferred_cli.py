"""`stepstream deferred` and the decision commands' arguments, over the in-memory log and projection.

The view is the console's (the same function the CLI runs and the read service can run); the
commands' flags are checked before anything is opened, so a bad `--args` or `--result` is a usage
error without a broker. The commands against Tansu are tests/test_decide_cli.py's.
"""

from __future__ import annotations

import argparse
import json

import pytest

from stepstream import schemas
from stepstream.cli import _views as cli_views
from stepstream.cli import main
from stepstream.cli._decide import _report as report
from stepstream.console import ViewArgs, show, status_text
from stepstream.console._deferred import waited
from stepstream.errors import NotFound
from stepstream.producer import InMemoryLog, decision_for
from stepstream.settings import Settings

from deferred_runs import DEFERRALS, REFUND_ARGS, run_until_waiting
from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast


def test_the_kinds_are_the_schemas() -> None:
    assert set(cli_views.DEFERRALS) == schemas.DEFERRALS


def test_a_wait_reads_in_the_largest_units() -> None:
    assert [waited(s) for s in (0, 42, 423, 5 * 3600 + 720, 3 * 86400 + 4 * 3600 + 59)] == [
        '0s',
        '42s',
        '7m 3s',
        '5h 12m',
        '3d 4h',
    ]


async def test_the_deferred_view_lists_filters_and_counts_what_waits() -> None:
    log = InMemoryLog()
    projection = MemoryProjection(log)
    await run_until_waiting(log, 'w-1')
    await run_until_waiting(log, 'w-2', agent_name='other')
    await projection.wait_for()
    reader, settings = projection.reader(), Settings()

    found = json.loads(await show('deferred', ViewArgs(json=True), reader, settings))
    assert len(found) == 6 and {c['run_id'] for c in found} == {'w-1', 'w-2'}
    assert {c['tool_name']: c['kind'] for c in found} == DEFERRALS
    refund = next(c for c in found if c['tool_name'] == 'refund' and c['run_id'] == 'w-1')
    assert refund['args'] == REFUND_ARGS and refund['agent_name'] == 'refunds'
    assert refund['conversation_id'] == 'conv-w-1' and refund['waited_seconds'] >= 0

    only = ViewArgs(json=True, deferral='approval', agent_name='other')
    assert [
        (c['run_id'], c['tool_call_id']) for c in json.loads(await show('deferred', only, reader, settings))
    ] == [('w-2', 'call-refund')]
    newest = json.loads(
        await show('deferred', ViewArgs(json=True, newest_first=True, limit=1), reader, settings)
    )
    assert [c['run_id'] for c in newest] == ['w-2']

    text = await show('deferred', ViewArgs(conversation_id='conv-w-1', limit=2), reader, settings)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ['run_id', 'tool_call_id', 'tool', 'kind']
    assert len(lines) == 5 and lines[-1].startswith('... more wait: the next page is `stepstream deferred')
    assert 'no tool call waits' in await show('deferred', ViewArgs(agent_name='nobody'), reader, settings)

    status = await reader.status()
    text = status_text(status, {}, {}, settings)
    assert 'tool calls waiting for a decision: 6 (approval 2, external 2, question 2;' in text


async def test_the_deferred_view_pages_with_the_cursor_each_page_ends_with() -> None:
    log = InMemoryLog()
    projection = MemoryProjection(log)
    for run in ('p-1', 'p-2', 'p-3'):
        await run_until_waiting(log, run)
    await projection.wait_for()
    reader, settings = projection.reader(), Settings()
    every = [
        (c['run_id'], c['tool_call_id'])
        for c in json.loads(await show('deferred', ViewArgs(json=True), reader, settings))
    ]
    assert len(every) == 9

    for newest in (False, True):
        seen: list[tuple[str, str]] = []
        after, pages = None, 0
        while True:
            asked = ViewArgs(limit=4, after=after, newest_first=newest)
            text = await show('deferred', asked, reader, settings)
            page = json.loads(
                await show(
                    'deferred',
                    ViewArgs(json=True, limit=4, after=after, newest_first=newest),
                    reader,
                    settings,
                )
            )
            seen += [(c['run_id'], c['tool_call_id']) for c in page]
            pages += 1
            *_, last = text.splitlines()
            if not last.startswith('... more wait'):
                break
            after = last.split('--after ')[1].split('`')[0]
            assert after == page[-1]['cursor']  # the text's next page starts where the JSON's ends
        assert (seen, pages) == (every[::-1] if newest else every, 3)

    with pytest.raises(NotFound, match='not a place in the list of waiting calls'):
        await show('deferred', ViewArgs(after='not-a-cursor'), reader, settings)


@pytest.mark.parametrize(
    ('argv', 'said'),
    [
        (['approve', 'r', 'c', '--args', '{not json'], '--args must be JSON'),
        (['approve', 'r', 'c', '--args', '[1, 2]'], '--args must be a JSON object'),
        (['complete', 'r', 'c', '--result', 'nope'], '--result must be JSON'),
    ],
)
def test_arguments_that_are_not_json_are_a_usage_error(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    'argv',
    [['deny', 'r', 'c'], ['complete', 'r', 'c'], ['complete', 'r', 'c', '--result', '1', '--error', 'x']],
)
def test_a_denial_says_why_and_a_completion_gives_one_answer(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2


async def test_a_decision_that_came_second_exits_1_naming_the_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = InMemoryLog()
    projection = MemoryProjection(log)
    await run_until_waiting(log, 'w-3')
    await projection.wait_for()
    reader = projection.reader()
    waiting = await reader.get_tool_effect('w-3', 'call-refund')
    assert waiting is not None
    writer = 'stepstream-cli@here:1'
    first = decision_for(waiting, decision='approved', operator='alice', writer_id=writer, note='fine')
    second = decision_for(waiting, decision='denied', operator='bob', writer_id=writer, message='no')
    await log.wait_acked([await log.append(first), await log.append(second)])  # both read it waiting
    await projection.wait_for()
    decided = await reader.get_tool_effect('w-3', 'call-refund')
    plain, settings = argparse.Namespace(json=False), Settings()

    assert report(plain, settings, second, decided) == 1
    err = capsys.readouterr().err
    assert 'an earlier decision on call-refund of w-3 stands: approved by alice at ' in err
    assert '(fine); yours (denied by bob) is kept as history only' in err
    assert report(plain, settings, first, decided) == 0
    assert capsys.readouterr().out.startswith("approved call-refund of w-3 by alice: note 'fine'")
    assert report(plain, settings, first, None) == 0  # not applied in time: written, shown once applied
    assert 'the views show it once the projector applies it' in capsys.readouterr().out
    assert report(argparse.Namespace(json=True), settings, second, decided) == 1
    answer = json.loads(capsys.readouterr().out)
    assert (answer['stands'], answer['decision']['resolved_by']) == (False, 'alice')
