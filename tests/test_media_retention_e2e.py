"""No payload of a kept run is ever deleted; `forget` deletes every payload of its conversation (issue 33).

End to end on the broker of this pass, SeaweedFS and RocksDB, with real agent runs:

- For generated histories holding payloads in every position a message has (the strategy of
  test_media_index.py), with erasure off and on, the media index of the projection names exactly
  the objects the writers put in the bucket: live, after a rebuild from offset zero, and in a
  group member that restored the shards from a checkpoint.
- A retention run with images, audio and text, with erasure off and on: a sweep whose grace
  period every object has outlived deletes only what expired runs alone referenced, and every
  kept run still continues and every snapshot page still opens; with a hole made in the index by
  hand, the sweep's last check keeps what a kept run reads.
- `forget` deletes each sealed payload of the conversation (images included) and says which it
  kept and why (a payload written before erasure was on).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from pydantic_ai import Agent, BinaryContent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from test_cli import cli
from test_media_index import THRESHOLD, histories
from test_retention_e2e import _Clock, same_partition

from stepstream import Settings
from stepstream.erasure import KeyRing, new_kek
from stepstream.forget import NOT_SEALED, forget_conversation
from stepstream.media import S3MediaStore
from stepstream.producer import EventLog, StepPersistence
from stepstream.producer import _run as capability  # builds the records, with their timestamps
from stepstream.projector import GroupMember, Projector, rebuild
from stepstream.readmodel import ProjectionReader, continue_run, sweep_media
from stepstream.serve import Source, create_app
from stepstream.storage import Checkpoints, Shard, shard_paths
from stepstream.storage._keys import MEDIA, RUN_MEDIA

from waits import until

pytestmark = pytest.mark.broker

PARTITIONS = 3


async def stored(store: S3MediaStore) -> set[str]:
    return {p.digest async for p in store.payloads()}


def answering(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[TextPart('noted')])


@hypothesis_settings(max_examples=2, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(runs=st.lists(histories(), min_size=1, max_size=2), erasure=st.booleans())
def test_the_index_names_what_writers_stored_live_rebuilt_and_restored(
    settings: Settings, tmp_path: Path, runs: list[tuple[list[ModelMessage], list[int]]], erasure: bool
) -> None:
    import asyncio

    asyncio.run(_index_scenario(settings, tmp_path / uuid.uuid4().hex[:8], runs, erasure))


async def _index_scenario(
    settings: Settings, tmp: Path, runs: list[tuple[list[ModelMessage], list[int]]], erasure: bool
) -> None:
    settings = settings.replace(
        topic_prefix=f'idx-{uuid.uuid4().hex[:10]}',
        retain_ended_days=30.0,
        erasure_key=new_kek() if erasure else None,
        partitions=PARTITIONS,
    )
    store = S3MediaStore.from_settings(settings.media, key_prefix=f'idx-{uuid.uuid4().hex[:8]}')
    group = f'{settings.topics.topic_prefix}.members'
    checkpoints = Checkpoints.from_settings(settings, group=group, interval_s=3600)
    async with (
        EventLog(settings) as log,
        Projector(
            settings,
            db_path=tmp / 'live',
            member=GroupMember(group=group, checkpoints=checkpoints),
            media_store=store,
        ) as live,
    ):
        await until(lambda: live.partitions == [0, 1, 2], 'the member to own every partition')
        for i, (history, _) in enumerate(runs):
            persistence = StepPersistence(log=log, media_store=store, media_threshold_bytes=THRESHOLD)
            agent = Agent(FunctionModel(answering), capabilities=[persistence])
            settled = [
                *history,
                ModelRequest(parts=[UserPromptPart('and?')]),
                ModelResponse(parts=[TextPart('ok')]),
            ]
            await agent.run('go on', message_history=settled, conversation_id=f'conv-{i}')
        await live.wait_for(await log.flush())
        objects = await stored(store)
        assert objects, 'every generated history offloads something'
        assert await ProjectionReader.of(live).referenced_media() == objects
        assert await checkpoints.upload_all(live.shards)

    await rebuild(settings, tmp / 'rebuilt')
    rebuilt = ProjectionReader.open(tmp / 'rebuilt')
    try:
        assert await rebuilt.referenced_media() == objects
    finally:
        rebuilt.close()

    restorer = Checkpoints.from_settings(settings, group=group, interval_s=3600)
    async with Projector(
        settings,
        db_path=tmp / 'restored',
        member=GroupMember(group=group, checkpoints=restorer),
        media_store=store,
    ) as member:
        await until(lambda: member.partitions == [0, 1, 2], 'the new member to own every partition')
        assert member.restored_from_checkpoint  # restored, not replayed
        assert await ProjectionReader.of(member).referenced_media() == objects


# -- retention with images, audio and text ------------------------------------------------------

IMAGE = b'\x89PNG\r\n\x1a\n' + bytes(range(256)) * 24
OLD = b'\x89PNG\r\n\x1a\n' + bytes(reversed(range(256))) * 24


def camera_agent(log: EventLog, store: S3MediaStore, run_id: str, image: bytes = IMAGE) -> Agent[None, str]:
    """Calls `camera` once, then answers; the camera returns `image`, and audio nested in a dict
    beside a large transcript, all three made from `image` (so runs share them exactly when they
    share `image`)."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returned = any(
            p.part_kind == 'tool-return' for m in messages if isinstance(m, ModelRequest) for p in m.parts
        )
        if not returned:
            return ModelResponse(parts=[ToolCallPart('camera', {}, tool_call_id='shot')])
        return ModelResponse(parts=[TextPart('a cat on a mat')])

    agent = Agent(
        FunctionModel(model), capabilities=[StepPersistence(log=log, run_id=run_id, media_store=store)]
    )

    @agent.tool_plain
    def camera() -> list[object]:
        audio = BinaryContent(b'RIFF' + image[-2000:] * 2, media_type='audio/wav')
        transcript = f'a transcript of {image[-8:].hex()}\n' * 200
        return [BinaryContent(image, media_type='image/png'), {'clip': audio, 'text': transcript}]

    return agent


@pytest.mark.parametrize('erasure', [False, True], ids=['plain', 'sealed'])
async def test_a_sweep_never_deletes_what_a_kept_run_reads(
    settings: Settings, db_path: Path, monkeypatch: pytest.MonkeyPatch, erasure: bool
) -> None:
    settings = settings.replace(
        retain_ended_days=1.0,
        media_threshold_bytes=1024,
        partitions=PARTITIONS,
        erasure_key=new_kek() if erasure else None,
    )
    store = S3MediaStore.from_settings(settings.media, key_prefix=f'sweep-{uuid.uuid4().hex[:8]}')
    monkeypatch.setattr(capability, 'datetime', _Clock)
    monkeypatch.setattr(_Clock, 'shift', timedelta(0))
    old, kept, other = same_partition('photo', 3)

    async with (
        EventLog(settings) as log,
        Projector(settings, db_path=db_path, media_store=store) as projector,
    ):
        await camera_agent(log, store, old, OLD).run(
            ['what is this?', BinaryContent(OLD, media_type='image/png')], conversation_id='old'
        )
        old_objects = await stored(store)
        _Clock.shift = timedelta(days=2)  # two days on: the old run expires when these are applied
        await camera_agent(log, store, kept).run(
            ['and this?', BinaryContent(IMAGE, media_type='image/png')], conversation_id='kept'
        )
        await camera_agent(log, store, other).run('take another', conversation_id='other')
        await projector.wait_for(await log.flush())
        reader = ProjectionReader.of(projector)
        assert await reader.get_run(old) is None and await reader.get_run(kept) is not None
        kept_objects = await stored(store) - old_objects
        # image, audio, transcript (and, sealed, one copy of each per conversation: fresh nonces)
        assert len(kept_objects) >= 3
        assert await reader.referenced_media() == kept_objects

    code, out, err = await cli(settings, db_path, 'retention', '--json')
    assert code == 0, err
    assert sum(s['media'] for s in json.loads(out)['shards']) == len(kept_objects)

    keys = KeyRing(settings) if erasure else None
    reader = ProjectionReader.open(db_path, media_store=store, keys=keys)
    later = datetime.now(UTC) + timedelta(days=3)  # every object has outlived the grace period
    try:
        report = await sweep_media(reader, store, grace=timedelta(hours=2), now=later)
        assert {p.digest for p in report.deleted} == old_objects
        assert report.guarded == []
        assert await stored(store) == kept_objects
        await every_kept_run_reads(settings, reader, store, [kept, other])
    finally:
        reader.close()

    # An index bug, made by hand: the kept runs' entries go. The sweep's last check keeps them.
    for path in shard_paths(db_path).values():
        shard = Shard.open(path)
        try:
            txn = shard.begin()
            for run_id in (kept, other):
                for k, _ in list(shard.scan(RUN_MEDIA.prefix(run_id))):
                    txn.delete(MEDIA.key(RUN_MEDIA.last_str(k), run_id))
                    txn.delete(k)
            txn.commit()
        finally:
            shard.close()
    reader = ProjectionReader.open(db_path, media_store=store, keys=keys)
    try:
        assert await reader.referenced_media() == set()
        report = await sweep_media(reader, store, grace=timedelta(hours=2), now=later)
        assert report.deleted == [] and {p.digest for p in report.guarded} == kept_objects
        assert await stored(store) == kept_objects
        await every_kept_run_reads(settings, reader, store, [kept, other])
    finally:
        reader.close()
        if keys is not None:
            await keys.close()


async def every_kept_run_reads(
    settings: Settings, reader: ProjectionReader, store: S3MediaStore, run_ids: list[str]
) -> None:
    """Each run continues with its media, and every snapshot page of it opens (API and explorer)."""
    app = create_app(Source(settings, reader, store))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url='http://serve') as client:
        for run_id in run_ids:
            history = await continue_run(reader, run_id=run_id)
            contents = [c for m in history for p in m.parts for c in _contents(p)]
            assert any(getattr(c, 'data', None) == IMAGE for c in contents)
            snapshots = await reader.list_snapshots(run_id, include_interrupted=True)
            assert snapshots
            for snapshot in snapshots:
                seq = snapshot.snapshot_seq
                api = await client.get(f'/api/runs/{run_id}/snapshots/{seq}')
                assert api.status_code == 200, api.text
                page = await client.get(f'/runs/{run_id}/snapshots/{seq}')
                assert page.status_code == 200, page.text
                for link in _media_links(api.json()):
                    fetched = await client.get(link)
                    assert fetched.status_code == 200, (link, fetched.text)


def _contents(part: object) -> list[object]:
    content = getattr(part, 'content', None)
    if isinstance(content, list):
        out: list[object] = []
        for item in content:
            out += list(item.values()) if isinstance(item, dict) else [item]
        return out
    return [content]


def _media_links(value: object) -> list[str]:
    """Every link into the service's media route in a snapshot's JSON."""
    if isinstance(value, dict):
        return [link for v in value.values() for link in _media_links(v)]
    if isinstance(value, list):
        return [link for v in value for link in _media_links(v)]
    if isinstance(value, str) and value.startswith('/api/media/'):
        return [value]
    return []


# -- forget ---------------------------------------------------------------------------------------


async def test_forget_deletes_every_sealed_payload_of_the_conversation_and_says_what_it_kept(
    settings: Settings, db_path: Path
) -> None:
    plain = settings.replace(media_threshold_bytes=1024, partitions=PARTITIONS)
    sealed = plain.replace(erasure_key=new_kek())
    store = S3MediaStore.from_settings(sealed.media)  # the CLI's: the bucket's default key prefix
    baseline = await stored(store)  # what earlier tests left there
    async with EventLog(plain) as log:  # before erasure was turned on: plain media
        await camera_agent(log, store, 'before', OLD).run(
            ['before', BinaryContent(OLD, media_type='image/png')], conversation_id='C'
        )
    before = await stored(store) - baseline
    async with EventLog(sealed) as log, Projector(sealed, db_path=db_path, media_store=store) as projector:
        for run_id in ('c-1', 'c-2'):
            await camera_agent(log, store, run_id).run(
                ['look', BinaryContent(IMAGE, media_type='image/png')], conversation_id='C'
            )
        after_c = await stored(store)
        await camera_agent(log, store, 'd-1').run(
            ['look', BinaryContent(IMAGE, media_type='image/png')], conversation_id='D'
        )
        await projector.wait_for(await log.flush())
    sealed_c = after_c - baseline - before
    d_objects = await stored(store) - after_c
    assert len(before) == 3 and len(sealed_c) == 6  # image, audio, transcript; sealed: fresh nonces each

    code, out, err = await cli(sealed, db_path, 'forget', '--conversation', 'C')
    assert code == 0, err
    assert f'{len(sealed_c)} media payload(s) deleted, {len(before)} not' in out
    for digest in sealed_c:
        assert f'deleted  media+sha256://{digest}' in out
    for digest in before:
        assert f'kept     media+sha256://{digest}: {NOT_SEALED}' in out
    assert await stored(store) == baseline | before | d_objects  # D's objects, and the plain ones, stay

    reader = ProjectionReader.open(db_path)
    try:  # forgetting again: the keys are gone, and so are the objects
        again = await forget_conversation(sealed, 'C', reader=reader, media_store=store)
        assert again.media_deleted == [] and not again.failed
        assert set(again.media_kept) == {'media+sha256://' + d for d in sealed_c | before}
    finally:
        reader.close()
