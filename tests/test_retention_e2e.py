"""Retention end to end: real agent runs, the broker, SeaweedFS and RocksDB.

The writers' clock is moved on (simulated days) so that runs end "long ago" in log time without
waiting; everything else is real. A run that ended before its partition's clock minus the
period leaves the projection, its child says its parent expired, the media sweep deletes the
payloads only expired runs referenced and keeps a shared one and one a new writer re-used while
the sweep's mark was being taken, and a rebuild under the same policy equals the live projection.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import signal
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import obstore
import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from test_cli import cli
from test_projector_crash import KILLS, RUNS, kill_mid_batch, produce, start_projector

from stepstream import Settings
from stepstream.errors import UsageError
from stepstream.media import S3MediaStore
from stepstream.producer import EventLog, StepPersistence
from stepstream.producer import _run as capability  # builds the records, with their timestamps
from stepstream.projector import Projector, rebuild, verify_paths
from stepstream.readmodel import ProjectionReader, continue_run, sweep_media
from stepstream.serve import Source, create_app
from stepstream.topics import murmur2_partition

from brokers import tansu_only

pytestmark = pytest.mark.broker

PARTITIONS = 3
SHARED = 'a payload two runs share. ' * 200
ONLY_PARENT = 'only the parent asked this. ' * 200
ONLY_OLD = 'only an old run asked this. ' * 200
ONLY_CHILD = 'only the child asked this. ' * 200


class _Clock(datetime):
    """The writers' clock, moved on by `shift` to simulate days passing."""

    shift = timedelta(0)

    @classmethod
    def now(cls, tz: object = None) -> datetime:  # type: ignore[override]
        return datetime.now(UTC) + cls.shift


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def answering(text: str) -> FunctionModel:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[TextPart(text)])

    return FunctionModel(model)


def same_partition(run_id: str, count: int) -> list[str]:
    """`count` run ids in `run_id`'s partition (the clock that expires a run is its partition's)."""
    home = murmur2_partition(run_id.encode(), PARTITIONS)
    found = (f'{run_id}-{i}' for i in itertools.count())
    return list(
        itertools.islice((r for r in found if murmur2_partition(r.encode(), PARTITIONS) == home), count)
    )


async def payload_digests(store: S3MediaStore) -> set[str]:
    return {p.digest async for p in store.payloads()}


async def s3_clock_passes(store: S3MediaStore, moment: datetime) -> datetime:
    """Wait until the bucket stamps a new object later than `moment` (S3 keeps whole seconds)."""
    key = f'{store.key_prefix}/clock-probe'
    while True:
        await obstore.put_async(store.object_store, key, b'tick')
        stamped = (await obstore.head_async(store.object_store, key))['last_modified']
        if stamped > moment:
            return stamped


@pytest.fixture
def retaining(settings: Settings) -> Settings:
    return settings.replace(retain_ended_days=1.0, media_threshold_bytes=1024, partitions=PARTITIONS)


async def test_expired_runs_leave_the_projection_and_only_their_media_leaves_the_bucket(
    retaining: Settings, db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = retaining
    # Every re-use of a payload uploads it again (its age restarts), so the race below needs
    # no hour of waiting; the sweep's grace must still exceed that refresh age.
    store = S3MediaStore.from_settings(settings.media, key_prefix=f'test-{uuid.uuid4().hex[:8]}')
    store.refresh_after = timedelta(0)
    monkeypatch.setattr(capability, 'datetime', _Clock)
    parent, old, child = same_partition('parent', 3)

    def agent(log: EventLog, run_id: str, answer: str, parent_run_id: str | None = None) -> Agent[None, str]:
        persistence = StepPersistence(log=log, run_id=run_id, parent_run_id=parent_run_id, media_store=store)
        return Agent(answering(answer), capabilities=[persistence])

    async with (
        EventLog(settings) as log,
        Projector(settings, db_path=db_path, media_store=store) as projector,
    ):
        await agent(log, parent, SHARED).run(ONLY_PARENT, conversation_id='conv')
        await agent(log, old, 'short').run(ONLY_OLD, conversation_id='other')
        _Clock.shift = timedelta(days=2)  # two days on, a follow-up of the parent
        await agent(log, child, SHARED, parent_run_id=parent).run(ONLY_CHILD, conversation_id='conv')
        await projector.wait_for(await log.flush())
        reader = ProjectionReader.of(projector)

        assert await reader.get_run(parent) is None and await reader.get_run(old) is None
        assert await reader.expired(parent) is not None
        kept = await reader.get_run(child)
        assert kept is not None and kept.parent_run_id == parent and kept.parent_expired
        assert [r.run_id for r in await reader.list_runs(conversation_id='conv')] == [child]
        assert await reader.list_events(parent) == []
        assert await reader.root_of(child) == kept  # lineage stops at the expired parent, it does not break
        policy, shards = await reader.retention()
        assert policy == 86_400_000_000
        assert sum(s.expired for s in shards) == 2 and sum(s.waiting for s in shards) == 1
    assert {digest(t) for t in (SHARED, ONLY_PARENT, ONLY_OLD, ONLY_CHILD)} <= await payload_digests(store)

    # The projection at rest is the sweep's mark. Meanwhile a new writer re-uses ONLY_PARENT:
    # its record is not applied yet, so no kept run references it, but its put made it young.
    before = {p.digest: p.last_modified async for p in store.payloads()}
    await s3_clock_passes(store, max(before.values()))
    async with EventLog(settings) as log:
        await agent(log, 'reuser', 'short').run(ONLY_PARENT, conversation_id='later')
        written = await log.flush()
    refreshed = {p.digest: p.last_modified async for p in store.payloads()}[digest(ONLY_PARENT)]
    assert refreshed > before[digest(ONLY_PARENT)]

    with pytest.raises(UsageError, match='grace period'):
        await sweep_media(ProjectionReader.open(db_path), store, grace=timedelta(0))
    reader = ProjectionReader.open(db_path)
    try:
        # Everything written before the re-use is older than the grace period at this `now`.
        report = await sweep_media(
            reader, store, grace=timedelta(hours=2), now=refreshed + timedelta(hours=2)
        )
    finally:
        reader.close()
    names = {
        digest(t): n
        for n, t in [
            ('SHARED', SHARED),
            ('ONLY_PARENT', ONLY_PARENT),
            ('ONLY_OLD', ONLY_OLD),
            ('ONLY_CHILD', ONLY_CHILD),
        ]
    }
    assert sorted(names.get(p.digest, p.digest) for p in report.deleted) == ['ONLY_OLD']
    assert report.young == 1  # ONLY_PARENT, re-used
    left = await payload_digests(store)
    assert digest(ONLY_OLD) not in left
    assert {digest(SHARED), digest(ONLY_PARENT), digest(ONLY_CHILD)} <= left

    # The re-user's record applies; its history comes back whole, media included.
    async with Projector(settings, db_path=db_path, media_store=store) as projector:
        await projector.wait_for(written)
        history = await continue_run(ProjectionReader.of(projector), run_id='reuser')
        assert any(ONLY_PARENT in str(m) for m in history)

    # A rebuild under the same policy equals the live projection, byte for byte.
    rebuilt = tmp_path / 'rebuilt'
    await rebuild(settings, rebuilt, timeout=120)
    _, difference = verify_paths(db_path, rebuilt)
    assert difference is None

    # The API and the explorer say why the parent is missing, and that the child's parent expired.
    reader = ProjectionReader.open(db_path)
    app = create_app(Source(settings, reader, store))
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url='http://serve'
        ) as client:
            answer = await client.get(f'/api/runs/{parent}')
            assert answer.status_code == 404 and 'dropped by the retention policy' in answer.text
            assert (await client.get(f'/api/runs/{child}')).json()['parent_expired'] is True
            page = await client.get(f'/runs/{child}')
            assert 'expired: dropped by the retention policy' in page.text
    finally:
        reader.close()

    # What an operator sees: the policy and each shard, the expired parent, a dry-run sweep.
    code, out, _ = await cli(settings, db_path, 'retention')
    assert code == 0 and "runs that ended 1 day before their partition's clock are dropped" in out
    code, out, _ = await cli(settings, db_path, 'retention', '--preview-days', '0.5', '--json')
    preview = json.loads(out)  # the child and the re-user, both ended within half a day of the clock
    assert (
        code == 0
        and sum(s['would_keep'] for s in preview) == 2
        and sum(s['would_drop'] for s in preview) == 0
    )
    code, out, _ = await cli(settings, db_path, 'runs', '--conversation-id', 'conv')
    assert code == 0 and 'parent expired' in out  # the note of a narrow table
    code, out, _ = await cli(settings, db_path, 'runs', '--conversation-id', 'conv', '--wide')
    assert code == 0 and f'{parent} (expired)' in out
    code, _, err = await cli(settings, db_path, 'events', parent)
    assert code == 1 and 'dropped by the retention policy' in err
    code, out, err = await cli(settings, db_path, 'retention', 'sweep-media', '--dry-run')
    assert code == 0 and 'would delete' in out, err

    # ... and with another policy the projector refuses the directory rather than mix two.
    with pytest.raises(Exception, match='retention policy'):
        async with Projector(settings.replace(retain_ended_days=3.0), db_path=db_path):
            pass


@tansu_only('SIGKILLs the projector as test_projector_crash.py does, which keeps to the Tansu pass')
async def test_a_sigkilled_projector_with_a_policy_equals_a_clean_rebuild(
    settings: Settings, tmp_path: Path
) -> None:
    """Expiry is staged with the batch that triggers it: a projector killed at random moments (half
    of them aimed between a batch's staging and its commit) while runs expire ends where a clean rebuild
    under the same policy does. The policy is two seconds of log time, so runs expire all along."""
    settings = settings.replace(retain_ended_days=2 / 86_400)
    db_path = tmp_path / 'incremental'
    rng = random.Random(25)
    kills = KILLS // 2
    async with EventLog(settings) as log:
        producer = asyncio.create_task(produce(log, runs=RUNS // 2))
        done = mid_batch = 0
        while done < kills or not producer.done():
            marks = tmp_path / f'marks-{done}'
            child = await start_projector(settings, db_path, marks)
            await asyncio.sleep(rng.uniform(0.8, 2.5))  # the child needs ~1 s to import and start
            if done % 2:
                mid_batch += await kill_mid_batch(child, marks)
            else:
                child.send_signal(signal.SIGKILL)
                await child.wait()
            done += 1
        await producer
        written = log.position
    async with Projector(settings, db_path=db_path) as projector:
        await projector.wait_for(written)
        policy, shards = await ProjectionReader.of(projector).retention()
        kept = await ProjectionReader.of(projector).list_runs()
    assert policy == 2_000_000
    expired = sum(s.expired for s in shards)
    assert expired > 0 and expired + len(kept) == RUNS // 2
    assert all(r.status == 'completed' for r in kept)

    await rebuild(settings, tmp_path / 'clean')
    _, difference = verify_paths(db_path, tmp_path / 'clean')
    assert difference is None, str(difference)
