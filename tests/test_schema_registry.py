"""Registry mode: the Confluent wire format with a real schema registry (AxonOps, built with Go).

One registry serves the whole module (`tests/schema_registry.py` builds and starts it); each test
uses subjects of its own topics. What is proven here: the committed schema versions register in
order under FULL_TRANSITIVE and an incompatible one is refused; HTTPS with a private CA and basic
auth work, and their failures name the setting; the producer looks each schema up once and writes
the Confluent format that confluent-kafka's `DeserializingConsumer` reads field for field; a topic
moves from one format to the other under a live projector, which a rebuild and the export agree
with; records that cannot be read go to the DLQ, and a registry that does not answer makes the
projector wait; a producer cut off from the registry fails its durability point, loses nothing, and
goes on writing what it has ids for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition
from pydantic_ai import Agent

from stepstream import Settings
from stepstream.audit import audit_log
from stepstream.errors import SchemaRegistryError
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.projector._apply import EVENTS, SourceRecord
from stepstream.projector._rebuild import rebuild
from stepstream.projector._verify import verify_paths
from stepstream.projector._wire import WireFormats
from stepstream.readmodel import ProjectionReader
from stepstream.schema_registry import SchemaRegistry
from stepstream.schemas import (
    SCHEMA_DIR,
    STEP_EVENT_SCHEMA,
    LogRecord,
    SnapshotDelta,
    StepEvent,
    ToolEffectTransition,
    confluent_schema_id,
    decode,
    encode,
    from_confluent,
    load_schema_versions,
    schema_of,
    subject_of,
    to_confluent,
)
from stepstream.settings import RegistrySettings
from stepstream.topics import Position, ensure_topics, murmur2_partition

from agents import answers, calls_then_answers
from certificates import TestCA
from schema_registry import running_registry

pytestmark = pytest.mark.broker

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(scope='module')
def registry_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_registry(tmp_path_factory.mktemp('registry') / 'registry.log') as url:
        yield url


@pytest.fixture
def registry_settings(settings: Settings, registry_url: str) -> Settings:
    return settings.replace(schema_registry_url=registry_url)


# -- evolution, enforced by the registry ---------------------------------------------------------


async def test_every_committed_schema_version_registers_in_order_under_full_transitive(
    registry_url: str, tmp_path: Path
) -> None:
    """DESIGN.md's rule (every version reads every other) is FULL_TRANSITIVE; the registry checks it.

    `stepstream schemas register` sets it on both topics' subjects and registers every committed
    version oldest first; the registry refuses a version that breaks the rule (next test). Run
    again, it registers nothing new: the same ids.
    """
    code, _out, err = await stepstream_cli(tmp_path, 'schemas', 'register', '--topic-prefix', 'evolution')
    assert code == 2 and 'set STEPSTREAM_SCHEMA_REGISTRY_URL' in err
    command = ['schemas', 'register', '--schema-registry-url', registry_url, '--topic-prefix', 'evolution']
    outputs = []
    for _ in range(2):
        code, out, err = await stepstream_cli(tmp_path, *command)
        assert code == 0, err
        outputs.append(out)
    assert outputs[0] == outputs[1]
    versions = load_schema_versions()
    expected = {
        'evolution.step-events-value': len(versions['step_event']),
        'evolution.tool-effects-value': len(versions['tool_effect_transition']),
    }
    lines = dict(line.split(' (FULL_TRANSITIVE): ') for line in outputs[0].splitlines())
    assert {subject: len(ids.split(', ')) for subject, ids in lines.items()} == expected
    assert all(n >= 2 for n in expected.values())


async def test_a_version_that_breaks_the_rules_is_refused_by_the_registry(
    registry_url: str, tmp_path: Path
) -> None:
    """What makes the test above fail: a new version adding a field without a default."""
    for path in SCHEMA_DIR.glob('tool_effect_transition.v*.avsc'):
        shutil.copy(path, tmp_path)
    newest = load_schema_versions(tmp_path)['tool_effect_transition'][-1]
    schema = json.loads(newest.path.read_text())
    schema['fields'].append({'name': 'operator_team', 'type': 'string'})  # no default
    (tmp_path / f'tool_effect_transition.v{newest.version + 1}.avsc').write_text(json.dumps(schema))
    history = load_schema_versions(tmp_path)['tool_effect_transition']
    async with SchemaRegistry(RegistrySettings(schema_registry_url=registry_url), timeout_s=10) as registry:
        with pytest.raises(
            SchemaRegistryError, match=rf'refused tool_effect_transition.v{newest.version + 1}'
        ):
            await registry.register_history('evolution.broken-value', history)


async def test_a_producer_is_told_when_the_registry_refuses_its_schema(registry_url: str) -> None:
    """A subject whose history the newest version breaks: registering it is refused, with the reason."""
    subject = 'refusing.step-events-value'
    settings = Settings(schema_registry_url=registry_url)
    other = {'type': 'record', 'name': 'StepEvent', 'namespace': 'io.stepstream'}
    other['fields'] = [{'name': 'only_this', 'type': 'string'}]
    async with SchemaRegistry(settings.registry, timeout_s=settings.kafka.ack_timeout_s) as registry:
        await registry._client.put(f'/config/{subject}', json={'compatibility': 'FULL_TRANSITIVE'})
        await registry._client.post(f'/subjects/{subject}/versions', json={'schema': json.dumps(other)})
        with pytest.raises(SchemaRegistryError, match=r'refused step_event v\d+ .* as incompatible') as no:
            await registry.id_of(subject, STEP_EVENT_SCHEMA)
        assert no.value.refused  # an answer, not an outage: `stepstream schemas register` exits 1
        assert registry.cached_id(subject, STEP_EVENT_SCHEMA) is None


async def test_a_registry_behind_tls_and_basic_auth(tmp_path: Path) -> None:
    """A managed registry's setup: HTTPS from a private CA, and a user and password."""
    ca = TestCA(tmp_path / 'ca')
    server = ca.issue('registry', server=True)
    config = f"""
storage: {{type: memory}}
security:
  tls: {{enabled: true, cert_file: {server.cert}, key_file: {server.key}}}
  auth: {{enabled: true, methods: [basic], bootstrap: {{enabled: true}}}}
"""
    users = {
        'SCHEMA_REGISTRY_BOOTSTRAP_USERNAME': 'producer',
        'SCHEMA_REGISTRY_BOOTSTRAP_PASSWORD': 's3cret-pw',
    }
    with running_registry(tmp_path / 'registry.log', config=config, env=users, tls=True) as url:
        settings = Settings(
            schema_registry_url=url,
            schema_registry_username='producer',
            schema_registry_password='s3cret-pw',  # type: ignore[arg-type]
            schema_registry_cafile=str(ca.cafile),
        )
        async with SchemaRegistry(settings.registry, timeout_s=settings.kafka.ack_timeout_s) as registry:
            schema_id = await registry.id_of('secure.step-events-value', STEP_EVENT_SCHEMA)
        async with SchemaRegistry(
            settings.registry, timeout_s=settings.kafka.ack_timeout_s
        ) as registry:  # a reader: nothing cached
            assert await registry.version_of(schema_id) is STEP_EVENT_SCHEMA
        wrong = settings.replace(schema_registry_password='wrong')
        async with SchemaRegistry(wrong.registry, timeout_s=wrong.kafka.ack_timeout_s) as registry:
            with pytest.raises(SchemaRegistryError, match=r'\(401\).*STEPSTREAM_SCHEMA_REGISTRY_PASSWORD'):
                await registry.version_of(schema_id)
        untrusting = settings.replace(schema_registry_cafile=None)
        async with SchemaRegistry(untrusting.registry, timeout_s=untrusting.kafka.ack_timeout_s) as registry:
            with pytest.raises(SchemaRegistryError, match=r'not trusted.*STEPSTREAM_SCHEMA_REGISTRY_CAFILE'):
                await registry.version_of(schema_id)
    assert 's3cret-pw' not in repr(settings)


# -- the producer writes it, outside tools read it ------------------------------------------------


async def test_registry_mode_writes_what_confluent_kafkas_avro_deserializer_reads(
    registry_settings: Settings, registry_url: str, db_path: Path
) -> None:
    gate = Forwarder(int(registry_url.rsplit(':', 1)[1]))
    async with gate, EventLog(registry_settings.replace(schema_registry_url=gate.url)) as log:
        await run_agents(log, 'outside')
        await run_agents(log, 'outside')
        position = await log.flush()
    # One look-up per schema (not found in a fresh registry: registered), for all the records.
    prefix = registry_settings.topics.topic_prefix
    assert sorted(gate.requests) == [
        f'POST /subjects/{prefix}.step-events-value',
        f'POST /subjects/{prefix}.step-events-value/versions',
        f'POST /subjects/{prefix}.tool-effects-value',
        f'POST /subjects/{prefix}.tool-effects-value/versions',
    ]
    assert sum(position.values()) > 20
    raw = await read_raw(registry_settings, position)
    decoded: dict[tuple[str, int, int], LogRecord] = {}
    async with SchemaRegistry(
        registry_settings.registry, timeout_s=registry_settings.kafka.ack_timeout_s
    ) as registry:
        for where, value in raw.items():
            schema_id = confluent_schema_id(value)
            assert schema_id is not None, value[:10]
            decoded[where] = record = decode(from_confluent(value, await registry.version_of(schema_id)))
            # The id is the one the registry holds for the newest version under the topic's subject.
            assert schema_id == await registry.id_of(subject_of(where[0]), schema_of(record))
    assert {type(r) for r in decoded.values()} == {StepEvent, ToolEffectTransition}

    deserialized = await asyncio.to_thread(read_with_confluent_kafka, registry_settings, position)
    assert deserialized.keys() == raw.keys()
    for where, record in decoded.items():
        assert deserialized[where] == as_avro_dict(record), where

    async with Projector(registry_settings, db_path=db_path) as projector:
        await projector.wait_for(position, timeout=30)
        reader = ProjectionReader.of(projector)
        runs = await reader.list_runs()
        assert sorted(r.status for r in runs) == ['completed'] * 4
        assert all(r.gaps == [] and r.event_count == r.last_seq + 1 for r in runs)
        effects = [await reader.get_tool_effect(r.run_id, 'call-0') for r in runs if r.agent_name == 'worker']
        assert [e.status for e in effects if e is not None] == ['completed', 'completed']
        assert projector.dead_lettered == 0


def kcat_without_avro() -> str | None:
    """Why kcat cannot read the registry format here, or None when it can."""
    if shutil.which('kcat') is None:
        return 'kcat is not installed (apt-get install kcat)'
    features = subprocess.run(['kcat', '-V'], capture_output=True, text=True, check=False).stdout
    if 'avro' not in features.lower():
        return (
            'this kcat is built without Avro/Schema-Registry support (Debian 12 kcat 1.7.1 is); '
            "confluent-kafka's AvroDeserializer is the outside reader tested instead"
        )
    return None


@pytest.mark.skipif(kcat_without_avro() is not None, reason=kcat_without_avro() or '')
async def test_kcat_reads_the_registry_format(registry_settings: Settings) -> None:
    async with EventLog(registry_settings) as log:
        await run_agents(log, 'kcat')
        position = await log.flush()
    topic = registry_settings.topics.step_events_topic
    command = ['kcat', '-C', '-b', registry_settings.kafka.bootstrap_servers, '-t', topic, '-e', '-q']
    command += ['-s', 'value=avro', '-r', registry_settings.registry.schema_registry_url or '', '-f', '%s\n']
    output = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    values = [json.loads(line) for line in output.splitlines() if line.strip()]
    assert len(values) == sum(n for tp, n in position.items() if tp.topic == topic)
    assert {v['kind'] for v in values} >= {'run_started', 'tool_call_started', 'run_completed'}


# -- one reader for both formats -----------------------------------------------------------------


async def test_a_topic_moves_to_the_registry_format_without_a_rebuild(
    settings: Settings, registry_settings: Settings, tmp_path: Path
) -> None:
    live, rebuilt = tmp_path / 'live', tmp_path / 'rebuilt'
    mixed = [event('mixed', seq, kind) for seq, kind in enumerate(MIXED_KINDS)]
    async with Projector(registry_settings, db_path=live) as projector:
        async with EventLog(settings) as plain:  # the default: single-object encoding
            await run_agents(plain, 'before')
            for record in mixed[:3]:
                await plain.append(record)
            await projector.wait_for(await plain.flush(), timeout=30)
        async with EventLog(registry_settings) as confluent:
            for record in mixed[2:]:  # seq 2 again: a resend across the switch, in the other format
                await confluent.append(record)
            await run_agents(confluent, 'after')
            end = await confluent.flush()
        await projector.catch_up(timeout=30)
        reader = ProjectionReader.of(projector)
        run = await reader.get_run('mixed')
        assert run is not None and run.status == 'completed' and run.gaps == [] and run.event_count == 5
        assert [e.seq for e in await reader.list_events('mixed')] == [0, 1, 2, 3, 4]
        assert projector.duplicates_ignored >= 1 and projector.dead_lettered == 0
        runs = await reader.list_runs()
        assert len(runs) == 5
        events = sum([len(await reader.list_events(r.run_id)) for r in runs])
    raw = await read_raw(settings, end)
    assert {value[:1] for value in raw.values()} == {b'\xc3', b'\x00'}  # both formats in the topics
    # A record hashes alike in either format: the agents' runs verify from the topics; the
    # hand-written run carries no links, so a chained reader reads it broken (the projection too).
    chains = {r.run_id: r.chain for r in runs}
    assert chains.pop('mixed') == 'broken' and set(chains.values()) == {'intact'}
    audited = {verdict.run_id: verdict.integrity for verdict in (await audit_log(registry_settings)).runs}
    assert not audited.pop('mixed').ok  # type: ignore[union-attr]
    assert all(i is not None and i.ok and i.chain == 'intact' for i in audited.values()), audited

    await rebuild(registry_settings, rebuilt, timeout=60)
    compared, difference = verify_paths(live, rebuilt)
    assert difference is None and compared > 0

    # The export's replay of the topics reads both formats too.
    export = ('export', '--from-topics', '--out', str(tmp_path / 'export'))
    code, out, err = await stepstream_cli(tmp_path, *export, env=registry_settings.to_env())
    assert code == 0, err
    assert f'exported 5 runs, {events} events' in out, out


MIXED_KINDS = [
    'run_started',
    'model_request_started',
    'model_request_completed',
    'snapshot_saved',
    'run_completed',
]


def event(run_id: str, seq: int, kind: str) -> StepEvent:
    snapshot = None
    if kind == 'snapshot_saved':
        snapshot = SnapshotDelta(snapshot_seq=0, state='complete', prefix_len=0, messages='[]')
    return StepEvent(
        run_id=run_id,
        seq=seq,
        writer_id='w-mixed',
        timestamp=NOW,
        kind=kind,  # type: ignore[arg-type]
        agent_name='mixed',
        step_index=seq,
        snapshot=snapshot,
    )


# -- hostile input --------------------------------------------------------------------------------


async def test_confluent_records_that_cannot_be_read_go_to_the_dlq(
    registry_settings: Settings, db_path: Path
) -> None:
    settings = registry_settings
    topic = settings.topics.step_events_topic
    async with SchemaRegistry(settings.registry, timeout_s=settings.kafka.ack_timeout_s) as registry:
        step_event_id = await registry.id_of(subject_of(topic), STEP_EVENT_SCHEMA)
        foreign = {'type': 'record', 'name': 'Other', 'fields': [{'name': 'x', 'type': 'long'}]}
        response = await registry._client.post(
            f'/subjects/{settings.topics.topic_prefix}.foreign-value/versions',
            json={'schema': json.dumps(foreign)},
        )
        foreign_id = response.json()['id']
    good = to_confluent(encode(event('h', 0, 'run_started')), step_event_id)
    values = [
        b'\x00' + (999_999).to_bytes(4, 'big') + b'\x02\x04',  # an id the registry does not hold
        b'\x00' + foreign_id.to_bytes(4, 'big') + b'\x02',  # a schema that is not stepstream's
        b'\x00' + step_event_id.to_bytes(4, 'big') + b'\xff\xff\xff',  # garbage under our id
        good,
    ]
    await ensure_topics(settings)
    partition = murmur2_partition(b'h', settings.topics.partitions)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, key=b'h', partition=partition)
    finally:
        await producer.stop()
    async with Projector(settings, db_path=db_path) as projector:
        await projector.wait_for({TopicPartition(topic, partition): len(values)}, timeout=30)
        status = await ProjectionReader.of(projector).status()
        assert status.dead_lettered_by_reason == {'unknown_version': 2, 'corrupt': 1}
        assert (
            await ProjectionReader.of(projector).get_run('h')
        ) is not None  # the good record after them applied
    details = await dlq_details(settings, 3)
    assert 'does not hold' in details[0] and 'not a stepstream schema' in details[1]


async def test_without_a_registry_a_confluent_record_is_unreadable_and_says_which_setting(
    settings: Settings,
) -> None:
    wire = WireFormats(settings)
    value = to_confluent(encode(event('r', 0, 'run_started')), 1)
    [read] = await wire.read([SourceRecord(EVENTS, 0, 0, b'r', value)], lambda: False)
    assert read.value == value and read.unreadable is not None
    assert read.unreadable.reason == 'unknown_version'
    assert 'STEPSTREAM_SCHEMA_REGISTRY_URL' in str(read.unreadable)
    await wire.close()


# -- the registry down ----------------------------------------------------------------------------


async def test_a_producer_cut_off_from_the_registry_fails_the_durability_point_and_loses_nothing(
    settings: Settings, registry_url: str, db_path: Path
) -> None:
    port = int(registry_url.rsplit(':', 1)[1])
    async with Forwarder(port) as gate:
        cut_off = settings.replace(schema_registry_url=gate.url, ack_timeout_s=2)
        async with EventLog(cut_off) as log:
            talker = Agent(answers(), capabilities=[StepPersistence(log=log, agent_name='talker')])
            await talker.run('hello')  # step events: their schema id is cached from here on
            await gate.cut()
            ran: list[str] = []
            worker = Agent(
                calls_then_answers('act'), capabilities=[StepPersistence(log=log, agent_name='worker')]
            )

            @worker.tool_plain
            def act() -> str:
                ran.append('act')
                return 'acted'

            with pytest.raises(SchemaRegistryError, match='STEPSTREAM_SCHEMA_REGISTRY_URL') as failure:
                await worker.run('go')  # its tool's `started` transition needs a schema id it has not got
            assert 'did not answer' in str(failure.value) and not failure.value.refused
            assert ran == []  # no side effect without a record
            await talker.run('still here')  # what the log has ids for is still written
            await gate.restore()
            position = await log.flush(timeout=30)  # the kept records go now
    async with Projector(settings.replace(schema_registry_url=registry_url), db_path=db_path) as projector:
        await projector.wait_for(position, timeout=30)
        reader = ProjectionReader.of(projector)
        runs = {r.agent_name: r for r in await reader.list_runs(conversation_id=None)}
        statuses = sorted((r.agent_name, r.status) for r in await reader.list_runs())
        assert statuses == [('talker', 'completed'), ('talker', 'completed'), ('worker', 'failed')]
        worker_run = runs['worker']
        assert worker_run.gaps == [] and worker_run.event_count == worker_run.last_seq + 1
        assert 'SchemaRegistryError' in (worker_run.error or '')
        effect = await reader.get_tool_effect(worker_run.run_id, 'call-0')
        assert effect is not None and effect.status == 'started'  # written, though the tool never ran
        assert projector.dead_lettered == 0


async def test_a_projector_waits_for_a_registry_that_does_not_answer(
    registry_settings: Settings, registry_url: str, db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The registry being away is no fault of the records: nothing is applied or dead-lettered."""
    async with EventLog(registry_settings) as log:
        await run_agents(log, 'waits')
        position = await log.flush()
    async with Forwarder(int(registry_url.rsplit(':', 1)[1])) as gate:
        await gate.cut()
        settings = registry_settings.replace(schema_registry_url=gate.url)
        with caplog.at_level('WARNING', logger='stepstream.projector'):
            async with Projector(settings, db_path=db_path) as projector:
                for _ in range(100):  # until it has met the registry's absence
                    if 'the batch waits' in caplog.text:
                        break
                    await asyncio.sleep(0.1)
                assert 'STEPSTREAM_SCHEMA_REGISTRY_URL' in caplog.text
                assert (projector.records_applied, projector.dead_lettered) == (0, 0)
        # Stopped while it waited; the registry answers again; the next start applies everything.
        await gate.restore()
        async with Projector(settings, db_path=db_path) as projector:
            await projector.wait_for(position, timeout=30)
            assert projector.dead_lettered == 0
            assert (
                sorted(r.status for r in await ProjectionReader.of(projector).list_runs())
                == ['completed'] * 2
            )


REQUEST_LINE = re.compile(rb'(?:^|\r\n)((?:GET|POST|PUT|DELETE) \S+) HTTP/1\.1\r\n')


@dataclass
class Forwarder:
    """A TCP forwarder in front of the registry that a test cuts and restores: a real outage for
    the client (connections refused and dropped) while the registry keeps its schemas."""

    target_port: int
    port: int = 0
    _server: asyncio.Server | None = None
    _links: set[asyncio.StreamWriter] = field(default_factory=set)
    requests: list[str] = field(default_factory=list)
    """The method and path of every HTTP request forwarded."""

    @property
    def url(self) -> str:
        return f'http://127.0.0.1:{self.port}'

    async def __aenter__(self) -> Forwarder:
        await self.restore()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cut()

    async def restore(self) -> None:
        self._server = await asyncio.start_server(self._link, '127.0.0.1', self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._links):
                writer.close()
            await self._server.wait_closed()
            self._server = None

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection('127.0.0.1', self.target_port)
        self._links.update((writer, up_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, requests: bool) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    if requests:
                        self.requests += [m.decode() for m in REQUEST_LINE.findall(data)]
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))
        self._links.difference_update((writer, up_writer))


# -- helpers --------------------------------------------------------------------------------------


async def stepstream_cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The `stepstream` command in a process of its own: exit code, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / 'stepstream'),
        *args,
        env={**os.environ, **(env or {})},
        cwd=cwd,  # no .stepstream stack of the checkout's `make run` in the way
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def run_agents(log: EventLog, conversation: str) -> None:
    """Two real runs: one that answers, one that calls a tool once (step events and transitions)."""
    talker = Agent(answers(), capabilities=[StepPersistence(log=log, agent_name='talker')])
    worker = Agent(calls_then_answers('act'), capabilities=[StepPersistence(log=log, agent_name='worker')])

    @worker.tool_plain
    def act() -> str:
        return 'acted'

    await talker.run('hello', conversation_id=conversation)
    await worker.run('go', conversation_id=conversation)


async def read_raw(settings: Settings, position: Position) -> dict[tuple[str, int, int], bytes]:
    """Every value up to `position`, as it is in the log, by (topic, partition, offset)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    found: dict[tuple[str, int, int], bytes] = {}
    try:
        consumer.assign(list(position))
        await consumer.seek_to_beginning()
        wanted = sum(position.values())
        for _ in range(60):
            for tp, messages in (await consumer.getmany(timeout_ms=1000)).items():
                for m in messages:
                    if m.offset < position[tp] and m.value is not None:
                        found[(tp.topic, tp.partition, m.offset)] = m.value
            if len(found) >= wanted:
                break
    finally:
        await consumer.stop()
    return found


def read_with_confluent_kafka(settings: Settings, position: Position) -> dict[tuple[str, int, int], Any]:
    """The topics as confluent-kafka's DeserializingConsumer reads them through the registry."""
    from confluent_kafka import OFFSET_BEGINNING, DeserializingConsumer
    from confluent_kafka import TopicPartition as ConfluentPartition
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import StringDeserializer

    client = SchemaRegistryClient({'url': settings.registry.schema_registry_url})
    consumer = DeserializingConsumer(
        {
            'bootstrap.servers': settings.kafka.bootstrap_servers,
            'group.id': f'{settings.topics.topic_prefix}.outside',
            'enable.auto.commit': False,
            'key.deserializer': StringDeserializer('utf_8'),
            'value.deserializer': AvroDeserializer(client),
        }
    )
    found: dict[tuple[str, int, int], Any] = {}
    try:
        consumer.assign([ConfluentPartition(tp.topic, tp.partition, OFFSET_BEGINNING) for tp in position])
        wanted = sum(position.values())
        for _ in range(600):
            message = consumer.poll(0.5)
            if message is None:
                if len(found) >= wanted:
                    break
                continue
            assert message.error() is None, message.error()
            found[(message.topic(), message.partition(), message.offset())] = message.value()
            if len(found) >= wanted:
                break
    finally:
        consumer.close()
    return found


def as_avro_dict(record: LogRecord) -> dict[str, Any]:
    """A record's fields as an Avro reader gives them: nested records as dicts, `None` kept."""
    fields: dict[str, Any] = {name: getattr(record, name) for name in record.__slots__}
    for nested in ('snapshot', 'usage'):
        value = fields.get(nested)
        if value is not None:
            fields[nested] = {name: getattr(value, name) for name in value.__slots__}
    return fields


async def dlq_details(settings: Settings, count: int) -> list[str]:
    consumer = AIOKafkaConsumer(
        settings.topics.dlq_topic,
        bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset='earliest',
    )
    await consumer.start()
    details: list[str] = []
    try:
        while len(details) < count:
            for messages in (await consumer.getmany(timeout_ms=2000)).values():
                details.extend(dict(m.headers)['stepstream-dlq-detail'].decode() for m in messages)
    finally:
        await consumer.stop()
    return details
