"""`GroupConversations` (decision 0062): members that each read only their own shards, merged, list,
page, search and read conversations exactly as one reader of every shard does, for generated hostile
logs with archive and unarchive marks keyed by any of a conversation's runs, however the partitions
are shared out and whatever the page size: filtered listings place a conversation where the single
reader does (`Conversation.placed`), and their cursors agree."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_apply_properties import PARTITIONS, T0, TOPICS, Op, logs
from test_conversations import check_shares, shards_of

from stepstream.producer import conversation_mark
from stepstream.projector._apply import EVENTS, Applier, SourceRecord
from stepstream.readmodel import GroupConversations, ProjectionReader
from stepstream.schemas import StepEvent, encode
from stepstream.storage import RUN, WORD, MemoryShard, RunState
from stepstream.topics import murmur2_partition

pytestmark = pytest.mark.fast


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    generated=logs(),
    owners=st.lists(st.integers(0, 1), min_size=PARTITIONS, max_size=PARTITIONS),
    page=st.integers(1, 3),
    data=st.data(),
)
def test_members_merged_are_one_reader_of_every_shard(
    generated: list[Op], owners: list[int], page: int, data: st.DataObject
) -> None:
    shards = shards_of(generated)
    runs = sorted(
        (run.run_id, run.conversation_id)
        for shard in shards.values()
        for run in (RunState.decode(v) for _, v in shard.scan(RUN.prefix()))
        if run.conversation_id is not None
    )
    conversations = sorted({c for _, c in runs} | {'conv'})
    side = st.tuples(st.sampled_from(conversations), st.integers(0, 8))
    drawn = data.draw(st.lists(side, min_size=1, max_size=len(SIDE_RUNS)))
    sides = [(SIDE_RUNS[n], conversation_id, minute) for n, (conversation_id, minute) in enumerate(drawn)]
    runs += [(run_id, conversation_id) for run_id, conversation_id, _ in sides]
    mark = st.tuples(st.sampled_from(runs), st.integers(0, 8), st.booleans())
    continued(shards, sides, data.draw(st.lists(mark, max_size=8)))
    whole = ProjectionReader(shards, partitions=PARTITIONS)
    members = [
        ProjectionReader(
            shards, partitions=PARTITIONS, scope=lambda m=m: {p for p, o in enumerate(owners) if o == m}
        )
        for m in sorted(set(owners))
    ]
    group = GroupConversations([member.conversation_member() for member in members])
    words = sorted({str(WORD.parse(k)[0]) for shard in shards.values() for k, _ in shard.scan(WORD.prefix())})
    event(f'{len(members)} members, {min(len(words), 3)}+ words')
    query = ' '.join(data.draw(st.lists(st.sampled_from(words), max_size=2))) if words else ''

    async def check(archived: bool | None) -> None:
        listed = await whole.list_conversations(limit=None, archived=archived)
        event(f'archived={archived}: {"some" if any(c.placed for c in listed) else "none"} placed older')
        merged = await group.list_conversations(limit=None, archived=archived)
        assert merged == listed and [c.cursor for c in merged] == [c.cursor for c in listed]
        for reader in (whole, group):  # paged: the same pages, each cursor taken from the last
            paged, after = [], None
            while batch := await reader.list_conversations(limit=page, after=after, archived=archived):
                expected = listed[len(paged) : len(paged) + page]
                assert batch == expected and [c.cursor for c in batch] == [c.cursor for c in expected]
                paged += batch
                after = batch[-1].cursor
            assert paged == listed
        found = await whole.search_conversations(query, limit=None, archived=archived)
        assert await group.search_conversations(query, limit=None, archived=archived) == found
        paged, after = [], None
        while batch := await group.search_conversations(query, limit=page, after=after, archived=archived):
            paged += batch
            after = batch[-1].cursor
        assert paged == found
        if archived is None:
            for conversation in listed:
                assert await group.get_conversation(conversation.conversation_id) == conversation
            assert await group.get_conversation('no such conversation') is None

    for archived in (None, True, False):
        asyncio.run(check(archived))


SIDE_RUNS = [f'side-{n}' for n in range(40) if murmur2_partition(f'side-{n}'.encode(), PARTITIONS) == 1][:3]
"""Runs in partition 1, where the generated logs' runs are rarely (theirs are mostly in partition 0)."""


def continued(
    shards: dict[int, MemoryShard],
    sides: list[tuple[str, str, int]],
    marks: list[tuple[tuple[str, str], int, bool]],
) -> None:
    """After the log: `sides` (run, conversation, minute), runs of the conversations in partition 1
    active at that minute, then archive (True) or unarchive marks ((run, its conversation), minute,
    flag), each in its run's shard: a conversation's newest mark and newest activity often in two."""
    events = [
        StepEvent(
            run_id=run_id,
            seq=seq,
            writer_id='side',
            timestamp=T0 + timedelta(minutes=minute * seq),
            kind=kind,  # type: ignore[arg-type]
            agent_name=None,
            conversation_id=conversation_id,
        )
        for run_id, conversation_id, minute in sides
        for seq, kind in enumerate(['run_started', 'model_request_started'])
    ]
    for (run_id, conversation_id), minute, archived in marks:
        record = conversation_mark(
            run_id=run_id, conversation_id=conversation_id, archived=archived, writer_id='op'
        )
        events.append(replace(record, timestamp=T0 + timedelta(minutes=minute)))
    for p, shard in shards.items():
        records = [
            SourceRecord(EVENTS, p, 10_000 + n, e.run_id.encode(), encode(e))
            for n, e in enumerate(events)
            if murmur2_partition(e.run_id.encode(), PARTITIONS) == p
        ]
        txn, outcome = Applier(TOPICS, partitions=PARTITIONS).stage(shard, records)
        assert outcome.dead == []
        txn.commit()
        check_shares(list(shard.logical_items()))


def own(owners: list[int], member: int) -> set[int]:
    """The partitions `owners` gives `member`."""
    return {p for p, o in enumerate(owners) if o == member}
