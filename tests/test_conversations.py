"""Conversations as a view (decision 0062): each shard's share of a conversation is what its runs'
states say, whatever the batches and the retention drops, and the listing across shards gives each
conversation once, newest activity first, with what `list_runs(conversation_id=...)` says of it.

The logs are `test_apply_properties.py`'s generated ones (every run in one of two conversations,
hostile records among them); the store-wide properties there (a pure function of the log, batch
cuts change nothing) hold these keys too, since they compare every key.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import defaultdict
from collections.abc import Awaitable
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_ai.messages import (
    ImageUrl,
    ModelMessagesTypeAdapter,
    ModelRequest,
    SystemPromptPart,
    UserPromptPart,
)
from test_apply_properties import (
    PARTITIONS,
    SEQ_JUMP,
    STORES,
    T0,
    TOPICS,
    Op,
    apply_with_crashes,
    logs,
    make_log,
)
from test_retention import spread

from stepstream.errors import ConversationLive, NotFound
from stepstream.producer import conversation_mark
from stepstream.projector._apply import EVENTS, Applier, SourceRecord
from stepstream.projector._conversations import first_prompt
from stepstream.projector._listing import latest
from stepstream.readmodel import (
    ConversationsNotIndexed,
    ProjectionReader,
    continue_conversation,
    continue_run,
    decode_conversation_cursor,
    encode_conversation_cursor,
)
from stepstream.readmodel._runs import Runs
from stepstream.schemas import MAX_TITLE_CHARS, TITLE_KEY, StepEvent, encode
from stepstream.storage import (
    ACTIVITY,
    CONVERSATION_STATE,
    MAX_PROMPT_CHARS,
    RUN,
    WORD,
    ConversationState,
    MemoryShard,
    RunState,
    words_of,
)
from stepstream.timestamps import micros

pytestmark = pytest.mark.fast

MINUTE = 60_000_000


Items = list[tuple[bytes, bytes]]


def under(items: Items, tag: bytes) -> Items:
    """The items of one keyspace."""
    return [(k, v) for k, v in items if k[:1] == tag]


def shares_said_by_the_runs(items: Items) -> dict[str, ConversationState]:
    """Each conversation's share as the runs' states among `items` (a shard's) say it, computed afresh."""
    shares: dict[str, ConversationState] = {}
    costs: dict[str, list[Decimal]] = defaultdict(list)
    for _, value in under(items, RUN.tag):
        run = RunState.decode(value)
        if run.conversation_id is None:
            continue
        share = shares.setdefault(run.conversation_id, ConversationState(run.conversation_id))
        share.runs += 1
        share.active = max(share.active, latest(run))
        share.latest = max(share.latest, [run.started_at, run.run_id])
        if run.first_prompt is not None:
            place = [run.started_at, run.run_id, run.first_prompt]
            share.prompt = min(share.prompt, place) if share.prompt else place
        for name, mark in run.marks.items():
            setattr(share, name, max(getattr(share, name), mark) if getattr(share, name) else mark)
        for name, n in run.usage.items():
            share.usage[name] = share.usage.get(name, 0) + n
        if run.cost_usd is not None:
            share.priced += 1
            costs[run.conversation_id].append(Decimal(run.cost_usd))
    for conversation_id, spent in costs.items():
        shares[conversation_id].cost_usd = format(sum(spent, Decimal(0)).normalize(), 'f')
    for share in shares.values():
        share.usage = {name: n for name, n in share.usage.items() if n}
    return shares


def check_shares(items: Items) -> None:
    """`CONVERSATION_STATE` and `ACTIVITY` hold exactly what the runs say."""
    expected = shares_said_by_the_runs(items)
    stored = {
        CONVERSATION_STATE.last_str(k): ConversationState.decode(v)
        for k, v in under(items, CONVERSATION_STATE.tag)
    }
    assert stored == expected
    assert {k for k, _ in under(items, ACTIVITY.tag)} == {
        ACTIVITY.key('archived' if s.archived and s.archived[1] else 'open', s.active, s.conversation_id)
        for s in expected.values()
    }
    runs = [RunState.decode(v) for _, v in under(items, RUN.tag)]
    assert {k for k, _ in under(items, WORD.tag)} == {
        WORD.key(word, run.conversation_id, run.run_id)
        for run in runs
        if run.conversation_id is not None
        for word in [*run.prompt_words, *words_of(run.marks.get('title', [0, None])[1])]
    }


@pytest.mark.parametrize('store', STORES)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    generated=logs(),
    data=st.data(),
    seed=st.integers(0, 2**32),
    retain_minutes=st.sampled_from([None, 1, 4, 12]),
)
def test_each_shards_share_is_what_its_runs_say(
    generated: list[Op], data: st.DataObject, seed: int, retain_minutes: int | None, store: str
) -> None:
    """In random batches, with crashes, with and without a retention policy dropping runs."""
    retain_us = None if retain_minutes is None else retain_minutes * MINUTE

    def make_applier() -> Applier:
        return Applier(
            TOPICS,
            partitions=PARTITIONS,
            max_snapshots_per_run=2,
            max_seq_jump=SEQ_JUMP,
            retain_ended_us=retain_us,
        )

    with tempfile.TemporaryDirectory() as path:
        items = apply_with_crashes(path, make_log(spread(generated, data)), seed, store, make_applier)
    check_shares(items)


def shards_of(generated: list[Op]) -> dict[int, MemoryShard]:
    """One shard per partition, each applied from its partition's records (as projectors do)."""
    log = make_log(generated)
    shards = {p: MemoryShard() for p in range(PARTITIONS)}
    for p, shard in shards.items():
        records = [r for (_, partition), seq in sorted(log.items()) if partition == p for r in seq]
        txn, _ = Applier(TOPICS, partitions=PARTITIONS, max_seq_jump=SEQ_JUMP).stage(shard, records)
        txn.commit()
    return shards


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated=logs(), page=st.integers(1, 3), stale_after_s=st.sampled_from([20.0, 1e10]))
def test_the_listing_across_shards_is_what_the_runs_say(
    generated: list[Op], page: int, stale_after_s: float
) -> None:
    shards = shards_of(generated)
    for shard in shards.values():
        check_shares(list(shard.logical_items()))
    reader = ProjectionReader(shards, partitions=PARTITIONS, stale_after_s=stale_after_s)

    async def check() -> None:
        listed = await reader.list_conversations(limit=None)
        paged, after = [], None
        while batch := await reader.list_conversations(limit=page, after=after):
            paged += batch
            after = decode_conversation_cursor(encode_conversation_cursor(batch[-1].cursor))
        assert paged == listed
        ids = [c.conversation_id for c in listed]
        assert len(set(ids)) == len(ids)
        assert [c.cursor for c in listed] == sorted((c.cursor for c in listed), reverse=True)
        every = await reader.list_runs(newest_first=True)
        assert set(ids) == {r.conversation_id for r in every if r.conversation_id is not None}
        for conversation in listed:
            runs = await reader.list_runs(conversation_id=conversation.conversation_id, newest_first=True)
            assert conversation == await reader.get_conversation(conversation.conversation_id)
            assert conversation.runs == len(runs)
            assert conversation.latest_run == runs[0]
            assert conversation.live == (runs[0].status == 'running')
            assert conversation.writer == runs[0].registration_id
            assert conversation.last_activity == max(r.last_record_at for r in runs)
            assert conversation.last_activity >= T0
            for name in ('input_tokens', 'output_tokens', 'model_requests', 'tool_calls'):
                assert getattr(conversation.usage, name) == sum(getattr(r.usage, name) for r in runs)
            costs = [Decimal(r.usage.cost_usd) for r in runs if r.usage.cost_usd is not None]
            expected = None if not costs else sum(costs, Decimal(0))
            got = conversation.usage.cost_usd
            assert (None if got is None else Decimal(got)) == expected
        assert await reader.get_conversation('no such conversation') is None

    asyncio.run(check())


async def outcome(call: Awaitable[object]) -> object:
    """What a call returns, or the type of what it raises."""
    try:
        return await call
    except Exception as exc:
        return type(exc)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated=logs(), stale_after_s=st.sampled_from([20.0, 1e10]))
def test_continuing_a_live_conversation_is_refused_naming_its_run_and_writer(
    generated: list[Op], stale_after_s: float
) -> None:
    """Unless told otherwise; else it is `continue_run` of its latest run. (The generated runs are of
    T0: with a threshold of 20 s none is live, with 1e10 s every running one is.)"""
    reader = ProjectionReader(shards_of(generated), partitions=PARTITIONS, stale_after_s=stale_after_s)

    async def check() -> None:
        for conversation in await reader.list_conversations(limit=None):
            run = conversation.latest_run
            latest = await outcome(continue_run(reader, run_id=run.run_id))
            allowed = continue_conversation(reader, conversation.conversation_id, allow_live=True)
            assert await outcome(allowed) == latest
            if not conversation.live:
                assert await outcome(continue_conversation(reader, conversation.conversation_id)) == latest
                continue
            assert stale_after_s > 20
            with pytest.raises(ConversationLive) as refused:
                await continue_conversation(reader, conversation.conversation_id)
            assert (refused.value.run_id, refused.value.writer) == (run.run_id, run.registration_id)
            assert repr(run.run_id) in str(refused.value) and repr(run.registration_id) in str(refused.value)
        with pytest.raises(NotFound):
            await continue_conversation(reader, 'no such conversation')

    asyncio.run(check())


def test_a_cursor_that_is_not_one_is_not_found() -> None:
    with pytest.raises(NotFound, match='not a place in the list of conversations'):
        decode_conversation_cursor('garbage!')


def test_a_title_is_the_text_of_the_first_user_prompt_cut_and_folded() -> None:
    def messages(*requests: ModelRequest) -> str:
        return ModelMessagesTypeAdapter.dump_json(list(requests)).decode()

    system = ModelRequest(parts=[SystemPromptPart('be brief')])
    asked = ModelRequest(
        parts=[UserPromptPart(['look at', ImageUrl('https://x.test/a.png'), ' this\n  picture'])]
    )
    assert first_prompt(messages(system, asked, ModelRequest(parts=[UserPromptPart('later')]))) == (
        'look at this picture'
    )
    assert first_prompt(messages(ModelRequest(parts=[UserPromptPart('x' * 500)]))) == 'x' * MAX_PROMPT_CHARS
    assert first_prompt(messages(system)) is None
    assert first_prompt('["stepstream-sealed/1", "' + 'a' * 32 + '", "body"]') is None  # sealed: unreadable
    assert first_prompt('not json') is None


TITLES = st.sampled_from(['Orders', 'Refunds', 'orders', 'A' * MAX_TITLE_CHARS])
MARKS = st.lists(
    st.tuples(st.integers(0, 5), st.one_of(st.none(), TITLES), st.one_of(st.none(), st.booleans())).filter(
        lambda m: m[1:] != (None, None)
    ),
    max_size=8,
)


def mark_record(
    offset: int, minute: int, title: str | None, archived: bool | None, run_id: str = 'run-m'
) -> SourceRecord:
    """A `conversation_marked` record of conversation `conv-m`, keyed by `run_id`, at minute `minute`."""
    mark = replace(
        conversation_mark(
            run_id=run_id, conversation_id='conv-m', title=title, archived=archived, writer_id='op'
        ),
        timestamp=T0 + timedelta(minutes=minute),
    )
    return SourceRecord(EVENTS, 0, offset, run_id.encode(), encode(mark))


def started_record(run_id: str, conversation_id: str) -> SourceRecord:
    started = StepEvent(
        run_id=run_id,
        seq=0,
        writer_id='w',
        timestamp=T0,
        kind='run_started',
        agent_name=None,
        conversation_id=conversation_id,
    )
    return SourceRecord(EVENTS, 0, 0, run_id.encode(), encode(started))


@settings(max_examples=100, deadline=None)
@given(marks=MARKS, data=st.data())
def test_the_newest_title_and_archived_flag_stand_whatever_the_order_and_the_batches(
    marks: list[tuple[int, str | None, bool | None]], data: st.DataObject
) -> None:
    """Marks in any order and batch cuts leave the same share: the newest of each by time (the
    greater value on a tie), a duplicate changing nothing; the reader shows them."""
    order = data.draw(st.permutations(range(len(marks))))
    records = [started_record('run-m', 'conv-m')]
    records += [mark_record(i + 1, *marks[i]) for i in order]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(records) - 1, 1)), max_size=4)))
    shard = MemoryShard()
    for low, high in zip([0, *cuts], [*cuts, len(records)], strict=True):
        txn, outcome = Applier(TOPICS, partitions=1).stage(shard, records[low:high])
        txn.commit()
        assert outcome.dead == []
    share = ConversationState.decode(shard.get(CONVERSATION_STATE.key('conv-m')) or b'')
    titles = [[micros(T0 + timedelta(minutes=m)), t] for m, t, _ in marks if t is not None]
    flags = [[micros(T0 + timedelta(minutes=m)), a] for m, _, a in marks if a is not None]
    assert share.title == (max(titles) if titles else [])
    assert share.archived == (max(flags) if flags else [])
    found = asyncio.run(ProjectionReader(shard).get_conversation('conv-m'))
    assert found is not None and found.runs == 1
    assert found.title == (max(titles)[1] if titles else None)
    assert found.archived == (bool(flags) and max(flags)[1])


def test_a_mark_of_another_conversation_or_of_no_run_is_dead_lettered() -> None:
    shard = MemoryShard()
    other = mark_record(1, 0, 'Orders', None, run_id='run-x')
    records = [started_record('run-m', 'conv-other'), mark_record(2, 0, 'Orders', None), other]
    txn, outcome = Applier(TOPICS, partitions=1).stage(shard, records)
    txn.commit()
    assert [(d.reason, d.source.offset) for d in outcome.dead] == [('invalid', 2), ('invalid', 1)]
    assert "conversation 'conv-other'" in outcome.dead[0].detail
    assert 'no run_started before it' in outcome.dead[1].detail
    with pytest.raises(ValueError, match='give a title'):
        conversation_mark(run_id='run-m', conversation_id='conv-m')
    with pytest.raises(ValueError, match='1 to 200'):
        conversation_mark(run_id='run-m', conversation_id='conv-m', title='  ')
    secret = 'sk-live-9f8e7d6c5b4a39281706f5e4'
    titled = conversation_mark(run_id='run-m', conversation_id='conv-m', title=f'Refund for api_key={secret}')
    assert secret not in titled.metadata[TITLE_KEY] and titled.metadata[TITLE_KEY].startswith('Refund for')


def run_records(run_id: str, kinds: list[tuple[str, int]]) -> list[StepEvent]:
    """A run's step events of `kinds` (kind, minute), seq 0 up, in conversation `conv-m`."""
    return [
        StepEvent(
            run_id=run_id,
            seq=seq,
            writer_id='w',
            timestamp=T0 + timedelta(minutes=minute),
            kind=kind,  # type: ignore[arg-type]
            agent_name=None,
            conversation_id='conv-m',
        )
        for seq, (kind, minute) in enumerate(kinds)
    ]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    marks=st.lists(st.tuples(st.sampled_from(['run-a', 'run-b']), st.integers(0, 12), TITLES, st.booleans())),
    data=st.data(),
)
def test_a_runs_marks_leave_with_it_whatever_the_batches(
    marks: list[tuple[str, int, str, bool]], data: st.DataObject
) -> None:
    """Run `run-a` ends early and is dropped by retention as `run-b` moves the clock on; marks keyed
    by either come anywhere after their run's start. One pass and random batch cuts leave the same
    bytes, and the share holds the marks of the runs that stay."""
    events = {
        'run-a': run_records('run-a', [('run_started', 0), ('run_completed', 1)]),
        'run-b': run_records('run-b', [('run_started', 2), ('model_request_started', 10)]),
    }
    log: list[StepEvent] = [events['run-a'][0], events['run-b'][0]]
    rest = [events['run-a'][1], events['run-b'][1]]
    rest += [
        replace(
            conversation_mark(run_id=r, conversation_id='conv-m', title=t, archived=a, writer_id='op'),
            timestamp=T0 + timedelta(minutes=m),
        )
        for r, m, t, a in marks
    ]
    log += data.draw(st.permutations(rest))
    records = [SourceRecord(EVENTS, 0, i, e.run_id.encode(), encode(e)) for i, e in enumerate(log)]

    def applied(sizes: list[int]) -> list[tuple[bytes, bytes]]:
        shard, at = MemoryShard(), 0
        for size in sizes:
            applier = Applier(TOPICS, partitions=1, retain_ended_us=4 * MINUTE)
            txn, _ = applier.stage(shard, records[at : at + size])
            txn.commit()
            at += size
        return list(shard.logical_items())

    cuts = data.draw(st.lists(st.integers(1, 3), min_size=len(records), max_size=len(records)))
    sizes, left = [], len(records)
    for cut in cuts:
        if left:
            sizes.append(min(cut, left))
            left -= sizes[-1]
    one_pass, batched = applied([len(records)]), applied(sizes)
    assert batched == one_pass
    assert RUN.key('run-a') not in dict(one_pass) and RUN.key('run-b') in dict(one_pass)  # dropped, kept
    check_shares(one_pass)


def test_shards_made_before_the_conversations_were_indexed_say_rebuild() -> None:
    shard = MemoryShard()
    txn, _ = Applier(TOPICS, partitions=1).stage(shard, [started_record('run-m', 'conv-m')])
    txn.commit()
    reader = ProjectionReader(shard)
    with mock.patch.object(Runs, 'index_version', return_value=5):
        for call in (
            reader.list_conversations(),
            reader.get_conversation('conv-m'),
            reader.search_conversations('m'),
        ):
            with pytest.raises(ConversationsNotIndexed, match='rebuild'):
                asyncio.run(call)  # type: ignore[arg-type]
    assert asyncio.run(reader.get_conversation('conv-m')) is not None
