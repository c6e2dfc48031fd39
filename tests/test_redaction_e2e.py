"""Redaction end to end: the broker, SeaweedFS, RocksDB, the export, the service and the CLI.

A real agent hands its tool secrets under secret-named keys (as an object and as JSON text), its
tool returns one beside a value large enough to be offloaded, and its prompt and answer carry
secrets of well-known formats. With erasure on and off, no secret's bytes are in any record of
any topic, any object of the bucket, any value of the projection's shards, the Parquet export,
the explorer's and the API's pages or the CLI's snapshot: each reads "redacted" instead, and the
run completes. The generated shapes are tests/test_redaction.py's (decision 0047).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from test_cli import cli
from test_erasure import raw_values, sealed_settings

from stepstream import Settings
from stepstream.analytics import export_parquet
from stepstream.media import S3MediaStore
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.serve import app_for, running

pytestmark = pytest.mark.broker


@pytest.mark.parametrize('erasure', [False, True], ids=['plain', 'sealed'])
async def test_no_secret_reaches_anything_stepstream_writes(
    settings: Settings, tmp_path: Path, erasure: bool
) -> None:
    settings = sealed_settings(settings) if erasure else settings.replace(media_threshold_bytes=4096)
    store = S3MediaStore.from_settings(settings.media)  # the store the CLI and the service use
    tag = uuid.uuid4().hex
    secrets = {
        'under a key': f'key-{tag}',
        'nested under a key': f'nested-{tag}',
        'in JSON text arguments': f'text-{tag}',
        'in a list, an object under a key': f'listed-{tag}',
        'in a tool return': f'returned-{tag}',
        'in the prompt (bearer)': f'bearer{tag}',
        'in the answer (OpenAI key)': f'sk-proj-{tag}',
        'in the return text (AWS key)': 'AKIA' + tag[:16].upper(),
    }
    s = secrets

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            args = {
                'api_key': s['under a key'],
                'db': {'password': s['nested under a key'], 'port': 5432},
                'headers': [{'X-Api-Key': {'value': s['in a list, an object under a key']}}, 'plain'],
            }
            return ModelResponse(
                parts=[
                    ToolCallPart('use', args, 'c1'),
                    ToolCallPart('use', json.dumps({'Authorization': s['in JSON text arguments']}), 'c2'),
                ]
            )
        return ModelResponse(parts=[TextPart(f'use {s["in the answer (OpenAI key)"]}')])

    async with (
        EventLog(settings) as log,
        Projector(settings, db_path=tmp_path / 'projection', media_store=store) as projector,
    ):
        agent = Agent(FunctionModel(model), capabilities=[StepPersistence(log=log, media_store=store)])

        @agent.tool_plain
        def use(**kwargs: Any) -> dict[str, Any]:
            blob = f'aws {s["in the return text (AWS key)"]} ' + 'report line\n' * 600  # offloaded
            return {'session_token': s['in a tool return'], 'report': blob}

        result = await agent.run(
            f'Authorization: Bearer {s["in the prompt (bearer)"]}', conversation_id='conv-secrets'
        )
        assert result.output == f'use {s["in the answer (OpenAI key)"]}'  # the agent saw its own values
        await projector.wait_for(await log.flush())
        reader = ProjectionReader.of(projector)
        (run,) = await reader.list_runs(conversation_id='conv-secrets')
        assert run.status == 'completed'

        def clean(where: str, blob: bytes | str) -> None:
            data = blob.encode() if isinstance(blob, str) else blob
            for what, secret in secrets.items():
                assert secret.encode() not in data, f'{what} is in {where}'

        for value in await raw_values(
            settings, settings.topics.step_events_topic, settings.topics.tool_effects_topic
        ):
            clean('a record', value)
        events = await reader.list_events(run.run_id)
        objects = [uri for e in events if e.snapshot is not None for uri in e.snapshot.media or []]
        assert objects  # the large return was offloaded
        for uri in objects:  # each as the bucket holds it (sealed with erasure on)
            clean(f'object {uri}', await store.get(uri))
        for shard in (projector.shards[p] for p in projector.shards.partitions):
            for k, v in shard.logical_items():
                clean(f'shard key {k[:20]!r}', k + v)

        snapshot = await reader.latest_snapshot(run.run_id)  # opened (and unsealed) as a reader sees it
        assert snapshot is not None
        shown = ModelMessagesTypeAdapter.dump_json(snapshot.messages).decode()
        clean('the snapshot', shown)
        assert shown.count('[redacted') >= len(secrets) and 'report line' in shown

        export = tmp_path / 'export'
        await export_parquet(reader, str(export), settings)
        tables = [pq.read_table(path).to_pylist() for path in export.rglob('*.parquet')]
        assert tables
        clean('the export', json.dumps(tables, default=str))

        async with (
            running(app_for(settings, reader=reader, media_store=store), port=0) as server,
            httpx.AsyncClient(base_url=server.url) as client,
        ):
            for path in (
                f'/runs/{run.run_id}',
                f'/api/runs/{run.run_id}',
                f'/api/runs/{run.run_id}/events',
                f'/api/runs/{run.run_id}/tool-effects',
                f'/api/runs/{run.run_id}/snapshots/latest',
            ):
                page = await client.get(path)
                assert page.status_code == 200, path
                clean(path, page.text)
            assert 'redacted' in (await client.get(f'/runs/{run.run_id}')).text

        code, out, err = await cli(settings, tmp_path / 'projection', 'snapshot', run.run_id)
        assert code == 0, err
        clean('stepstream snapshot', out)
        assert '[redacted' in out
