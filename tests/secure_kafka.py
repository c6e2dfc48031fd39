"""A secured Apache Kafka for the security tests: a CA made at test time, SCRAM users, ACLs.

One KRaft node (the embedded Apache Kafka's jars and broker settings) with four listeners:

- `SASL_SSL`: TLS with a broker certificate the test CA signed, SASL SCRAM-SHA-256/512, PLAIN
  and (unsecured, test-only) OAUTHBEARER;
- `SSL`: mutual TLS, a client certificate signed by the test CA required; the principal is the
  certificate's CN (`ssl.principal.mapping.rules`);
- `PLAINTEXT`: the loopback admin and inter-broker listener, whose anonymous principal is a
  super user, used by the tests to set up ACLs;
- `CONTROLLER`: KRaft.

`StandardAuthorizer` is on and nothing is allowed without an ACL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import subprocess
import time
from base64 import urlsafe_b64encode
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka.abc import AbstractTokenProvider
from aiokafka.admin import AIOKafkaAdminClient

from stepstream.embedded import apache_kafka

from certificates import HOST, TestCA
from processes import free_port, spawn, stop
from waits import until, until_sync

USERS = {name: f'{name}-secret' for name in ('admin', 'producer', 'projector', 'analyst', 'stranger')}
"""SCRAM users (SHA-256 and SHA-512) and PLAIN users; ACLs decide what each may do."""

DOCS_SECURITY = Path(__file__).resolve().parent.parent / 'docs' / 'security.md'


# -- OAUTHBEARER ------------------------------------------------------------------------------


def unsecured_jwt(subject: str) -> str:
    """An unsigned JWT (`alg: none`), what Kafka's test-only unsecured OAUTHBEARER validator takes."""

    def part(value: dict[str, object]) -> str:
        return urlsafe_b64encode(json.dumps(value).encode()).rstrip(b'=').decode()

    now = int(time.time())
    return f'{part({"alg": "none"})}.{part({"sub": subject, "iat": now, "exp": now + 3600})}.'


class ProducerToken(AbstractTokenProvider):
    """The token provider the OAUTHBEARER test names in its settings: tokens for `producer`."""

    async def token(self) -> str:
        """A fresh unsecured token whose subject is the producer principal."""
        return unsecured_jwt('producer')


# -- the broker -------------------------------------------------------------------------------


class SecureKafka:
    """One secured Apache Kafka node; `start()` returns once its admin listener answers."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ca = TestCA(directory / 'ca')
        self.broker_cert = self.ca.issue('broker', server=True)
        self.clients = {name: self.ca.issue(name) for name in ('producer', 'projector')}
        self.other_ca = TestCA(directory / 'other-ca', 'some other CA')
        self.stranger_cert = self.other_ca.issue('producer')  # right name, wrong CA
        keystore = directory / 'broker-keystore.pem'  # Kafka's PEM key store: key, then chain
        keystore.write_bytes(self.broker_cert.key.read_bytes() + self.broker_cert.cert.read_bytes())
        self.plaintext_port, self.sasl_ssl_port, self.ssl_port = free_port(), free_port(), free_port()
        controller = free_port()
        jaas = {
            'scram-sha-256': 'org.apache.kafka.common.security.scram.ScramLoginModule required;',
            'scram-sha-512': 'org.apache.kafka.common.security.scram.ScramLoginModule required;',
            'plain': 'org.apache.kafka.common.security.plain.PlainLoginModule required '
            + ' '.join(f'user_{name}="{password}"' for name, password in USERS.items())
            + ';',
            'oauthbearer': 'org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;',
        }
        overrides = {
            'listeners': (
                f'PLAINTEXT://{HOST}:{self.plaintext_port},CONTROLLER://{HOST}:{controller},'
                f'SASL_SSL://{HOST}:{self.sasl_ssl_port},SSL://{HOST}:{self.ssl_port}'
            ),
            'advertised.listeners': (
                f'PLAINTEXT://{HOST}:{self.plaintext_port},SASL_SSL://{HOST}:{self.sasl_ssl_port},'
                f'SSL://{HOST}:{self.ssl_port}'
            ),
            'listener.security.protocol.map': (
                'PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL,SSL:SSL'
            ),
            'sasl.enabled.mechanisms': 'SCRAM-SHA-256,SCRAM-SHA-512,PLAIN,OAUTHBEARER',
            **{f'listener.name.sasl_ssl.{m}.sasl.jaas.config': config for m, config in jaas.items()},
            'ssl.keystore.type': 'PEM',
            'ssl.keystore.location': str(keystore),
            'ssl.truststore.type': 'PEM',
            'ssl.truststore.location': str(self.ca.cafile),
            'listener.name.ssl.ssl.client.auth': 'required',
            'ssl.principal.mapping.rules': 'RULE:^CN=([^,]+)$/$1/,DEFAULT',
            'authorizer.class.name': 'org.apache.kafka.metadata.authorizer.StandardAuthorizer',
            'super.users': 'User:ANONYMOUS',
            'allow.everyone.if.no.acl.found': 'false',
        }
        self.java = apache_kafka.java_binary()
        self.lib = apache_kafka.resolve_jars()
        self.properties = directory / 'server.properties'
        self.properties.write_text(
            apache_kafka.server_properties(
                host=HOST,
                port=self.plaintext_port,
                controller_port=controller,
                log_dir=directory / 'log',
                overrides=overrides,
            )
        )
        self.log = directory / 'kafka.log'
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def admin_bootstrap(self) -> str:
        """The plaintext listener; its anonymous principal is a super user (for test setup only)."""
        return f'{HOST}:{self.plaintext_port}'

    @property
    def sasl_ssl_bootstrap(self) -> str:
        return f'{HOST}:{self.sasl_ssl_port}'

    @property
    def ssl_bootstrap(self) -> str:
        return f'{HOST}:{self.ssl_port}'

    async def start(self, timeout: float = 90) -> None:
        subprocess.run(
            apache_kafka.format_command(
                self.java, self.lib, self.properties, apache_kafka.new_cluster_id(), scram_users=USERS
            ),
            check=True,
            capture_output=True,
        )
        self.process = spawn(
            apache_kafka.broker_command(self.java, self.lib, self.properties), self.log, new_session=True
        )
        await until_answers(self.process, {'bootstrap_servers': self.admin_bootstrap}, self.log, timeout)

    def stop(self) -> None:
        stop(self.process)


async def until_answers(
    broker: subprocess.Popen[bytes], options: dict[str, Any], log: Path, timeout: float = 90
) -> None:
    """Return once a broker started as `broker` lists itself to an admin client built with `options`."""

    async def answers() -> bool:
        if broker.poll() is not None:
            raise RuntimeError(f'the broker exited: see {log}')
        with contextlib.suppress(Exception):
            admin = AIOKafkaAdminClient(**options, request_timeout_ms=3000)
            await asyncio.wait_for(admin.start(), 5)
            try:
                return bool((await asyncio.wait_for(admin.describe_cluster(), 5))['brokers'])
            finally:
                await admin.close()
        return False

    await until(answers, f'the broker to answer (see {log})', timeout, every=0.3)


# -- ACLs, as docs/security.md writes them ----------------------------------------------------


@dataclass(frozen=True)
class AclRule:
    """One `kafka-acls.sh --add` command of docs/security.md: a principal, operations, resources."""

    principal: str
    operations: tuple[str, ...]
    topics: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    cluster: bool = False
    prefixed: bool = False


def documented_acl_rules() -> Iterator[AclRule]:
    """The `kafka-acls.sh ... --add` commands in the code blocks of docs/security.md."""
    text = DOCS_SECURITY.read_text()
    for block in text.split('```sh')[1:]:
        yield from acl_rules(block.split('```')[0])


def acl_rules(code: str, command: str = 'kafka-acls.sh') -> Iterator[AclRule]:
    """The ACLs that the `command ... --add` lines of a shell script grant."""
    for line in code.replace('\\\n', ' ').splitlines():
        words = shlex.split(line, comments=True)
        if not words or not words[0].endswith(command) or '--add' not in words:
            continue
        values: dict[str, list[str]] = {}
        flags = set()
        it = iter(words[1:])
        for word in it:
            if word in ('--add', '--cluster'):
                flags.add(word)
            elif word.startswith('--'):
                values.setdefault(word, []).append(next(it))
        yield AclRule(
            principal=values['--allow-principal'][0],
            operations=tuple(values['--operation']),
            topics=tuple(values.get('--topic', ())),
            groups=tuple(values.get('--group', ())),
            cluster='--cluster' in flags,
            prefixed=values.get('--resource-pattern-type', ['literal'])[0] == 'prefixed',
        )


def grant(
    admin_bootstrap: str, rules: list[AclRule], *, topic_prefix: str, client: dict[str, str] | None = None
) -> None:
    """Create the ACLs of `rules` with the `stepstream` topic prefix replaced, and wait until they apply.

    Through librdkafka's admin client (aiokafka has no ACL API), over the super-user listener;
    `client` adds librdkafka settings (TLS files of a super user's certificate, say).
    """
    from confluent_kafka.admin import (
        AclBinding,
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        AdminClient,
        ResourcePatternType,
        ResourceType,
    )

    def renamed(name: str) -> str:
        return topic_prefix + name[len('stepstream') :] if name.startswith('stepstream') else name

    bindings = []
    for rule in rules:
        pattern = ResourcePatternType.PREFIXED if rule.prefixed else ResourcePatternType.LITERAL
        resources = [(ResourceType.TOPIC, renamed(t)) for t in rule.topics]
        resources += [(ResourceType.GROUP, renamed(g)) for g in rule.groups]
        if rule.cluster:
            resources.append((ResourceType.BROKER, 'kafka-cluster'))
        for kind, name in resources:
            for operation in rule.operations:
                bindings.append(
                    AclBinding(
                        kind,
                        name,
                        ResourcePatternType.LITERAL if kind == ResourceType.BROKER else pattern,
                        rule.principal,
                        '*',
                        AclOperation[operation.upper()],
                        AclPermissionType.ALLOW,
                    )
                )
    admin = AdminClient({'bootstrap.servers': admin_bootstrap, **(client or {})})
    for future in admin.create_acls(bindings).values():
        future.result(timeout=30)
    everything = AclBindingFilter(
        ResourceType.ANY,
        None,
        ResourcePatternType.ANY,
        None,
        None,
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    until_sync(
        lambda: set(bindings) <= set(admin.describe_acls(everything).result(timeout=30)),
        'the ACLs to show up',
        30,
        every=0.1,
    )
