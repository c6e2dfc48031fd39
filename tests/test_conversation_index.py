"""The conversations' own indexes (decision 0062): the archived ones filed apart, and the words of
every user prompt of a run; and a title sealed under erasure.

Conversations here have runs in both partitions, and their marks are keyed by either, so the
shard that holds a conversation's newest activity is often not the one that holds its newest mark:
the filtered listings must still give each conversation once, exactly where its newest mark says.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_ai.messages import (
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    UserPromptPart,
)
from test_apply_properties import PARTITIONS, T0, TOPICS
from test_conversations import check_shares

from stepstream import Settings
from stepstream.console._conversations import conversation_json, conversations_table
from stepstream.erasure import KeyRing, is_sealed_text, new_kek
from stepstream.producer import conversation_mark, mark_conversation
from stepstream.producer._memory import InMemoryLog
from stepstream.producer._sealing import Sealer
from stepstream.projector._apply import EVENTS, Applier, SourceRecord
from stepstream.readmodel import (
    GroupConversations,
    ProjectionReader,
    decode_conversation_cursor,
    encode_conversation_cursor,
)
from stepstream.schemas import TITLE_KEY, SnapshotDelta, StepEvent, encode
from stepstream.serve._conversations import ConversationView
from stepstream.storage import MAX_RUN_WORDS, MemoryShard
from stepstream.topics import murmur2_partition

pytestmark = pytest.mark.fast

CONVERSATIONS = ['conv-1', 'conv-2', 'conv-3']


def runs_of(conversation_id: str) -> list[str]:
    """Two run ids of the conversation, the first in partition 0, the second in partition 1."""
    found: dict[int, str] = {}
    for n in range(100):
        run_id = f'{conversation_id}-run-{n}'
        found.setdefault(murmur2_partition(run_id.encode(), PARTITIONS), run_id)
    return [found[0], found[1]]


RUNS = {c: runs_of(c) for c in CONVERSATIONS}


def event(run_id: str, conversation_id: str, seq: int, kind: str, minute: int, **more: object) -> StepEvent:
    return StepEvent(
        run_id=run_id,
        seq=seq,
        writer_id='w',
        timestamp=T0 + timedelta(minutes=minute),
        kind=kind,  # type: ignore[arg-type]
        agent_name=None,
        conversation_id=conversation_id,
        **more,  # type: ignore[arg-type]
    )


def apply(partitions: dict[int, list[StepEvent]], sizes: dict[int, list[int]]) -> dict[int, MemoryShard]:
    """Each partition's records applied to its own shard, in batches of `sizes` (as projectors do)."""
    shards = {p: MemoryShard() for p in range(PARTITIONS)}
    for p, events in partitions.items():
        records = [SourceRecord(EVENTS, p, i, e.run_id.encode(), encode(e)) for i, e in enumerate(events)]
        at = 0
        for size in sizes[p]:
            txn, outcome = Applier(TOPICS, partitions=PARTITIONS).stage(shards[p], records[at : at + size])
            txn.commit()
            assert outcome.dead == []
            at += size
    return shards


def batches(data: st.DataObject, total: int) -> list[int]:
    """Random batch sizes that add up to `total`."""
    sizes, left = [], total
    while left:
        sizes.append(min(left, data.draw(st.integers(1, 3))))
        left -= sizes[-1]
    return sizes


MARK = st.tuples(
    st.sampled_from(CONVERSATIONS),
    st.integers(0, 1),  # keyed by the conversation's run in partition 0 or 1
    st.integers(0, 6),  # its minute
    st.booleans(),
    st.sampled_from([None, None, 'Orders']),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    marks=st.lists(MARK, max_size=10),
    activity=st.lists(st.integers(0, 6), min_size=6, max_size=6),
    page=st.integers(1, 3),
    data=st.data(),
)
def test_the_archived_filter_lists_exactly_what_the_newest_mark_says_whatever_the_order_and_batches(
    marks: list[tuple[str, int, int, bool, str | None]], activity: list[int], page: int, data: st.DataObject
) -> None:
    """Archive and unarchive in any order, cut into any batches: the shards are the same bytes as
    in one pass, each holds what its runs say, and the listing filtered either way gives each
    conversation once, newest first, exactly those whose newest mark (of every shard's) says so."""
    partitions: dict[int, list[StepEvent]] = {p: [] for p in range(PARTITIONS)}
    rest: dict[int, list[StepEvent]] = {p: [] for p in range(PARTITIONS)}
    for n, (conversation_id, runs) in enumerate(RUNS.items()):
        for p, run_id in enumerate(runs):
            partitions[p].append(event(run_id, conversation_id, 0, 'run_started', 0))
            rest[p].append(event(run_id, conversation_id, 1, 'model_request_started', activity[2 * n + p]))
    for conversation_id, p, minute, archived, title in marks:
        mark = conversation_mark(
            run_id=RUNS[conversation_id][p],
            conversation_id=conversation_id,
            title=title,
            archived=archived,
            writer_id='op',
        )
        rest[p].append(replace(mark, timestamp=T0 + timedelta(minutes=minute)))
    for p in partitions:
        partitions[p] += data.draw(st.permutations(rest[p]))

    one_pass = apply(partitions, {p: [len(e)] for p, e in partitions.items()})
    shards = apply(partitions, {p: batches(data, len(e)) for p, e in partitions.items()})
    for p, shard in shards.items():
        items = list(shard.logical_items())
        assert items == list(one_pass[p].logical_items())
        check_shares(items)

    flags: dict[str, list[tuple[int, bool]]] = {c: [] for c in CONVERSATIONS}
    for conversation_id, _, minute, archived, _ in marks:
        flags[conversation_id].append((minute, archived))
    expected = {c: bool(f) and max(f)[1] for c, f in flags.items()}
    reader = ProjectionReader(shards, partitions=PARTITIONS)
    members = [ProjectionReader(shards, partitions=PARTITIONS, scope=lambda p=p: {p}) for p in shards]
    group = GroupConversations([member.conversation_member() for member in members])  # a member a shard

    async def check() -> None:
        every = await reader.list_conversations(limit=None)
        assert {c.conversation_id for c in every} == set(CONVERSATIONS)
        assert {c.conversation_id: c.archived for c in every} == expected
        for archived in (True, False):
            listed = await reader.list_conversations(limit=None, archived=archived)
            ids = [c.conversation_id for c in listed]
            assert sorted(ids) == sorted(c for c, flag in expected.items() if flag == archived)
            assert [c.cursor for c in listed] == sorted((c.cursor for c in listed), reverse=True)
            assert all(c.placed is None or c.placed < c.last_activity for c in listed)
            for lister in (reader, group):  # a group's members merged place each where one reader does
                paged, after = [], None
                while batch := await lister.list_conversations(limit=page, after=after, archived=archived):
                    paged += batch
                    after = decode_conversation_cursor(encode_conversation_cursor(batch[-1].cursor))
                assert [(c.conversation_id, c.cursor) for c in paged] == [
                    (c.conversation_id, c.cursor) for c in listed
                ]
            for conversation in listed:
                assert conversation == await reader.get_conversation(conversation.conversation_id)

    asyncio.run(check())


def snapshot(run_id: str, seq: int, snapshot_seq: int, *requests: ModelRequest | ModelResponse) -> StepEvent:
    """A run's `snapshot_saved` whose tail is `requests`."""
    messages = ModelMessagesTypeAdapter.dump_json(list(requests)).decode()
    delta = SnapshotDelta(snapshot_seq=snapshot_seq, state='complete', prefix_len=0, messages=messages)
    return replace(event(run_id, 'conv-p', seq, 'snapshot_saved', seq), snapshot=delta)


def asked(text: str) -> ModelRequest:
    return ModelRequest(parts=[UserPromptPart(text)])


def test_search_finds_a_word_of_any_user_prompt_of_any_run_and_a_bounded_number_of_them() -> None:
    """A later prompt of a run (its second snapshot), the prompts of a second run of the
    conversation (which carries the history before it), and no more than `MAX_RUN_WORDS` words of a run."""
    many = ' '.join(f'word{n}' for n in range(MAX_RUN_WORDS + 10))
    events = [
        event('run-1', 'conv-p', 0, 'run_started', 0),
        snapshot('run-1', 1, 0, asked('Where is my parcel')),
        snapshot('run-1', 2, 1, ModelResponse(parts=[TextPart('On its way; ask me anything')])),
        snapshot('run-1', 3, 2, asked('Then refund it'), asked(many)),
        event('run-2', 'conv-p', 0, 'run_started', 5),
        snapshot('run-2', 1, 0, asked('Where is my parcel'), asked('what about the invoice')),
    ]
    shard = MemoryShard()
    records = [SourceRecord(EVENTS, 0, i, e.run_id.encode(), encode(e)) for i, e in enumerate(events)]
    txn, outcome = Applier(TOPICS, partitions=1).stage(shard, records)
    txn.commit()
    assert outcome.dead == []
    check_shares(list(shard.logical_items()))
    reader = ProjectionReader(shard)

    async def found(words: str) -> list[str]:
        return [c.conversation_id for c in await reader.search_conversations(words)]

    async def check() -> None:
        assert await found('parcel') == ['conv-p']  # the first prompt, as before
        assert await found('refund') == ['conv-p']  # a later prompt of the run
        assert await found('invoice parcel') == ['conv-p']  # the second run's own prompt, with the first
        assert await found('word0') == ['conv-p']
        assert await found('anything') == []  # the model's words are not a prompt
        # run-1's words: 4 + 3 before, so the first MAX_RUN_WORDS - 7 of the long prompt's.
        assert await found(f'word{MAX_RUN_WORDS - 8}') == ['conv-p']
        assert await found(f'word{MAX_RUN_WORDS - 7}') == []
        conversation = await reader.get_conversation('conv-p')
        assert conversation is not None and conversation.title == 'Where is my parcel'

    asyncio.run(check())


class HandRing(KeyRing):
    """A key ring fed by hand (`_apply`, what it does with each record of the key topic): no broker."""

    async def refresh(self, *, thorough: bool = False) -> None:
        return None


def sealed_log() -> tuple[InMemoryLog, HandRing]:
    """An in-memory log with erasure on, and a reader's key ring fed each key its writers make."""
    kek = new_kek()
    keys = HandRing(Settings(erasure_key=kek))  # type: ignore[arg-type]

    async def send_key(key: bytes, value: bytes) -> None:  # the key topic, as the reader's ring reads it
        keys._apply(key, value)

    log = InMemoryLog()
    log.sealer = Sealer(kek, send_key)
    return log, keys


SECRET = 'the patient has condition X'


async def test_a_title_is_sealed_with_erasure_on_and_forget_makes_it_unreadable_in_a_rebuild_too() -> None:
    log, keys = sealed_log()
    mark = await mark_conversation(log, run_id='run-s', conversation_id='conv-s', title=f'About {SECRET}')
    assert is_sealed_text(mark.metadata[TITLE_KEY]) and SECRET not in mark.metadata[TITLE_KEY]
    records = [
        SourceRecord(EVENTS, 0, 0, b'run-s', encode(event('run-s', 'conv-s', 0, 'run_started', 0))),
        SourceRecord(EVENTS, 0, 1, b'run-s', encode(mark)),
    ]

    def project() -> MemoryShard:
        shard = MemoryShard()
        txn, outcome = Applier(TOPICS, partitions=1).stage(shard, records)
        txn.commit()
        assert outcome.dead == []
        assert not any(b'condition' in k or b'condition' in v for k, v in shard.logical_items())
        return shard

    shard = project()
    reader = ProjectionReader(shard, keys=keys)
    found = await reader.get_conversation('conv-s')
    assert found is not None and (found.title, found.title_erased) == (f'About {SECRET}', False)
    assert await reader.list_conversations() == [found]
    assert await reader.search_conversations('patient') == []  # a sealed title files no plaintext words
    keyless = await ProjectionReader(shard).get_conversation('conv-s')
    assert keyless is not None and (keyless.title, keyless.title_erased) == (None, False)
    # A group's merge opens a title with the asking member's keys (a member's holdings keep it sealed).
    member = ProjectionReader(shard).conversation_member()
    assert await GroupConversations([member], keys=keys).list_conversations() == [found]
    assert await GroupConversations([member]).get_conversation('conv-s') == keyless

    for key in keys.of_conversation('conv-s'):  # `stepstream forget conv-s`: a tombstone for each key
        keys._apply(key.record_key(), None)
    for projection in (shard, project()):  # the live projection, and a rebuild from the log
        erased = await ProjectionReader(projection, keys=keys).get_conversation('conv-s')
        assert erased is not None and (erased.title, erased.title_erased) == (None, True)
        assert await ProjectionReader(projection, keys=keys).list_conversations() == [erased]
        grouped = GroupConversations([ProjectionReader(projection).conversation_member()], keys=keys)
        assert await grouped.get_conversation('conv-s') == erased
        assert await grouped.search_conversations('patient') == [] and await grouped.list_conversations() == [
            erased
        ]
        shown = ConversationView.of(erased)
        assert (shown.title, shown.title_erased) == (None, True)
        assert conversation_json(erased)['title_erased'] is True
        assert '(erased)' in conversations_table([erased])
    assert list(project().logical_items()) == list(shard.logical_items())
