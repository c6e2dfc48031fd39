"""A projection built from real agent runs, served by `stepstream serve` in the test's event loop.

The API tests and the browser tests read the same runs: an orchestrator with two delegates
(lineage), a run whose prompt holds an image the log offloaded to S3, a publisher cancelled in
the middle of its tool (an effect left `unknown_after_crash`), and a record the projector
dead-lettered.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.structs import TopicPartition
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import BinaryContent

from stepstream import Settings
from stepstream.media import S3MediaStore
from stepstream.producer import EventLog, StepPersistence, annotate_tool_effect, resolve_tool_effect
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.serve import app_for, running

from agents import answers, calls_then_answers, priced_calls


def png(width: int = 48, height: int = 48, seed: int = 7) -> bytes:
    """A real PNG of random pixels (so it does not compress below the media threshold)."""
    rng = random.Random(seed)
    raw = b''.join(b'\x00' + bytes(rng.randrange(256) for _ in range(width * 3)) for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))

    header = struct.pack('>IIBBBBB', width, height, 8, 2, 0, 0, 0)
    return (
        b'\x89PNG\r\n\x1a\n'
        + chunk(b'IHDR', header)
        + chunk(b'IDAT', zlib.compress(raw))
        + chunk(b'IEND', b'')
    )


IMAGE = png()

T = TypeVar('T')


@dataclass
class Served:
    """The served projection and the handles a test needs to add to it."""

    url: str
    settings: Settings
    log: EventLog
    projector: Projector
    orchestrator_run: str
    delegate_runs: list[str]
    image_run: str
    crashed_run: str = 'publisher-crash'

    async def settle(self) -> None:
        """Wait until the projection holds everything written so far."""
        await self.projector.wait_for(await self.log.flush())

    async def read_until(
        self,
        read: Callable[[ProjectionReader], Awaitable[T]],
        done: Callable[[T], bool],
        timeout: float = 60.0,
    ) -> T:
        """Read the projection until `done` holds for what `read` returns; for records written
        by another process (the CLI), whose position this test's log does not know."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not done(value := await read(ProjectionReader.of(self.projector))):
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f'the projection did not get there in {timeout:g}s: {value!r}')
            await asyncio.sleep(0.05)
        return value

    async def add_crashed_run(self, run_id: str) -> str:
        """One more run cancelled in the middle of its tool (an unknown effect), applied on return."""
        await crash_in_tool(self.log, run_id, conversation_id=f'conv-{run_id}')
        await self.settle()
        return run_id

    @contextlib.asynccontextmanager
    async def live_call(self, run_id: str) -> AsyncIterator[str]:
        """A run whose tool runs for as long as the block lasts (a call in flight), applied on entry."""
        entered, release = asyncio.Event(), asyncio.Event()
        agent = Agent(
            calls_then_answers('send_invoice'),
            capabilities=[StepPersistence(log=self.log, agent_name='billing', run_id=run_id)],
        )

        @agent.tool
        async def send_invoice(ctx: RunContext[Any]) -> str:
            await annotate_tool_effect(ctx, idempotency_key='invoice:42', effect_summary='emails an invoice')
            entered.set()
            await release.wait()
            return 'sent'

        task = asyncio.create_task(agent.run('bill the customer', conversation_id=f'conv-{run_id}'))
        try:
            await asyncio.wait_for(entered.wait(), 30)
            await self.settle()
            yield run_id
        finally:
            release.set()
            await task
            await self.settle()

    async def add_variety(self) -> dict[str, str]:
        """A failed run, a long run and a resolved effect, applied on return; their run_ids by kind.

        With the runs the projection starts with (an orchestrator and its delegates, an image, a
        cancelled run with an unknown effect, a dead letter), every page of the explorer has
        something to show.
        """
        failing = Agent(
            calls_then_answers('charge_card', args={'amount_cents': 4200}),
            capabilities=[StepPersistence(log=self.log, agent_name='cashier', run_id='cashier-failed')],
        )

        @failing.tool_plain
        def charge_card(amount_cents: int) -> str:
            raise RuntimeError(f'card declined for {amount_cents} cents')

        with contextlib.suppress(RuntimeError):
            await failing.run('charge the customer', conversation_id='conv-failed')

        long = Agent(
            priced_calls('step', calls=25),
            capabilities=[StepPersistence(log=self.log, agent_name='marathon', run_id='marathon-long')],
        )

        @long.tool_plain
        def step(n: int) -> str:
            return f'step {n} done'

        await long.run('go the distance', conversation_id='conv-long')
        resolved = await self.add_crashed_run('publisher-resolved')
        reader = ProjectionReader.of(self.projector)
        [effect] = await reader.list_unresolved_tool_effects(resolved)
        await resolve_tool_effect(
            self.log,
            effect,
            resolution='happened',
            note='the announcement is in #releases',
            operator='oncall-bob',
            writer_id='test-resolver',
        )
        await self.settle()
        return {'failed': 'cashier-failed', 'long': 'marathon-long', 'resolved': resolved}

    async def add_run(self, conversation_id: str, agent_name: str = 'latecomer') -> str:
        """One more finished run, applied before this returns; its run_id."""
        agent = Agent(answers('late'), capabilities=[StepPersistence(log=self.log, agent_name=agent_name)])
        await agent.run('hello', conversation_id=conversation_id)
        await self.settle()
        runs = await ProjectionReader.of(self.projector).list_runs(conversation_id=conversation_id)
        return runs[-1].run_id


async def _write_runs(log: EventLog) -> None:
    researcher = Agent(
        calls_then_answers('search'), capabilities=[StepPersistence(log=log, agent_name='researcher')]
    )

    @researcher.tool_plain
    def search() -> str:
        return 'found 3 documents'

    orchestrator = Agent(
        calls_then_answers('research', calls=2),
        capabilities=[StepPersistence(log=log, agent_name='orchestrator')],
    )

    @orchestrator.tool_plain
    async def research() -> str:
        return (await researcher.run('look it up', conversation_id='conv-serve')).output

    await orchestrator.run('plan the release', conversation_id='conv-serve')

    viewer = Agent(answers('a square of noise'), capabilities=[StepPersistence(log=log, agent_name='viewer')])
    await viewer.run(
        ['what is in this image?', BinaryContent(IMAGE, media_type='image/png')], conversation_id='conv-image'
    )

    await crash_in_tool(log, 'publisher-crash', conversation_id='conv-crash')


async def crash_in_tool(log: EventLog, run_id: str, *, conversation_id: str) -> None:
    """A publisher run cancelled in the middle of its tool: its effect is left `unknown_after_crash`."""
    publisher = Agent(
        calls_then_answers('send_announcement'),
        capabilities=[StepPersistence(log=log, agent_name='publisher', run_id=run_id)],
    )
    entered = asyncio.Event()

    @publisher.tool
    async def send_announcement(ctx: RunContext[Any]) -> str:
        await annotate_tool_effect(ctx, idempotency_key='announce:#releases', effect_summary='posts to Slack')
        entered.set()
        await asyncio.sleep(3600)  # cancelled here, in the middle of the side effect
        return 'posted'

    task = asyncio.create_task(publisher.run('announce the release', conversation_id=conversation_id))
    await asyncio.wait_for(entered.wait(), 30)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _poison(settings: Settings) -> dict[TopicPartition, int]:
    """A record that is no stepstream record; the position just past it."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await producer.start()
    try:
        sent = await producer.send_and_wait(
            settings.topics.step_events_topic, b'not an avro record', key=b'poison-run'
        )
    finally:
        await producer.stop()
    return {TopicPartition(sent.topic, sent.partition): sent.offset + 1}


@contextlib.asynccontextmanager
async def served_projection(settings: Settings, db_path: Path) -> AsyncIterator[Served]:
    """Write the runs, project them, and serve the projection on a free loopback port."""
    async with EventLog(settings) as log, Projector(settings, db_path=db_path) as projector:
        await _write_runs(log)
        await projector.wait_for(await log.flush())
        await projector.wait_for(await _poison(settings))
        reader = ProjectionReader.of(projector)
        [orchestrator] = await reader.list_runs(agent_name='orchestrator')
        delegates = [r.run_id for r in await reader.list_runs(parent_run_id=orchestrator.run_id)]
        [image_run] = await reader.list_runs(agent_name='viewer')
        opened = ProjectionReader.open(db_path, media_store=S3MediaStore.from_settings(settings.media))
        try:
            async with running(app_for(settings, reader=opened), port=0) as server:
                yield Served(
                    url=server.url,
                    settings=settings,
                    log=log,
                    projector=projector,
                    orchestrator_run=orchestrator.run_id,
                    delegate_runs=delegates,
                    image_run=image_run.run_id,
                )
        finally:
            opened.close()
