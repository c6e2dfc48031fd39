"""Apache Kafka for `EmbeddedStack(broker='kafka')`: jars from Maven Central, one KRaft node.

The broker is the `org.apache.kafka:kafka_2.13` artifact and its runtime dependencies, resolved
once by Maven from `stepstream/embedded/kafka/pom.xml` into a cache directory (`STEPSTREAM_KAFKA_CACHE`,
else `~/.cache/stepstream`), then started as `java -cp 'lib/*' kafka.Kafka server.properties`
on loopback ports: one process that is both broker and KRaft controller. Nothing is downloaded
from anywhere but the Maven repositories Maven is configured with.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

from stepstream.embedded._network import HOST
from stepstream.embedded._processes import BROKER, EmbeddedStackError, log_tail, quote

TITLE = 'Apache Kafka (the broker)'
LOG_NAME = 'kafka.log'
KAFKA_VERSION = '4.1.1'
"""Keep equal to `kafka.version` in stepstream/embedded/kafka/pom.xml."""

_HERE = Path(__file__).parent / 'kafka'
POM = _HERE / 'pom.xml'
LOG4J_CONFIG = _HERE / 'log4j2.properties'

INSTALL_HINT = (
    'Apache Kafka runs on a JVM and its jars are fetched with Maven: install a JDK 17+ and Maven '
    '(Debian/Ubuntu: apt-get install openjdk-17-jre-headless maven), or use the default embedded '
    'broker, Tansu (STEPSTREAM_EMBEDDED_BROKER=tansu), which needs neither.'
)

BROKER_SETTINGS = {
    # One node that is broker and controller; everything replicated once.
    'process.roles': 'broker,controller',
    'num.partitions': '1',
    'offsets.topic.replication.factor': '1',
    'offsets.topic.num.partitions': '5',
    'transaction.state.log.replication.factor': '1',
    'transaction.state.log.min.isr': '1',
    'share.coordinator.state.topic.replication.factor': '1',
    'share.coordinator.state.topic.min.isr': '1',
    # Consumers join at once instead of waiting 3 s for more members.
    'group.initial.rebalance.delay.ms': '0',
    # stepstream creates its topics itself, with the partition count and configs it needs.
    'auto.create.topics.enable': 'false',
    # Larger than Kafka's 1 MiB default so tests can write poison records of about 1 MiB.
    'message.max.bytes': str(8 * 1024 * 1024),
}
"""The broker settings of the embedded Apache Kafka; compose/docker-compose.yml sets the same ones
(a test checks), so the compose path runs what the tests run. Listeners are per deployment."""

_LISTENERS = {
    'controller.listener.names': 'CONTROLLER',
    'listener.security.protocol.map': 'PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT',
    'inter.broker.listener.name': 'PLAINTEXT',
}


class KafkaUnavailable(Exception):
    """Java or Maven is missing, or Maven could not resolve the broker's jars."""


def resolve() -> tuple[str, Path]:
    """`java` and the directory of the broker's jars, or `EmbeddedStackError` saying what is missing."""
    try:
        return java_binary(), resolve_jars()
    except KafkaUnavailable as exc:
        raise EmbeddedStackError(f'{TITLE} cannot run: {exc}', service=BROKER) from None


def java_binary() -> str:
    """The `java` on PATH, or `KafkaUnavailable` saying what to install."""
    found = shutil.which('java')
    if found is None:
        raise KafkaUnavailable(f'`java` is not on PATH. {INSTALL_HINT}')
    return found


def cache_dir() -> Path:
    """Where the broker's jars are kept between runs."""
    return user_cache(f'kafka-{KAFKA_VERSION}', override='STEPSTREAM_KAFKA_CACHE')


def user_cache(name: str, *, override: str) -> Path:
    """The directory `name` of what is fetched or built once and kept between runs.

    Under `$override` when that is set, else in stepstream's cache (`$XDG_CACHE_HOME/stepstream`,
    `~/.cache/stepstream` without it).
    """
    root = os.environ.get(override)
    if root:
        return Path(root) / name
    base = os.environ.get('XDG_CACHE_HOME') or str(Path.home() / '.cache')
    return Path(base) / 'stepstream' / name


def resolve_jars() -> Path:
    """The directory holding every jar the broker needs, fetched with Maven the first time."""
    target = cache_dir()
    lib, done = target / 'lib', target / 'complete'
    if done.exists():
        return lib
    mvn = shutil.which('mvn')
    if mvn is None:
        raise KafkaUnavailable(
            f'`mvn` is not on PATH, and the Kafka jars are not in {target} yet. {INSTALL_HINT}'
        )
    target.mkdir(parents=True, exist_ok=True)
    with locked(target / '.lock'):
        if done.exists():  # another process fetched them while this one waited
            return lib
        staging = target / f'lib.{os.getpid()}'
        shutil.rmtree(staging, ignore_errors=True)
        command = [
            mvn,
            '-q',
            '-B',
            '-f',
            str(POM),
            'dependency:copy-dependencies',
            '-DincludeScope=runtime',
            f'-DoutputDirectory={staging}',
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        if result.returncode != 0 or not any(staging.glob('kafka_2.13-*.jar')):
            output = (result.stdout + result.stderr).strip().splitlines()[-15:]
            shown = '\n'.join('    ' + line for line in output) or '    (no output)'
            raise KafkaUnavailable(
                f'Maven could not fetch Apache Kafka {KAFKA_VERSION} (exit {result.returncode}):\n'
                f'  command: {" ".join(command)}\n{shown}\n'
                'Check that Maven reaches its repository (Maven Central), then try again.'
            )
        shutil.rmtree(lib, ignore_errors=True)
        staging.rename(lib)
        done.write_text(f'{KAFKA_VERSION}\n')
    return lib


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (made if missing): one fetch or build into a cache."""
    import fcntl

    with open(path, 'a+') as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def new_cluster_id() -> str:
    """A cluster id as Kafka writes them: 16 random bytes, URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b'=').decode()


def server_properties(
    *,
    host: str,
    port: int,
    controller_port: int,
    log_dir: Path,
    node_id: int = 1,
    voters: str | None = None,
    overrides: Mapping[str, str] | None = None,
) -> str:
    """The `server.properties` of a KRaft node on `host` that is broker and controller.

    Alone by default; `voters` (`1@host:port,2@host:port,...`) makes it one node of a cluster, and
    `overrides` changes broker settings (replication factors of a cluster, for instance).
    """
    values = {
        **BROKER_SETTINGS,
        **_LISTENERS,
        'node.id': str(node_id),
        'controller.quorum.voters': voters or f'{node_id}@{host}:{controller_port}',
        'listeners': f'PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller_port}',
        'advertised.listeners': f'PLAINTEXT://{host}:{port}',
        'log.dirs': str(log_dir),
        **(overrides or {}),
    }
    return ''.join(f'{k}={v}\n' for k, v in values.items())


def _java(java: str, lib: Path, main: str, *args: str) -> list[str]:
    return [
        java,
        '-Xms128m',
        '-Xmx768m',
        '-XX:+UseSerialGC',  # two cores: no parallel GC threads competing with the tests
        '-XX:TieredStopAtLevel=1',  # C1 only: starts in about half the time; fast enough for tests
        '-Djava.awt.headless=true',
        '-Djava.net.preferIPv4Stack=true',  # plain IPv4 loopback sockets, as the other services use
        f'-Dlog4j2.configurationFile={LOG4J_CONFIG}',
        '-cp',
        f'{lib}/*',
        main,
        *args,
    ]


def format_command(
    java: str, lib: Path, properties: Path, cluster_id: str, *, scram_users: Mapping[str, str] | None = None
) -> list[str]:
    """Formats the log directory of a new node (once, before its first start).

    `scram_users` (name -> password) get SCRAM-SHA-256 and SCRAM-SHA-512 credentials in the
    node's first metadata, so they can authenticate from the first start on.
    """
    scram = [
        f'--add-scram={mechanism}=[name={name},password={password}]'
        for name, password in (scram_users or {}).items()
        for mechanism in ('SCRAM-SHA-256', 'SCRAM-SHA-512')
    ]
    # `--cluster-id=ID`, not `-t ID`: an id may begin with '-', which would read as an option.
    return _java(
        java,
        lib,
        'kafka.tools.StorageTool',
        'format',
        f'--cluster-id={cluster_id}',
        '-c',
        str(properties),
        *scram,
    )


def broker_command(java: str, lib: Path, properties: Path) -> list[str]:
    """Runs the broker."""
    return _java(java, lib, 'kafka.Kafka', str(properties))


def node_command(
    java: str, lib: Path, home: Path, *, port: int, controller_port: int, log_path: Path, env: dict[str, str]
) -> list[str]:
    """The command of the embedded node whose log lives in `home/log` (kept across restarts).

    Writes its `server.properties` and formats the log directory the first time (the format
    tool's output goes to `log_path`).
    """
    log_dir = home / 'log'
    properties = home / 'server.properties'
    home.mkdir(exist_ok=True)
    properties.write_text(
        server_properties(host=HOST, port=port, controller_port=controller_port, log_dir=log_dir)
    )
    if not (log_dir / 'meta.properties').exists():
        command = format_command(java, lib, properties, new_cluster_id())
        with open(log_path, 'ab') as log:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
        if done.returncode != 0:
            raise EmbeddedStackError(
                f'{TITLE} could not format its log directory (exit {done.returncode}).\n'
                f'  command: {quote(command)}\n'
                f'  last lines of {log_path}:\n'
                + '\n'.join('    ' + line for line in log_tail(log_path, 0).splitlines()),
                service=BROKER,
            )
    return broker_command(java, lib, properties)
