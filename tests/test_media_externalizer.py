"""`MediaExternalizer`: the model receives large media as the store's URL; the history keeps the bytes.

A disk store with a static public URL resolver and a `FunctionModel` that records what each
request carried. The same capability against SeaweedFS, with presigned URLs the model fetches, is
in test_media_e2e.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, cast

import pytest
from pydantic_ai import Agent, ModelMessagesTypeAdapter
from pydantic_ai.messages import (
    AudioUrl,
    BinaryContent,
    DocumentUrl,
    FileUrl,
    ImageUrl,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserContent,
    UserPromptPart,
    VideoUrl,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream.errors import MediaUnavailable
from stepstream.media import (
    NO_CONTEXT,
    DiskMediaStore,
    MediaContext,
    MediaExternalizer,
    make_static_public_url,
    restore_media,
)
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.schemas import StepEvent

pytestmark = [pytest.mark.fast, pytest.mark.once]

CDN = 'https://cdn.example.com/media'
BIG = 100 * 1024
IMAGE = os.urandom(BIG)
AUDIO = os.urandom(BIG)
VIDEO = os.urandom(BIG)
PDF = os.urandom(BIG)


def url_of(data: bytes) -> str:
    return f'{CDN}/{hashlib.sha256(data).hexdigest()}.bin'


class Recorder:
    """A model that answers at once and keeps the messages of every request it received."""

    def __init__(self) -> None:
        self.requests: list[list[ModelMessage]] = []
        self.model = FunctionModel(self.respond)

    def respond(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append(messages)
        return ModelResponse(parts=[TextPart('seen')])


class CountingStore(DiskMediaStore):
    """A disk store that counts uploads, to show a payload crosses to the store once per run."""

    puts = 0

    async def put(self, data: bytes, ctx: MediaContext = NO_CONTEXT) -> str:
        self.puts += 1
        return await super().put(data, ctx)


def parts_of(messages: list[ModelMessage]) -> list[object]:
    """Every item of user prompt and tool return content, flattened."""
    items: list[object] = []
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart | ToolReturnPart):
                    content = part.content
                    items.extend(content if isinstance(content, list | tuple) else [content])
    return items


@pytest.fixture
def store(tmp_path: Path) -> CountingStore:
    return CountingStore(tmp_path / 'media', public_url=make_static_public_url(CDN))


async def test_large_media_reaches_the_model_as_url_parts_by_media_type(store: CountingStore) -> None:
    recorder = Recorder()
    agent = Agent(recorder.model, capabilities=[MediaExternalizer(store)])
    prompt: list[UserContent] = [
        'describe these',
        BinaryContent(IMAGE, media_type='image/png', vendor_metadata={'detail': 'high'}),
        BinaryContent(AUDIO, media_type='audio/wav'),
        BinaryContent(VIDEO, media_type='video/mp4'),
        BinaryContent(PDF, media_type='application/pdf', identifier='report'),
    ]
    result = await agent.run(prompt)

    [received] = recorder.requests
    items = parts_of(received)
    assert items[0] == 'describe these'
    assert not any(isinstance(i, BinaryContent) for i in items)
    image, audio, video, pdf = items[1:]
    assert isinstance(image, ImageUrl) and image.url == url_of(IMAGE) and image.media_type == 'image/png'
    assert image.vendor_metadata == {'detail': 'high'}
    assert isinstance(audio, AudioUrl) and audio.url == url_of(AUDIO) and audio.media_type == 'audio/wav'
    assert isinstance(video, VideoUrl) and video.url == url_of(VIDEO) and video.media_type == 'video/mp4'
    assert isinstance(pdf, DocumentUrl) and pdf.url == url_of(PDF) and pdf.media_type == 'application/pdf'
    assert pdf.identifier == 'report'
    # The bytes are in the store, under the URL's key; the run's own history still holds them.
    assert (store.directory / f'{hashlib.sha256(IMAGE).hexdigest()}.bin').read_bytes() == IMAGE
    assert result.all_messages()[0].parts[0].content == prompt  # type: ignore[union-attr]


async def test_small_and_text_like_media_stay_inline(store: CountingStore) -> None:
    recorder = Recorder()
    agent = Agent(recorder.model, capabilities=[MediaExternalizer(store, threshold_bytes=BIG)])
    small = BinaryContent(IMAGE[: BIG - 1], media_type='image/png')
    json_blob = BinaryContent(b'[' + b'1,' * BIG + b'1]', media_type='application/json')
    await agent.run(['look', small, json_blob])

    [received] = recorder.requests
    assert parts_of(received)[1:] == [small, json_blob]
    assert store.puts == 0


async def test_a_payload_is_uploaded_once_however_many_requests_carry_it(store: CountingStore) -> None:
    seen: list[list[object]] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        items = parts_of(messages)
        seen.append(items)
        calls = sum(isinstance(m, ModelResponse) for m in messages)
        if calls < 3:
            return ModelResponse(parts=[ToolCallPart('camera', {}, tool_call_id=f'call-{calls}')])
        return ModelResponse(parts=[TextPart('three pictures')])

    agent = Agent(FunctionModel(model), capabilities=[MediaExternalizer(store)])

    @agent.tool_plain
    def camera() -> BinaryContent:
        return BinaryContent(IMAGE, media_type='image/jpeg')  # a new object, the same bytes, each call

    result = await agent.run(['here is the first one', BinaryContent(IMAGE, media_type='image/jpeg')])

    assert len(seen) == 4  # the prompt, then three tool cycles
    for i, items in enumerate(seen):
        urls = [item for item in items if isinstance(item, FileUrl)]
        assert [u.url for u in urls] == [url_of(IMAGE)] * (i + 1)
        assert not any(isinstance(item, BinaryContent) for item in items)
    assert store.puts == 1  # four objects with the same bytes, four requests: one upload
    returns = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolReturnPart)]
    assert [type(r.content) for r in returns] == [BinaryContent] * 3


async def test_a_store_without_urls_leaves_media_inline_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    agent = Agent(recorder.model, capabilities=[MediaExternalizer(DiskMediaStore(tmp_path))])
    image = BinaryContent(IMAGE, media_type='image/png')
    with caplog.at_level(logging.WARNING, logger='stepstream.media'):
        await agent.run(['look', image])
    assert parts_of(recorder.requests[0])[1:] == [image]
    assert 'has no public URL for it; give the store a public_url= resolver' in caplog.text


async def test_an_unreachable_store_leaves_media_inline_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / 'not-a-directory'
    blocker.write_text('a file where the store wants its directory')
    recorder = Recorder()
    store = DiskMediaStore(blocker, public_url=make_static_public_url(CDN))
    with pytest.raises(MediaUnavailable):
        await store.put(IMAGE)  # what the capability meets
    agent = Agent(recorder.model, capabilities=[MediaExternalizer(store)])
    image = BinaryContent(IMAGE, media_type='image/png')
    with caplog.at_level(logging.WARNING, logger='stepstream.media'):
        result = await agent.run(['look', image])
    assert result.output == 'seen'
    assert parts_of(recorder.requests[0])[1:] == [image]
    assert 'could not upload it' in caplog.text


async def test_persisted_history_keeps_the_bytes_and_shares_the_stored_object(store: CountingStore) -> None:
    """With StepPersistence on the same store, the model gets a URL and the snapshot a reference
    to the same content-addressed object: the image is stored once, and the log restores bytes."""
    recorder = Recorder()
    log = InMemoryLog()
    agent = Agent(
        recorder.model,
        capabilities=[StepPersistence(log=log, run_id='ext-1', media_store=store), MediaExternalizer(store)],
    )
    await agent.run(['look', BinaryContent(IMAGE, media_type='image/png')])

    assert isinstance(parts_of(recorder.requests[0])[1], ImageUrl)
    [snapshot] = [
        r.record.snapshot for r in log.records if isinstance(r.record, StepEvent) and r.record.snapshot
    ]
    assert len(snapshot.messages) < 2048  # a reference, not the image
    restored = await restore_media(ModelMessagesTypeAdapter.validate_json(snapshot.messages), store)
    image = parts_of(restored)[1]
    assert isinstance(image, BinaryContent) and image.data == IMAGE and image.media_type == 'image/png'
    stored = [p for p in store.directory.iterdir() if p.suffix == '.bin']
    assert stored == [store.directory / f'{hashlib.sha256(IMAGE).hexdigest()}.bin']


async def test_response_files_and_tool_calls_are_left_alone(store: CountingStore) -> None:
    """Only what the model is sent as input changes: requests' prompts and tool returns."""
    recorder = Recorder()
    history: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart('draw')]),
        ModelResponse(parts=[ToolCallPart('draw', {'data': 'x' * BIG}, tool_call_id='c1')]),
        ModelRequest(
            parts=[ToolReturnPart('draw', {'png': BinaryContent(IMAGE, media_type='image/png')}, 'c1')]
        ),
        ModelResponse(parts=[TextPart('done')]),
    ]
    agent = Agent(recorder.model, capabilities=[MediaExternalizer(store)])
    await agent.run('again', message_history=history)

    received = recorder.requests[0]
    assert received[1] is history[1]  # a response goes back as it came
    [sent] = [p.content for p in received[2].parts if isinstance(p, ToolReturnPart)]
    [kept] = [p.content for p in history[2].parts if isinstance(p, ToolReturnPart)]
    assert isinstance(cast(dict[str, Any], sent)['png'], ImageUrl)
    assert isinstance(cast(dict[str, Any], kept)['png'], BinaryContent)


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match='threshold_bytes must be a positive int'):
        MediaExternalizer(DiskMediaStore(tmp_path), threshold_bytes=0)
    with pytest.raises(TypeError, match='needs a MediaStore'):
        MediaExternalizer(tmp_path)
