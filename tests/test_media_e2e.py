"""Media offload through real agent runs: S3 (SeaweedFS) holds the bytes, Kafka the references."""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import obstore
import pytest
from aiokafka import AIOKafkaConsumer
from pydantic_ai import Agent, BinaryContent
from pydantic_ai.messages import (
    ImageUrl,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserContent,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

from stepstream import MediaUnavailable, Settings
from stepstream.embedded import EmbeddedStack
from stepstream.media import MediaContext, MediaExternalizer, PublicUrlResolver, S3MediaStore
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader, continue_run

from agents import calls_then_answers, tool_returns

pytestmark = pytest.mark.broker

IMAGE = os.urandom(5 * 1024 * 1024)
TOOL_OUTPUT = 'row,' * 50_000  # 200 KB


def isolated_store(settings: Settings) -> tuple[S3MediaStore, str]:
    prefix = f'test-{uuid.uuid4().hex[:8]}/'
    return S3MediaStore.from_settings(settings.media, key_prefix=prefix), prefix


async def raw_sizes(settings: Settings) -> list[int]:
    consumer = AIOKafkaConsumer(
        settings.topics.step_events_topic,
        settings.topics.tool_effects_topic,
        bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset='earliest',
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        sizes: list[int] = []
        while True:
            batches = await consumer.getmany(timeout_ms=1500)
            if not batches:
                return sizes
            sizes.extend(len(m.value or b'') for batch in batches.values() for m in batch)
    finally:
        await consumer.stop()


def count_objects(settings: Settings, prefix: str) -> int:
    store, _ = isolated_store(settings)
    raw = store._store  # the obstore handle, to look at the bucket directly
    return sum(len(chunk) for chunk in obstore.list(raw, prefix=prefix))


async def test_image_and_big_tool_output_round_trip_with_small_records(
    settings: Settings, db_path: Path
) -> None:
    store, _prefix = isolated_store(settings)
    async with (
        EventLog(settings) as log,
        Projector(settings, db_path=db_path, media_store=store) as projector,
    ):
        agent = Agent(
            calls_then_answers('export'),
            capabilities=[StepPersistence(log=log, agent_name='media', media_store=store)],
        )

        @agent.tool_plain
        def export() -> str:
            return TOOL_OUTPUT

        prompt = ['what is in this picture?', BinaryContent(IMAGE, media_type='image/png')]
        result = await agent.run(prompt, conversation_id='conv-media')
        await projector.wait_for(await log.flush())
        [run] = await ProjectionReader.of(projector).list_runs(conversation_id='conv-media')
        history = await continue_run(ProjectionReader.of(projector), run_id=run.run_id)
        # Equal to what Pydantic AI's own JSON round trip of the run gives (BinaryContent of an
        # image comes back as its BinaryImage subclass either way).
        expected = ModelMessagesTypeAdapter.validate_json(
            ModelMessagesTypeAdapter.dump_json(result.all_messages())
        )
        assert history == expected
        assert any(
            isinstance(p, ToolReturnPart) and p.content == TOOL_OUTPUT for m in history for p in m.parts
        )
        follow_up = await agent.run('and now?', message_history=history, conversation_id='conv-media')
        assert follow_up.all_messages()[: len(history)] == history
    sizes = await raw_sizes(settings)
    assert sizes and max(sizes) < 64 * 1024


async def test_same_image_in_many_messages_and_runs_is_stored_once(settings: Settings, db_path: Path) -> None:
    store, prefix = isolated_store(settings)
    async with (
        EventLog(settings) as log,
        Projector(settings, db_path=db_path) as projector,
    ):
        for run, calls in enumerate([4, 4, 2]):  # ten tool-return messages carrying the same image
            agent = Agent(
                calls_then_answers('camera', calls=calls),
                capabilities=[StepPersistence(log=log, run_id=f'img-{run}', media_store=store)],
            )

            @agent.tool_plain
            def camera() -> BinaryContent:
                return BinaryContent(IMAGE, media_type='image/png')

            await agent.run('take pictures')
        await projector.wait_for(await log.flush())
    reader = ProjectionReader.open(db_path, media_store=store)
    try:
        snapshots = [await reader.latest_snapshot(f'img-{run}') for run in range(3)]
    finally:
        reader.close()
    images = [
        p
        for snap in snapshots
        for m in (snap.messages if snap else [])
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    ]
    assert len(images) == 10
    assert count_objects(settings, prefix) == 1


async def test_s3_down_at_a_snapshot_fails_the_run_without_dangling_records(tmp_path: Path) -> None:
    async with EmbeddedStack(tmp_path / 'stack', partitions=1) as stack:
        settings = stack.settings
        async with EventLog(settings) as log, Projector(settings) as projector:
            agent = Agent(
                calls_then_answers('export'), capabilities=[StepPersistence(log=log, run_id='s3-down')]
            )

            @agent.tool_plain
            def export() -> str:
                return TOOL_OUTPUT

            await asyncio_to_thread(stack.stop_s3)
            with pytest.raises(MediaUnavailable) as failure:
                await agent.run('export everything')
            assert settings.media.s3_endpoint is not None and settings.media.s3_endpoint in str(failure.value)
            assert settings.media.s3_bucket in str(failure.value)
            await projector.wait_for(await log.flush())
            reader = ProjectionReader.of(projector)
            run = await reader.get_run('s3-down')
            assert run is not None and run.status == 'failed'
            # The tool cycle's snapshot (holding the big output) was never sent. The failure
            # snapshot holds only the open call, so nothing in the log points at a missing object.
            snapshots = [e.snapshot for e in await reader.list_events('s3-down') if e.snapshot is not None]
            assert [s.state for s in snapshots] == ['interrupted']
            assert (
                'stepstream:media' not in snapshots[0].messages and TOOL_OUTPUT not in snapshots[0].messages
            )


async def asyncio_to_thread(fn: object) -> None:
    import asyncio

    await asyncio.to_thread(fn)  # type: ignore[arg-type]


def large_everywhere_model(big: str) -> FunctionModel:
    """Calls `export` with large arguments, then `fetch`, then answers; reports usage (no estimates)."""

    async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = len(tool_returns(messages))
        usage = RequestUsage(input_tokens=10, output_tokens=10)
        if done == 0:
            call = ToolCallPart(
                'export', {'filter': big + 'args', 'options': {'notes': [big + 'nested']}}, tool_call_id='e'
            )
            return ModelResponse(parts=[call], usage=usage)
        if done == 1:
            return ModelResponse(parts=[ToolCallPart('fetch', {}, tool_call_id='f')], usage=usage)
        return ModelResponse(parts=[TextPart('done')], usage=usage)

    return FunctionModel(model)


def agent_with_large_payloads(big: str, capabilities: list[Any]) -> Agent[None, str]:
    agent = Agent(
        large_everywhere_model(big),
        instructions=big + 'instructions',
        system_prompt=big + 'system',
        capabilities=capabilities,
    )

    @agent.tool_plain
    def export(filter: str, options: dict[str, Any]) -> dict[str, Any]:
        # 1,000 items of 50 KB, each under the threshold: 50 MB in one nested value.
        return {'report': {'rows': [f'{i:04}' + 'r' * 50_000 for i in range(1000)], 'total': 1000}}

    @agent.tool_plain
    def fetch() -> dict[str, Any]:
        return {'doc': {'body': 'd' * 2_000_000, 'pages': 3}}

    return agent


async def test_a_run_that_succeeds_without_persistence_succeeds_with_it(
    settings: Settings, db_path: Path
) -> None:
    """Large values in nested tool returns, tool-call arguments, instructions, system and user prompts."""
    big = 'p' * 100_000
    prompt = big + 'user'
    plain = await agent_with_large_payloads(big, []).run(prompt)

    store, _prefix = isolated_store(settings)
    async with (
        EventLog(settings) as log,
        Projector(settings, db_path=db_path, media_store=store) as projector,
    ):
        persisted = agent_with_large_payloads(
            big, [StepPersistence(log=log, run_id='large', media_store=store)]
        )
        result = await persisted.run(prompt, conversation_id='conv-large')
        assert result.output == plain.output
        await projector.wait_for(await log.flush())
        history = await continue_run(ProjectionReader.of(projector), run_id='large')
    expected = ModelMessagesTypeAdapter.validate_json(
        ModelMessagesTypeAdapter.dump_json(result.all_messages())
    )
    assert history == expected
    sizes = await raw_sizes(settings)
    assert sizes and max(sizes) < 64 * 1024


def presigned_urls(settings: Settings) -> PublicUrlResolver:
    """Presigned GET URLs on the stack's bucket: what a model provider fetches from a private bucket."""
    bucket = S3MediaStore.from_settings(settings.media).object_store

    async def resolve(uri: str, ctx: MediaContext, key: str) -> str:
        return await obstore.sign_async(bucket, 'GET', key, timedelta(minutes=10))

    return resolve


async def test_the_model_fetches_large_media_from_s3_and_the_log_keeps_the_bytes(
    settings: Settings, db_path: Path
) -> None:
    """MediaExternalizer on SeaweedFS: the model receives a URL, fetches the image by it, and the
    run's persisted history (shared store, one object) still continues with the image's bytes."""
    prefix = f'test-{uuid.uuid4().hex[:8]}/'
    store = S3MediaStore.from_settings(settings.media, key_prefix=prefix, public_url=presigned_urls(settings))
    fetched: list[bytes] = []

    async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        [url] = [
            item
            for m in messages
            for p in m.parts
            if isinstance(p, UserPromptPart) and not isinstance(p.content, str)
            for item in p.content
            if isinstance(item, ImageUrl)
        ]
        assert url.media_type == 'image/png'
        async with httpx.AsyncClient() as http:  # as a provider would
            response = await http.get(url.url)
        response.raise_for_status()
        fetched.append(response.content)
        return ModelResponse(parts=[TextPart(f'an image of {len(response.content)} bytes')])

    async with (
        EventLog(settings) as log,
        Projector(settings, db_path=db_path, media_store=store) as projector,
    ):
        agent = Agent(
            FunctionModel(model),
            capabilities=[
                StepPersistence(log=log, agent_name='vision', media_store=store),
                MediaExternalizer(store),
            ],
        )
        prompt: list[UserContent] = ['what is in this picture?', BinaryContent(IMAGE, media_type='image/png')]
        await agent.run(prompt, conversation_id='conv-vision')
        await projector.wait_for(await log.flush())
        [run] = await ProjectionReader.of(projector).list_runs(conversation_id='conv-vision')
        history = await continue_run(ProjectionReader.of(projector), run_id=run.run_id)

    assert fetched == [IMAGE]
    [image] = [
        item
        for p in history[0].parts
        if isinstance(p, UserPromptPart) and not isinstance(p.content, str)
        for item in p.content
        if isinstance(item, BinaryContent)
    ]
    assert image.data == IMAGE
    assert count_objects(settings, prefix) == 1  # the model's URL and the snapshot's reference
