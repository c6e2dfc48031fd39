"""`GroupConversations` (decision 0062): members that each read only their own shards, merged, list,
page, search and read conversations exactly as one reader of every shard does, for generated hostile
logs, however the partitions are shared out and whatever the page size."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_apply_properties import PARTITIONS, Op, logs
from test_conversations import shards_of

from stepstream.readmodel import GroupConversations, ProjectionReader
from stepstream.storage import WORD

pytestmark = pytest.mark.fast


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    generated=logs(),
    owners=st.lists(st.integers(0, 1), min_size=PARTITIONS, max_size=PARTITIONS),
    page=st.integers(1, 3),
    archived=st.sampled_from([None, True, False]),
    data=st.data(),
)
def test_members_merged_are_one_reader_of_every_shard(
    generated: list[Op], owners: list[int], page: int, archived: bool | None, data: st.DataObject
) -> None:
    shards = shards_of(generated)
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

    async def check() -> None:
        listed = await whole.list_conversations(limit=None, archived=archived)
        assert await group.list_conversations(limit=None, archived=archived) == listed
        for reader in (whole, group):  # paged: the same pages, each cursor taken from the last
            paged, after = [], None
            while batch := await reader.list_conversations(limit=page, after=after, archived=archived):
                assert batch == listed[len(paged) : len(paged) + page]
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
        for conversation in await whole.list_conversations(limit=None):
            assert await group.get_conversation(conversation.conversation_id) == conversation
        assert await group.get_conversation('no such conversation') is None

    asyncio.run(check())


def own(owners: list[int], member: int) -> set[int]:
    """The partitions `owners` gives `member`."""
    return {p for p, o in enumerate(owners) if o == member}
