"""CLI tables in 120 columns with the ids people really have, `--wide` in full, and one way to
shorten an id (`stepstream.ids.short_id`), the explorer's too (issue 51)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepstream.console._conversations import conversations_table
from stepstream.console._deferred import waiting_table
from stepstream.console._fit import WIDTH, fit, table
from stepstream.console._render import (
    UnresolvedEffect,
    events_table,
    ledger,
    runs_table,
    tree,
    unresolved_table,
)
from stepstream.console._timeline import timeline
from stepstream.ids import SHORT_ID_WIDTH, short_id
from stepstream.readmodel import Conversation, WaitingCall
from stepstream.schemas import EffectResolution, RunRecord, RunUsage, StepEvent, ToolEffectRecord

pytestmark = pytest.mark.fast

T0 = datetime(2026, 12, 5, 6, 0, 0, 123000, tzinfo=UTC)
SHARED = '019ae8c2-5b1e-7c3d-9f40-'
"""The start two UUIDv7 run ids made in the same millisecond share (their time, then their version)."""
TRIAGE = 'customer-support-triage'
RESEARCH = 'knowledge-base-researcher'
BOSS = f'{TRIAGE}-{SHARED}0a1b2c3d4e5f'
CHILD = f'{RESEARCH}-{SHARED}9f8e7d6c5b4a'
SIBLING = f'{RESEARCH}-{SHARED}1234567890ab'
CONVERSATION = 'conv-8d3f1c2a-77b4-4e0f-9a61-3c5e2d1f0b9a'
WRITER = 'worker-host-eu-west-1a-pid-48213-7f3e9c2b'
CALL = 'call_9f8e7d6c5b4a3f2e1d0c9b8a7f6e'
KEY = f'refund:{CHILD}:{CALL}'


def run(run_id: str, agent: str, parent: str | None = None, **more: object) -> RunRecord:
    usage = RunUsage(model_requests=3, input_tokens=123456, output_tokens=7890, cost_usd='0.4123')
    fields: dict[str, object] = {'chain': 'intact', **more}
    return RunRecord(
        run_id=run_id,
        agent_name=agent,
        parent_run_id=parent,
        conversation_id=CONVERSATION,
        status='completed',
        started_at=T0,
        registration_id=WRITER,
        event_count=123,
        usage=usage,
        **fields,  # type: ignore[arg-type]
    )


RUNS = [
    run(BOSS, TRIAGE),
    run(
        CHILD, RESEARCH, BOSS, parent_expired=True, chain='broken', chain_break_seq=17, gaps=[(3, 3), (7, 9)]
    ),
    run(SIBLING, RESEARCH, BOSS),
]


def effect(**more: object) -> ToolEffectRecord:
    base: dict[str, object] = {
        'run_id': CHILD,
        'tool_call_id': CALL,
        'tool_name': 'issue_refund_to_customer_account',
        'status': 'started',
        'started_at': T0,
        'idempotency_key': KEY,
        'effect_summary': 'refund of 120.00 EUR to the card ending 4242 for order 2026-11-30-000123',
    }
    return ToolEffectRecord(**{**base, **more})  # type: ignore[arg-type]


ANSWER = EffectResolution(
    resolution='did_not_happen',
    resolved_by='alice.operator@example.com',
    writer_id=WRITER,
    resolved_at=T0 + timedelta(minutes=5),
    note='the payment provider shows no refund for this order on the day; ' * 3,
    resolves_seq=4,
    applied=True,
)
EFFECTS = [
    effect(status='resolved', resolution=ANSWER, resolutions=[ANSWER], ended_at=T0 + timedelta(minutes=5)),
    effect(
        tool_call_id=CALL + 'x',
        status='deferred',
        deferral='approval',
        args='{"order": "2026-11-30-000123", "amount": "120.00", "currency": "EUR", "reason": "damaged"}',
        error='x' * 80,
    ),
]
EVENTS = [
    StepEvent(run_id=CHILD, seq=0, writer_id=WRITER, timestamp=T0, kind='run_started'),
    StepEvent(
        run_id=CHILD,
        seq=4,
        writer_id=WRITER,
        timestamp=T0,
        kind='tool_call_failed',
        tool_call_id=CALL,
        tool_name='issue_refund_to_customer_account',
        error='PaymentProviderTimeout: the provider did not answer within 30 s; retry with the same key ' * 2,
        duration_us=30_000_123,
    ),
]


def every_table(wide: bool) -> dict[str, str]:
    waiting = WaitingCall(
        effect=EFFECTS[1], agent_name=RESEARCH, conversation_id=CONVERSATION, waiting_since=T0
    )
    conversation = Conversation(
        conversation_id=CONVERSATION,
        runs=3,
        last_activity=T0,
        latest_run=RUNS[2],
        usage=RUNS[0].usage,
        title='Refund for a damaged parcel, order 2026-11-30-000123, asked by the customer by e-mail',
        archived=True,
    )
    return {
        'runs': runs_table(RUNS, wide=wide),
        'tree': tree(RUNS, wide=wide),
        'events': events_table(timeline(EVENTS, EFFECTS[:1]), wide=wide),
        'effects': ledger(EFFECTS, wide=wide),
        'unresolved': unresolved_table([UnresolvedEffect(e, 'cancelled') for e in EFFECTS], wide=wide),
        'deferred': waiting_table([waiting], T0 + timedelta(hours=3), wide=wide),
        'conversations': conversations_table([conversation], wide=wide),
    }


def test_every_table_fits_120_columns_with_long_ids() -> None:
    for name, text in every_table(wide=False).items():
        wider = [line for line in text.splitlines() if len(line) > WIDTH]
        assert not wider, f'{name}: {wider}'
        assert BOSS not in text and CHILD not in text, name  # shortened, not in full
    runs = every_table(wide=False)['runs']
    assert short_id(CHILD) in runs and short_id(BOSS) in runs and '123456/7890' in runs
    assert 'chain broken@17; gaps 3,7-9; parent expired'[:10] in runs  # what is amiss, in one note
    calm = runs_table([RUNS[0], RUNS[2]])
    assert calm.splitlines()[0].split() == [
        'run_id',
        'agent',
        'status',
        'parent',
        'started',
        'tokens',
        'cost',
    ]
    assert TRIAGE in calm and RESEARCH[:20] in calm  # the agent gives way first, and only as needed


def test_wide_shows_every_id_and_column_in_full() -> None:
    tables = every_table(wide=True)
    assert all(run_id in tables['runs'] for run_id in (BOSS, CHILD, SIBLING, CONVERSATION))
    assert f'{BOSS} (expired)' in tables['runs'] and '2026-12-05 06:00:00.123' in tables['runs']
    assert 'conversation' in tables['runs'].splitlines()[0] and 'tokens' in tables['runs'].splitlines()[0]
    assert CHILD in tables['tree'] and CALL in tables['effects'] and KEY in tables['effects']
    assert EFFECTS[0].effect_summary in tables['unresolved']  # type: ignore[operator]
    assert EVENTS[1].error.strip() in tables['events']  # type: ignore[union-attr]
    assert CONVERSATION in tables['deferred'] and CONVERSATION in tables['conversations']
    assert max(len(line) for text in tables.values() for line in text.splitlines()) > WIDTH


def test_ids_sharing_a_long_start_shorten_differently() -> None:
    assert CHILD[:40] == SIBLING[:40]
    assert short_id(CHILD) != short_id(SIBLING)
    assert short_id(CHILD) == 'knowledge-base-…6c5b4a'
    assert len(short_id(CHILD)) == SHORT_ID_WIDTH and short_id(CHILD) == short_id(CHILD)
    lines = runs_table(RUNS).splitlines()[2:]
    assert len({line.split()[0] for line in lines}) == 3


def test_fit_cuts_the_columns_it_may_in_their_order() -> None:
    text = fit(['a', 'b', 'c'], [('x' * 150, 'y' * 80, 'z' * 10)], wide=False, cut=('b', 'a'))
    _, _, row = text.splitlines()
    a, b, c = row.split()
    assert len(row) == WIDTH and c == 'z' * 10  # a column not to cut stays whole
    assert b == 'yyyyy…' and a == 'x' * 99 + '…'  # b gave way to its least first, then a
    assert fit(['a', 'b'], [('x' * 50, 'y' * 50)], wide=False, cut=('a',)) == table(
        ['a', 'b'], [('x' * 50, 'y' * 50)]
    )
    assert fit(['a'], [('x' * 200,)], wide=True, cut=('a',)).endswith('x' * 200)


IDS = st.text(st.sampled_from('abcdef0123456789-_.'), min_size=1, max_size=80)


@given(st.text(max_size=SHORT_ID_WIDTH))
def test_a_short_id_is_shown_as_it_is(value: str) -> None:
    assert short_id(value) == value


@given(IDS, IDS, st.text(st.sampled_from('abcdef0123456789'), min_size=6, max_size=6))
def test_ids_that_differ_in_their_tail_stay_apart(start: str, other_start: str, tail: str) -> None:
    one, two = start + tail, other_start + tail[::-1]
    if tail != tail[::-1]:  # the last six differ: so do the short forms
        assert short_id(one) != short_id(two)
    assert len(short_id(one)) <= SHORT_ID_WIDTH and short_id(one).endswith(one[-6:])
    assert short_id(one).startswith(one[: min(len(one), SHORT_ID_WIDTH - 7)])


def test_the_explorer_shortens_ids_with_the_same_function_the_whole_in_the_tooltip() -> None:
    from stepstream.serve._explorer import templates

    macros = templates.env.get_template('_macros.html').module
    link = str(macros.run_link({'run_id': CHILD}))  # type: ignore[attr-defined]
    assert f'title="{CHILD}">{short_id(CHILD)}</a>' in link and f'href="/runs/{CHILD}"' in link
    assert f'>{short_id(SIBLING)}<' in str(macros.run_link({'run_id': SIBLING}))  # type: ignore[attr-defined]
    assert '>publisher-crash</a>' in str(macros.run_link({'run_id': 'publisher-crash'}))  # type: ignore[attr-defined]
