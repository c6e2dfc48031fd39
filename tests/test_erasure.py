"""Erasure by crypto-shredding, end to end: real agent runs, the broker, SeaweedFS and RocksDB.

A conversation's content and media are sealed with its key; `forget` destroys the key and deletes
the media. Afterwards the live projection, a rebuild from offset zero, a member that restored a
checkpoint taken before the erasure, and an outside consumer of the raw topics all lack the content,
while the trail's structure stays (decision 0033).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import uuid
from pathlib import Path

import httpx
import obstore
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition
from pydantic_ai import Agent, BinaryContent
from pydantic_ai.messages import ModelMessagesTypeAdapter
from test_cli import cli

from stepstream import Settings
from stepstream.analytics import export_parquet
from stepstream.erasure import KEY_TOPIC_CONFIGS, ContentErased, KeyRing, key_topic, new_kek
from stepstream.forget import forget_conversation
from stepstream.media import S3MediaStore
from stepstream.producer import EventLog, StepPersistence, decide_deferred_call, mark_conversation
from stepstream.projector import GroupMember, Projector, rebuild
from stepstream.readmodel import ProjectionReader, continue_run
from stepstream.replay import replay_run
from stepstream.serve import app_for, running
from stepstream.storage import Checkpoints
from stepstream.topics import partition_counts

from agents import calls_then_answers
from brokers import BROKER, kafka_only, tansu_only
from deferred_runs import REFUND_ARGS, waiting_agent
from waits import until

pytestmark = pytest.mark.broker


def sealed_settings(settings: Settings) -> Settings:
    return settings.replace(erasure_key=new_kek(), media_threshold_bytes=4096)


def store_for(settings: Settings) -> tuple[S3MediaStore, str]:
    prefix = f'test-{uuid.uuid4().hex[:8]}/'
    return S3MediaStore.from_settings(settings.media, key_prefix=prefix), prefix


def object_keys(store: S3MediaStore, prefix: str) -> set[str]:
    return {meta['path'] for chunk in obstore.list(store.object_store, prefix=prefix) for meta in chunk}


async def raw_values(settings: Settings, *topics: str) -> list[bytes]:
    """Every record value on `topics`, as an outside consumer reads them (to the end)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset='earliest',
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        counts = await partition_counts(settings.kafka, list(topics))
        parts = [TopicPartition(t, p) for t in topics for p in range(counts[t])]
        consumer.assign(parts)
        ends = await consumer.end_offsets(parts)
        values: list[bytes] = []
        while [tp for tp in parts if await consumer.position(tp) < ends[tp]]:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                values.extend(m.value for m in batch if m.value is not None)
        return values
    finally:
        await consumer.stop()


def secret_agent(log: EventLog, store: S3MediaStore, output: str) -> Agent[None, str]:
    agent = Agent(calls_then_answers('lookup'), capabilities=[StepPersistence(log=log, media_store=store)])

    @agent.tool_plain
    def lookup() -> str:
        return output

    return agent


async def test_forget_erases_content_and_media_everywhere_but_keeps_the_trail(
    settings: Settings, tmp_path: Path
) -> None:
    settings = sealed_settings(settings)
    store, prefix = store_for(settings)
    secret = f'SECRET-{uuid.uuid4().hex}'
    shared_output = f'{secret} ' + 'medical record line\n' * 2000  # offloaded: above the threshold
    group = f'{settings.topics.topic_prefix}.erasure'
    checkpoints = Checkpoints.from_settings(settings, group=group, interval_s=3600)

    async with (
        EventLog(settings) as log,
        Projector(
            settings,
            db_path=tmp_path / 'live',
            member=GroupMember(group=group, checkpoints=checkpoints),
            media_store=store,
        ) as projector,
    ):
        await until(lambda: projector.partitions == [0, 1, 2], 'the member to own every partition')
        agent = secret_agent(log, store, shared_output)
        await agent.run(f'tell me about {secret}', conversation_id='conv-forget')
        await agent.run(f'tell me about {secret}', conversation_id='conv-keep')  # the same payload
        await projector.wait_for(await log.flush())
        reader = ProjectionReader.of(projector)
        (erased_run,) = await reader.list_runs(conversation_id='conv-forget')
        (kept_run,) = await reader.list_runs(conversation_id='conv-keep')
        history = await continue_run(reader, run_id=erased_run.run_id)
        assert secret in ModelMessagesTypeAdapter.dump_json(history).decode()
        for run in (erased_run, kept_run):  # a title is personal text too: sealed by its writer
            assert run.conversation_id is not None
            await mark_conversation(
                log, run_id=run.run_id, conversation_id=run.conversation_id, title=f'About {secret}'
            )
        await projector.wait_for(await log.flush())
        titled = await reader.get_conversation('conv-forget')
        assert titled is not None and (titled.title, titled.title_erased) == (f'About {secret}', False)
        # A deferred call's arguments, and the decision's message, are the person's content too.
        waits = f'waits-{uuid.uuid4().hex[:8]}'
        await waiting_agent(log, waits).run('refund order 7', conversation_id='conv-forget')
        await projector.wait_for(await log.flush())
        refund = await reader.get_tool_effect(waits, 'call-refund')
        assert refund is not None and refund.args is not None and json.loads(refund.args) == REFUND_ARGS
        await decide_deferred_call(
            log,
            refund,
            decision='denied',
            message=f'not for {secret}',
            operator='alice',
            writer_id='test@here:1',
            conversation_id='conv-forget',
        )
        await projector.wait_for(await log.flush())
        denied = await reader.get_tool_effect(waits, 'call-refund')
        assert denied is not None and denied.resolution is not None
        assert denied.resolution.error == f'not for {secret}'

        # Sealed on the way out: the raw log and the bucket hold no plaintext, and the two
        # conversations' copies of one payload are two objects whose names are not its hash.
        for value in await raw_values(
            settings, settings.topics.step_events_topic, settings.topics.tool_effects_topic
        ):
            assert secret.encode() not in value and b'charged twice' not in value
        objects = object_keys(store, prefix)
        assert len(objects) == 2
        plain_hash = hashlib.sha256(shared_output.encode()).hexdigest()
        assert not any(plain_hash in key for key in objects)

        before = await checkpoints.upload_all(projector.shards)  # a checkpoint taken before the erasure
        assert before

        report = await forget_conversation(settings, 'conv-forget', reader=reader, media_store=store)
        assert len(report.keys_destroyed) == 1
        assert sorted(report.runs) == sorted([erased_run.run_id, waits])
        assert len(report.media_deleted) == 1
        assert len(object_keys(store, prefix)) == 1  # the other conversation's copy stays

        # The live projection: content erased, not an error; the trail stays.
        await assert_title_erased(reader, secret)
        snapshot = await reader.latest_snapshot(erased_run.run_id)
        assert snapshot is not None and snapshot.erased and snapshot.messages == []
        with pytest.raises(ContentErased):
            await continue_run(reader, run_id=erased_run.run_id)
        await assert_trail(reader, erased_run.run_id)
        await assert_call_erased(reader, waits)
        kept = await continue_run(reader, run_id=kept_run.run_id)
        assert secret in ModelMessagesTypeAdapter.dump_json(kept).decode()
        # Replay (issue 38): the erased run is reported, the kept one (sealed, offloaded) matches.
        replayed = await replay_run(agent, erased_run.run_id, reader=reader)
        assert replayed.outcome == 'erased' and not replayed.ok
        assert replayed.detail.startswith('erased: cannot replay')
        kept_replay = await replay_run(agent, kept_run.run_id, reader=reader)
        assert kept_replay.outcome == 'matched', kept_replay.text()

    # A rebuild from offset zero after the erasure.
    await rebuild(settings, tmp_path / 'rebuilt')
    async with KeyRing(settings) as keys:
        rebuilt = ProjectionReader.open(tmp_path / 'rebuilt', media_store=store, keys=keys)
        try:
            await assert_erased(rebuilt, erased_run.run_id)
            await assert_trail(rebuilt, erased_run.run_id)
            await assert_title_erased(rebuilt, secret)
            await assert_call_erased(rebuilt, waits)
            assert (
                secret
                in ModelMessagesTypeAdapter.dump_json(
                    await continue_run(rebuilt, run_id=kept_run.run_id)
                ).decode()
            )
        finally:
            rebuilt.close()

    # A member that restores the checkpoint taken before the erasure.
    restorer = Checkpoints.from_settings(settings, group=group, interval_s=3600)
    async with Projector(
        settings,
        db_path=tmp_path / 'restored',
        member=GroupMember(group=group, checkpoints=restorer),
        media_store=store,
    ) as member:
        await until(lambda: member.partitions == [0, 1, 2], 'the new member to own every partition')
        assert member.restored_from_checkpoint  # restored, not replayed
        await assert_erased(ProjectionReader.of(member), erased_run.run_id)
        await assert_trail(ProjectionReader.of(member), erased_run.run_id)
        await assert_call_erased(ProjectionReader.of(member), waits)


async def assert_title_erased(reader: ProjectionReader, secret: str) -> None:
    """The forgotten conversation's title reads as erased; the other one's is read."""
    erased = await reader.get_conversation('conv-forget')
    assert erased is not None and (erased.title, erased.title_erased) == (None, True)
    assert erased in await reader.list_conversations(limit=None)
    kept = await reader.get_conversation('conv-keep')
    assert kept is not None and (kept.title, kept.title_erased) == (f'About {secret}', False)


async def assert_call_erased(reader: ProjectionReader, run_id: str) -> None:
    """The waiting run's denied call: its arguments and the denial's message erased, the decision kept."""
    effect = await reader.get_tool_effect(run_id, 'call-refund')
    assert effect is not None and effect.content_erased and effect.args is None
    assert effect.resolution is not None and effect.resolution.resolution == 'denied'
    assert effect.resolution.error is None and effect.resolution.resolved_by == 'alice'


async def assert_erased(reader: ProjectionReader, run_id: str) -> None:
    snapshots = await reader.list_snapshots(run_id, include_interrupted=True)
    assert snapshots and all(s.erased and s.messages == [] for s in snapshots)
    with pytest.raises(ContentErased):
        await continue_run(reader, run_id=run_id)


async def assert_trail(reader: ProjectionReader, run_id: str) -> None:
    """What stays for audit: the run, its status and lineage, its events, tool names, usage."""
    run = await reader.get_run(run_id)
    assert run is not None and run.status == 'completed' and run.conversation_id == 'conv-forget'
    events = await reader.list_events(run_id)
    kinds = [e.kind for e in events]
    assert kinds[0] == 'run_started' and kinds[-1] == 'run_completed' and 'snapshot_saved' in kinds
    assert [e.tool_name for e in events if e.kind == 'tool_call_completed'] == ['lookup']
    assert run.usage.requests == 2
    effect = await reader.get_tool_effect(run_id, 'call-0')
    assert effect is not None and effect.status == 'completed' and effect.tool_name == 'lookup'


async def test_a_writer_without_the_reader_key_is_not_read_as_erased(
    settings: Settings, tmp_path: Path
) -> None:
    """A reader with another KEK fails saying so: a misconfiguration never passes for an erasure."""
    settings = sealed_settings(settings)
    store, _ = store_for(settings)
    async with (
        EventLog(settings) as log,
        Projector(settings, db_path=tmp_path / 'p', media_store=store) as projector,
    ):
        await secret_agent(log, store, 'short').run('hello', conversation_id='conv-kek')
        await projector.wait_for(await log.flush())
        (run,) = await ProjectionReader.of(projector).list_runs(conversation_id='conv-kek')
    other = settings.replace(erasure_key=new_kek())
    async with KeyRing(other) as keys:
        reader = ProjectionReader.open(tmp_path / 'p', media_store=store, keys=keys)
        try:
            with pytest.raises(Exception, match='another STEPSTREAM_ERASURE_KEY'):
                await reader.latest_snapshot(run.run_id)
        finally:
            reader.close()
    reader = ProjectionReader.open(tmp_path / 'p', media_store=store)  # no keys at all
    try:
        with pytest.raises(Exception, match='read it with STEPSTREAM_ERASURE_KEY set'):
            await reader.latest_snapshot(run.run_id)
    finally:
        reader.close()


async def produce_and_destroy_a_key(settings: Settings) -> bytes:
    """A key record and its tombstone on the key topic; returns the record key."""
    from stepstream.erasure import ConversationKey, ensure_key_topic, parse_kek

    assert settings.security.erasure_key is not None
    await ensure_key_topic(settings)
    key = ConversationKey.new('conv-compaction')
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers, acks='all')
    await producer.start()
    try:
        await producer.send_and_wait(
            key_topic(settings.topics),
            key.wrap(parse_kek(settings.security.erasure_key.get_secret_value())),
            key=key.record_key(),
        )
        await producer.send_and_wait(key_topic(settings.topics), None, key=key.record_key())
    finally:
        await producer.stop()
    return key.record_key()


async def test_a_conversation_key_leaves_the_producers_metadata_covering_the_logs_topics(
    settings: Settings,
) -> None:
    """aiokafka's metadata covers every topic until the producer first sends to one it did not
    know at its start; from then on it covers only the topics sent to that way. The key topic
    made after the producer started was such a topic, so the events and tool-effects topics fell
    out: a batch waiting for them had no leader and failed with NotLeaderForPartitionError when
    it expired, ten seconds later (a run failed on Tansu under load)."""
    settings = sealed_settings(settings)
    async with EventLog(settings) as log:
        assert log.sealer is not None and log._producer is not None
        await log.sealer.key_for('conv-metadata')  # the first conversation key this writer makes
        client = log._producer.client
        await client.force_metadata_update()
        known = {
            topic: client.cluster.partitions_for_topic(topic)
            for topic in (
                key_topic(settings.topics),
                settings.topics.step_events_topic,
                settings.topics.tool_effects_topic,
            )
        }
        assert all(known.values()), known


@tansu_only('documents what Tansu does with a compacted topic')
async def test_tansu_keeps_a_destroyed_key_record(settings: Settings) -> None:
    """Tansu accepts `cleanup.policy=compact` but its memory and S3 engines never compact: the
    wrapped key stays on the topic after its tombstone (why the KEK wraps every key)."""
    settings = sealed_settings(settings)
    record_key = await produce_and_destroy_a_key(settings)
    values = await raw_values(settings, key_topic(settings.topics))
    assert any(b'conv-compaction' in v for v in values)  # still there: only the KEK protects it
    assert record_key


@kafka_only('never compacts a topic')
async def test_kafka_compaction_removes_a_destroyed_key_record(settings: Settings) -> None:
    settings = sealed_settings(settings)
    # The active segment is never cleaned: the topic rolls segments every second here (10 minutes
    # by default), and a record now and then makes the tombstone leave the active segment.
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap_servers)
    await admin.start()
    try:
        configs = {**KEY_TOPIC_CONFIGS, 'segment.ms': '1000'}
        await admin.create_topics([NewTopic(key_topic(settings.topics), 1, 1, topic_configs=configs)])
    finally:
        await admin.close()
    await produce_and_destroy_a_key(settings)
    admin_topic = key_topic(settings.topics)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers, acks='all')
    await producer.start()
    try:
        deadline = asyncio.get_running_loop().time() + 240
        while any(b'conv-compaction' in v for v in await raw_values(settings, admin_topic)):
            assert asyncio.get_running_loop().time() < deadline, (
                'the log cleaner did not compact the key topic'
            )
            await producer.send_and_wait(admin_topic, b'{}', key=b'roll')
            await asyncio.sleep(1)
    finally:
        await producer.stop()
    assert BROKER == 'kafka'


async def test_the_cli_the_service_and_the_export_show_erased_content_as_erased(
    settings: Settings, tmp_path: Path
) -> None:
    settings = sealed_settings(settings)
    store = S3MediaStore.from_settings(settings.media)  # the store the CLI and the service use
    secret = f'SECRET-{uuid.uuid4().hex}'
    output = f'{secret} ' + 'x-ray finding\n' * 1000
    db_path = tmp_path / 'projection'
    async with (
        EventLog(settings) as log,
        Projector(settings, db_path=db_path, media_store=store) as projector,
    ):
        agent = secret_agent(log, store, output)
        await agent.run('first', conversation_id='conv-cli')
        image = secret.encode() + os.urandom(20_000)
        prompt = ['second', BinaryContent(image, media_type='image/png')]
        await agent.run(prompt, conversation_id='conv-other')
        await projector.wait_for(await log.flush())
        reader = ProjectionReader.of(projector)
        (erased,) = await reader.list_runs(conversation_id='conv-cli')
        (kept,) = await reader.list_runs(conversation_id='conv-other')
        waits = f'waits-{uuid.uuid4().hex[:8]}'  # a run of the conversation whose call a person denies
        await waiting_agent(log, waits).run('refund order 7', conversation_id='conv-cli')
        await projector.wait_for(await log.flush())
        denial = f'not for {secret}'
        code, out, err = await cli(settings, db_path, 'deny', waits, 'call-refund', '--message', denial)
        assert code == 0 and repr(denial) in out and 'stepstream-sealed' not in out, err  # shown opened

        code, out, err = await cli(settings, db_path, 'forget', '--conversation', 'conv-cli', '--json')
        assert code == 0, err
        report = json.loads(out)
        # Two keys: the writers' and the one the CLI made to seal the denial (a process of its own).
        assert len(report['keys_destroyed']) == 2 and len(report['media_deleted']) == 1
        assert sorted(report['runs']) == sorted([erased.run_id, waits])
        code, out, err = await cli(settings, db_path, 'forget', '--conversation', 'conv-unknown')
        assert code == 1 and 'nothing to forget' in err, err
        code, out, err = await cli(settings, db_path, 'snapshot', erased.run_id)
        assert code == 0 and 'content erased' in out and secret not in out, err
        code, out, err = await cli(settings, db_path, 'events', erased.run_id)
        assert code == 0 and 'lookup' in out and 'tool_call_completed' in out, err  # the trail stays
        code, out, err = await cli(settings, db_path, 'snapshot', kept.run_id)
        assert code == 0 and secret in out, err
        code, out, err = await cli(settings, db_path, 'effects', waits)
        assert code == 0 and 'arguments (erased)' in out and 'denied by' in out and secret not in out, err

        async with (
            running(app_for(settings, reader=reader, media_store=store), port=0) as server,
            httpx.AsyncClient(base_url=server.url) as client,
        ):
            latest = (await client.get(f'/api/runs/{erased.run_id}/snapshots/latest')).json()
            assert latest['erased'] is True and latest['messages'] == []
            page = await client.get(f'/runs/{erased.run_id}')
            assert page.status_code == 200 and 'content erased' in page.text and secret not in page.text
            other = json.dumps((await client.get(f'/api/runs/{kept.run_id}/snapshots/latest')).json())
            assert secret in other  # offloaded text comes back inline, opened with its key
            (link,) = set(re.findall(r'/api/media/[0-9a-f]{64}\?media_type=[^"]+', other))
            media = await client.get(link)
            assert media.status_code == 200 and media.content == image  # a binary is linked, opened

        exported = await export_parquet(reader, str(tmp_path / 'export'), settings)
        assert sorted(exported.erased_histories) == sorted([erased.run_id, waits])
        assert exported.rows['messages'] > 0 and exported.rows['runs'] == 3

        # Erased content as JSON is JSON; a missing or wrong key is named as such, never a gap.
        code, out, err = await cli(settings, db_path, 'snapshot', erased.run_id, '--json')
        assert code == 0 and json.loads(out)['erased'] is True and json.loads(out)['messages'] == [], err
        for key, words in (
            (None, 'STEPSTREAM_ERASURE_KEY is not set'),
            (new_kek(), 'is not the key-encryption key'),
        ):
            out_dir = tmp_path / f'export-{"none" if key is None else "wrong"}'
            code, out, err = await cli(
                settings.replace(erasure_key=key), db_path, 'export', '--out', str(out_dir)
            )
            assert code == 1 and 'the export is incomplete' in err and words in err, err
            assert 'gap' not in err


async def test_two_writers_of_one_conversation_use_their_own_keys_and_forget_destroys_both(
    settings: Settings, tmp_path: Path
) -> None:
    settings = sealed_settings(settings)
    store, prefix = store_for(settings)
    output = 'lab result\n' * 1000
    async with (
        EventLog(settings) as first,
        EventLog(settings) as second,  # another process, as far as keys go: its own sealer
        Projector(settings, db_path=tmp_path / 'p', media_store=store) as projector,
    ):
        await asyncio.gather(
            secret_agent(first, store, output).run('a', conversation_id='conv-two'),
            secret_agent(second, store, output).run('b', conversation_id='conv-two'),
        )
        await projector.wait_for(await first.flush())
        await projector.wait_for(await second.flush())
        reader = ProjectionReader.of(projector)
        runs = await reader.list_runs(conversation_id='conv-two')
        assert len(runs) == 2
        report = await forget_conversation(settings, 'conv-two', reader=reader, media_store=store)
        assert len(report.keys_destroyed) == 2 and len(report.media_deleted) == 2
        assert object_keys(store, prefix) == set()
        for run in runs:
            await assert_erased(reader, run.run_id)
