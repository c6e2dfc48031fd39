"""One settings object for producer, projector, media and CLI.

Every field maps to one environment variable (`STEPSTREAM_<FIELD>`) and one CLI flag
(`--<field-with-dashes>`), so a process, a child process and a shell command agree on where
the log and the media live.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import getpass
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from stepstream.shapes import field_docs

ENV_PREFIX = 'STEPSTREAM_'
FILE_SUFFIX = '_FILE'
"""`STEPSTREAM_<SECRET>_FILE` names a file that holds a secret (a mounted Kubernetes or docker secret)."""

SECURITY_PROTOCOLS = ('PLAINTEXT', 'SSL', 'SASL_PLAINTEXT', 'SASL_SSL')
SASL_MECHANISMS = ('PLAIN', 'SCRAM-SHA-256', 'SCRAM-SHA-512', 'OAUTHBEARER')


class SecretStr:
    """A secret that no repr, log line or traceback shows; `get_secret_value()` reads it.

    Pydantic's `SecretStr` interface without importing Pydantic, so that a command that only asks
    the read service starts fast; a Pydantic `SecretStr` given to `Settings` becomes one of these.
    """

    __slots__ = ('_secret_value',)

    def __init__(self, secret_value: str) -> None:
        """Hold `secret_value`."""
        self._secret_value = secret_value

    def get_secret_value(self) -> str:
        """The secret itself."""
        return self._secret_value

    def __repr__(self) -> str:
        return "SecretStr('**********')"

    def __str__(self) -> str:
        return '**********' if self._secret_value else ''

    def __len__(self) -> int:
        return len(self._secret_value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretStr) and other._secret_value == self._secret_value

    def __hash__(self) -> int:
        return hash(self._secret_value)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Where stepstream's log, media and projection live, and how hard it waits for them.

    ```python
    settings = Settings.from_env()             # STEPSTREAM_* variables, defaults otherwise
    child_env = {**os.environ, **settings.to_env()}
    ```
    """

    bootstrap_servers: str = '127.0.0.1:9092'
    """Comma-separated Kafka bootstrap servers."""
    topic_prefix: str = 'stepstream'
    """Topics are `{prefix}.step-events`, `{prefix}.tool-effects` and `{prefix}.dlq`."""
    s3_endpoint: str | None = None
    """S3-compatible endpoint URL; `None` means AWS S3 proper."""
    s3_bucket: str = 'stepstream-media'
    """The S3 bucket of the media store; it must exist (stepstream checks it at start)."""
    s3_region: str = 'us-east-1'
    """The S3 region to sign requests for."""
    s3_access_key_id: str | None = None
    """S3 access key id; `None` uses the AWS default credential chain."""
    s3_secret_access_key: SecretStr | None = field(default=None, repr=False)
    """Read from `STEPSTREAM_S3_SECRET_ACCESS_KEY` or the file `STEPSTREAM_S3_SECRET_ACCESS_KEY_FILE`,
    never a flag."""
    s3_cafile: str | None = None
    """PEM file of the CA(s) that signed the S3 endpoint's certificate, trusted besides the system's
    CAs (a private CA in front of MinIO, Ceph or SeaweedFS); needs an `https://` endpoint."""
    media_threshold_bytes: int = 64 * 1024
    """Payloads at or above this size (UTF-8 bytes for text) are moved to the media store."""
    db_path: str = '.stepstream/projection'
    """Directory of the projector's RocksDB."""
    partitions: int = 6
    """Partition count used when stepstream creates its topics (the same for both topics)."""
    replication_factor: int = 1
    """Replication factor used when stepstream creates its topics."""
    ack_timeout_s: float = 10.0
    """How long a durability point waits for the broker's acknowledgement before the run fails."""
    security_protocol: str = 'PLAINTEXT'
    """How clients talk to Kafka: `PLAINTEXT`, `SSL` (TLS), `SASL_PLAINTEXT` or `SASL_SSL`."""
    sasl_mechanism: str | None = None
    """`PLAIN`, `SCRAM-SHA-256`, `SCRAM-SHA-512` or `OAUTHBEARER`; needed with a `SASL_*` protocol."""
    sasl_username: str | None = None
    """The SASL user (PLAIN and SCRAM mechanisms)."""
    sasl_password: SecretStr | None = field(default=None, repr=False)
    """Read from `STEPSTREAM_SASL_PASSWORD` or the file `STEPSTREAM_SASL_PASSWORD_FILE`, never a flag."""
    sasl_oauth_token_provider: str | None = None
    """`module:attribute` of an aiokafka `AbstractTokenProvider` (an instance, or a class or
    factory called with no arguments) that hands out OAUTHBEARER tokens (MSK IAM, an OIDC client)."""
    ssl_cafile: str | None = None
    """PEM file of the CA(s) that signed the brokers' certificates; the system's CAs when unset."""
    ssl_certfile: str | None = None
    """PEM client certificate (chain) for mutual TLS; may also hold the key."""
    ssl_keyfile: str | None = None
    """PEM private key of `ssl_certfile`, when it is not in that file."""
    schema_registry_url: str | None = None
    """A Confluent-compatible schema registry (`https://host:port`): set, the producer writes the
    Confluent wire format (byte 0, the 4-byte schema id, the Avro body) with ids from it, and readers
    (projector, rebuild, export) resolve such records through it; unset (the default), records are
    Avro single-object encoded and no registry is used. Readers read both formats either way."""
    schema_registry_username: str | None = None
    """HTTP basic-auth user of the schema registry (Confluent Cloud: the API key)."""
    schema_registry_password: SecretStr | None = field(default=None, repr=False)
    """Read from `STEPSTREAM_SCHEMA_REGISTRY_PASSWORD` or the file
    `STEPSTREAM_SCHEMA_REGISTRY_PASSWORD_FILE`, never a flag (Confluent Cloud: the API secret)."""
    schema_registry_cafile: str | None = None
    """PEM file of the CA(s) that signed the schema registry's certificate, trusted besides the
    system's CAs; needs an `https://` registry URL."""
    serve_token: SecretStr | None = field(default=None, repr=False)
    """Bearer token `stepstream serve` requires (from `STEPSTREAM_SERVE_TOKEN` or its `_FILE`, never
    a flag); needed to serve on anything but loopback, and enforced on every request when set."""
    erasure_key: SecretStr | None = field(default=None, repr=False)
    """The key-encryption key of erasure by crypto-shredding (base64 of 32 random bytes, from
    `STEPSTREAM_ERASURE_KEY` or its `_FILE`, never a flag): set, writers seal message content and
    media with per-conversation keys that `stepstream forget` can destroy; unset (the default),
    nothing is sealed. Every writer and reader of one log needs the same key (decision 0033)."""
    redaction: str = 'default'
    """What writers redact before anything reaches the log: `default` (values under secret-named keys
    and secrets of well-known formats, decision 0047) or `off` (nothing: every secret an agent
    hands a tool is written as it is)."""
    redaction_keys: str | None = None
    """More key names whose values are secrets, comma-separated (`pin,ssn`), besides the default ones."""
    redaction_hash_key: SecretStr | None = field(default=None, repr=False)
    """A key (from `STEPSTREAM_REDACTION_HASH_KEY` or its `_FILE`, never a flag): set, each marker
    carries the redacted value's HMAC-SHA256, so two redacted values compare without being read."""
    signing_key: SecretStr | None = field(default=None, repr=False)
    """A writer's Ed25519 private key, PEM (from `STEPSTREAM_SIGNING_KEY` or its `_FILE`, never a
    flag): set, each writer signs its runs' chain heads at their durability points, and `stepstream
    audit checkpoint` signs its checkpoints, so an auditor holding the public key can tell the
    writer's records from anyone else's (docs/audit.md). Unset (the default), nothing is signed."""
    heartbeat_interval_s: float = 5.0
    """A writer appends a `run_heartbeat` for each open run that has written nothing else for this
    many seconds, so that readers can tell a quiet run from a dead one (0: no heartbeats)."""
    stale_after_s: float = 20.0
    """Views show a `running` run as `stale` once it has had no record for this many seconds (keep
    it a few heartbeat intervals: a writer whose process died reads stale within it)."""
    operator: str | None = None
    """Who resolves unknown tool effects from this process (`stepstream resolve`, the explorer); the
    OS user when unset. Recorded in the log with every resolution."""
    trace_url: str | None = None
    """The trace viewer's URL with `{trace_id}` (and `{span_id}` if it takes one), for example
    Jaeger's `http://localhost:16686/trace/{trace_id}`: the explorer links each event to the trace
    it was written under. Unset, the explorer shows the trace id."""
    serve_url: str | None = None
    """A read service (`stepstream serve`, `http://host:port`) the CLI's views ask instead of opening
    the projection: set, `runs`, `tree`, `events`, ... print its answer (they read `db_path` when it
    does not answer). Unset, they ask the stack's service when their settings are the stack's."""

    retain_ended_days: float | None = None
    """Retention of the read model: runs that ended more than this many days before the newest
    step event of their partition (log time, not the clock) are dropped from the projection, and
    their media once no kept run references it (`stepstream retention`). Unset keeps every run;
    it is part of what a projection is, so changing it means a rebuild (docs/retention.md)."""

    def __post_init__(self) -> None:
        if not self.topic_prefix or any(c not in _TOPIC_CHARS for c in self.topic_prefix):
            raise ValueError(
                f'topic_prefix {self.topic_prefix!r} is not a valid Kafka topic prefix: '
                'use letters, digits, ".", "_" and "-"'
            )
        if self.media_threshold_bytes <= 0:
            raise ValueError(f'media_threshold_bytes must be positive, got {self.media_threshold_bytes}')
        if self.partitions <= 0:
            raise ValueError(f'partitions must be positive, got {self.partitions}')
        if self.ack_timeout_s <= 0:
            raise ValueError(f'ack_timeout_s must be positive, got {self.ack_timeout_s}')
        if self.stale_after_s < 0:
            raise ValueError(f'stale_after_s must not be negative, got {self.stale_after_s}')
        if self.heartbeat_interval_s < 0:
            raise ValueError(f'heartbeat_interval_s must not be negative, got {self.heartbeat_interval_s}')
        if self.retain_ended_days is not None and not 0 < self.retain_ended_days < 1e6:
            raise ValueError(
                f'{_name("retain_ended_days")} must be a positive number of days, '
                f'got {self.retain_ended_days}'
            )
        if self.serve_url is not None and not self.serve_url.startswith(('http://', 'https://')):
            raise ValueError(
                f'{_name("serve_url")} must be an http:// or https:// URL, got {self.serve_url!r}'
            )
        if self.trace_url is not None and '{trace_id}' not in self.trace_url:
            raise ValueError(
                f'{_name("trace_url")} must hold {{trace_id}} where the trace id goes, got {self.trace_url!r}'
            )
        if self.redaction not in ('default', 'off'):
            raise ValueError(f'{_name("redaction")} must be default or off, got {self.redaction!r}')
        self._check_security()
        self._check_schema_registry()
        if self.erasure_key is not None:  # a clear error now, not at the first sealed write
            parse_kek(self.erasure_key.get_secret_value())
        if self.signing_key is not None:  # a clear error now, not at the first durability point
            _check_signing_key(self.signing_key)
        if self.s3_cafile and (self.s3_endpoint or '').startswith('http://'):
            raise ValueError(
                f'{_name("s3_cafile")} is set but {_name("s3_endpoint")} is {self.s3_endpoint}, '
                'which is not TLS: use an https:// endpoint, or drop the CA file'
            )

    def _check_security(self) -> None:
        """Refuse a security setup that cannot work, naming the variable to change."""
        protocol = self.security_protocol.upper()
        object.__setattr__(self, 'security_protocol', protocol)
        for secret in SECRET_FIELDS:  # a plain string (or Pydantic's SecretStr) from Python code
            value = getattr(self, secret)
            if isinstance(value, str):
                object.__setattr__(self, secret, SecretStr(value))
            elif value is not None and not isinstance(value, SecretStr):
                object.__setattr__(self, secret, SecretStr(value.get_secret_value()))
        if protocol not in SECURITY_PROTOCOLS:
            choices = ', '.join(SECURITY_PROTOCOLS)
            raise ValueError(f'{_name("security_protocol")} must be one of {choices}, got {protocol!r}')
        mechanism = self.sasl_mechanism.upper() if self.sasl_mechanism else None
        object.__setattr__(self, 'sasl_mechanism', mechanism)
        if protocol.startswith('SASL_'):
            if mechanism is None:
                raise ValueError(
                    f'{_name("security_protocol")}={protocol} needs {_name("sasl_mechanism")}: '
                    f'one of {", ".join(SASL_MECHANISMS)}'
                )
            if mechanism not in SASL_MECHANISMS:
                choices = ', '.join(SASL_MECHANISMS)
                raise ValueError(f'{_name("sasl_mechanism")} must be one of {choices}, got {mechanism!r}')
            if mechanism == 'OAUTHBEARER':
                if not self.sasl_oauth_token_provider:
                    raise ValueError(
                        f'{_name("sasl_mechanism")}=OAUTHBEARER needs {_name("sasl_oauth_token_provider")} '
                        '(module:attribute of an aiokafka AbstractTokenProvider)'
                    )
            elif not self.sasl_username or self.sasl_password is None:
                raise ValueError(
                    f'{_name("sasl_mechanism")}={mechanism} needs {_name("sasl_username")} and '
                    f'{ENV_PREFIX}SASL_PASSWORD (or {ENV_PREFIX}SASL_PASSWORD{FILE_SUFFIX}, a file '
                    'holding it)'
                )
        elif mechanism is not None or self.sasl_username is not None:
            raise ValueError(
                f'SASL credentials are set but {_name("security_protocol")} is {protocol}: '
                'use SASL_SSL (or SASL_PLAINTEXT), or drop the SASL settings'
            )
        tls = (self.ssl_cafile, self.ssl_certfile, self.ssl_keyfile)
        if protocol not in ('SSL', 'SASL_SSL') and any(tls):
            raise ValueError(
                f'TLS files are set but {_name("security_protocol")} is {protocol}: use SSL or SASL_SSL, '
                'or drop the STEPSTREAM_SSL_* settings'
            )
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError(f'{_name("ssl_keyfile")} is set without {_name("ssl_certfile")}')

    def _check_schema_registry(self) -> None:
        """Refuse a registry setup that cannot work, naming the variable to change."""
        url = self.schema_registry_url
        if url is None:
            extra = [
                _name(n)
                for n in ('schema_registry_username', 'schema_registry_password', 'schema_registry_cafile')
                if getattr(self, n) is not None
            ]
            if extra:
                raise ValueError(
                    f'{", ".join(extra)} set without {_name("schema_registry_url")}: set the registry URL, '
                    'or drop the registry settings'
                )
            return
        if not url.startswith(('http://', 'https://')):
            raise ValueError(
                f'{_name("schema_registry_url")} must be an http:// or https:// URL, got {url!r}'
            )
        if (self.schema_registry_username is None) != (self.schema_registry_password is None):
            raise ValueError(
                f'{_name("schema_registry_username")} and {ENV_PREFIX}SCHEMA_REGISTRY_PASSWORD (or '
                f'{ENV_PREFIX}SCHEMA_REGISTRY_PASSWORD{FILE_SUFFIX}) go together: set both, or neither'
            )
        if self.schema_registry_cafile and not url.startswith('https://'):
            raise ValueError(
                f'{_name("schema_registry_cafile")} is set but {_name("schema_registry_url")} is {url}, '
                'which is not TLS: use an https:// URL, or drop the CA file'
            )

    @property
    def operator_name(self) -> str:
        """The operator this process resolves effects as: `operator`, else the OS user."""
        if self.operator:
            return self.operator
        try:
            return getpass.getuser()
        except (KeyError, OSError):  # no name for this uid (a container)
            return f'uid-{os.getuid()}'

    @property
    def retain_ended_us(self) -> int | None:
        """`retain_ended_days` in microseconds, as the projection keeps it (None: keep every run)."""
        return None if self.retain_ended_days is None else round(self.retain_ended_days * 86_400_000_000)

    @property
    def uses_tls(self) -> bool:
        """Whether clients talk TLS to Kafka (`SSL` or `SASL_SSL`)."""
        return self.security_protocol in ('SSL', 'SASL_SSL')

    # Topic names live here so that producer, projector and CLI cannot disagree on them.
    @property
    def step_events_topic(self) -> str:
        """The topic of `StepEvent` records."""
        return f'{self.topic_prefix}.step-events'

    @property
    def tool_effects_topic(self) -> str:
        """The topic of tool-effect transitions."""
        return f'{self.topic_prefix}.tool-effects'

    @property
    def dlq_topic(self) -> str:
        """The topic of records the projector could not apply."""
        return f'{self.topic_prefix}.dlq'

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from `STEPSTREAM_*` variables (defaults for the rest), then `overrides`."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if f.name in SECRET_FIELDS:
                raw = _secret(f.name, raw, env.get(ENV_PREFIX + f.name.upper() + FILE_SUFFIX))
            if raw is not None and raw != '':
                values[f.name] = _parse(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The `STEPSTREAM_*` variables that `from_env` turns back into these settings."""
        env: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, SecretStr):
                value = value.get_secret_value()  # a child process needs the secret itself
            if value is not None:
                env[ENV_PREFIX + f.name.upper()] = str(value)
        return env

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, documented: bool = True) -> None:
        """Add one `--flag` per field but secrets; unset flags fall back to the environment.

        Secrets (`sasl_password`) have no flag: a command line shows in `ps` and shell history.
        Each flag's help is its field's docstring (`documented=False`: none, for a parser that
        will not print help and should not pay for reading the docstrings).
        """
        group = parser.add_argument_group('settings (flags override STEPSTREAM_* variables)')
        docs = {k: v.replace('%', '%%') for k, v in field_docs(cls).items()} if documented else {}
        for f in fields(cls):
            if f.name in SECRET_FIELDS:
                continue
            group.add_argument(
                '--' + f.name.replace('_', '-'),
                dest=f.name,
                default=None,
                metavar=ENV_PREFIX + f.name.upper(),
                help=docs.get(f.name),
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from parsed CLI flags over `environ` (default: the process environment)."""
        flags = {f.name: getattr(args, f.name, None) for f in fields(cls) if f.name not in SECRET_FIELDS}
        parsed = {name: _parse(_field(name), raw) for name, raw in flags.items() if raw is not None}
        return cls.from_env(environ, **parsed)


SECRET_FIELDS = frozenset(
    {
        'sasl_password',
        'serve_token',
        's3_secret_access_key',
        'schema_registry_password',
        'erasure_key',
        'redaction_hash_key',
        'signing_key',
    }
)
"""Fields read only from the environment or a file, hidden from `repr`, and never a CLI flag."""

_TOPIC_CHARS = frozenset('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-')


def _field(name: str) -> dataclasses.Field[Any]:
    return next(f for f in fields(Settings) if f.name == name)


def _name(field_name: str) -> str:
    """How a user sets a field: its variable and its flag."""
    return f'{ENV_PREFIX}{field_name.upper()} (--{field_name.replace("_", "-")})'


def _secret(name: str, raw: str | None, file: str | None) -> str | None:
    """A secret from its variable or from the file its `_FILE` variable names (not both)."""
    variable = ENV_PREFIX + name.upper()
    if not file:
        return raw
    if raw:
        raise ValueError(f'set {variable} or {variable}{FILE_SUFFIX}, not both')
    try:
        return Path(file).read_text().rstrip('\r\n')
    except OSError as exc:
        raise ValueError(f'{variable}{FILE_SUFFIX}={file!r} cannot be read: {exc.strerror}') from None


def _parse(f: dataclasses.Field[Any], raw: str) -> Any:
    kind = str(f.type)
    if kind.startswith('SecretStr'):
        return SecretStr(raw)
    try:
        if kind.startswith('int'):
            return int(raw)
        if kind.startswith('float'):
            return float(raw)
    except ValueError:
        raise ValueError(f'{ENV_PREFIX}{f.name.upper()}={raw!r} is not a valid {kind.split()[0]}') from None
    return raw


def _check_signing_key(key: SecretStr) -> None:
    """Refuse a signing key that is not a PEM Ed25519 private key, naming the variable."""
    try:
        from stepstream.signing import Signer

        Signer.from_secret(key)
    except ImportError:
        raise ValueError(
            f'{ENV_PREFIX}SIGNING_KEY is set, which needs cryptography: pip install "stepstream[audit]"'
        ) from None
    except ValueError as exc:
        raise ValueError(f'{ENV_PREFIX}SIGNING_KEY (or its {FILE_SUFFIX}) is {exc}') from None


def parse_kek(text: str) -> bytes:
    """The key-encryption key from its setting: base64 (standard or URL-safe) of 32 random bytes.

    ```python
    parse_kek(new_kek())   # 32 bytes
    ```
    """
    try:
        raw = base64.urlsafe_b64decode(text.strip().replace('+', '-').replace('/', '_') + '==')
    except (binascii.Error, ValueError):
        raw = b''
    if len(raw) != 32:  # AES-256
        raise ValueError(
            'STEPSTREAM_ERASURE_KEY must be the base64 of 32 random bytes; make one with '
            '`python -c "import stepstream.erasure as e; print(e.new_kek())"`'
        )
    return raw
