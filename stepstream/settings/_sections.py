"""The sections of `Settings` besides the brokers': topics, media, projection, security, liveness, serve.

Each section is a frozen dataclass that checks its own fields when it is made, so a value has one
name, one default and one check; a part takes the section (or the value) it uses.
"""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass, field

from stepstream.kek import parse_kek
from stepstream.secret import SecretStr
from stepstream.settings._names import (
    ENV_PREFIX,
    FILE_SUFFIX,
    as_secret,
    check_count,
    http_url,
    name,
    not_negative,
    set_by,
)

_TOPIC_CHARS = frozenset('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-')


@dataclass(frozen=True, kw_only=True)
class TopicSettings:
    """The names of stepstream's topics, and how it creates them."""

    topic_prefix: str = 'stepstream'
    """Topics are `{prefix}.step-events`, `{prefix}.tool-effects` and `{prefix}.dlq`."""
    partitions: int = 6
    """Partition count used when stepstream creates its topics (the same for both topics)."""
    replication_factor: int = 1
    """Replication factor used when stepstream creates its topics."""

    def __post_init__(self) -> None:
        if not self.topic_prefix or any(c not in _TOPIC_CHARS for c in self.topic_prefix):
            raise ValueError(
                f'topic_prefix {self.topic_prefix!r} is not a valid Kafka topic prefix'
                f'{set_by("topic_prefix")}: use letters, digits, ".", "_" and "-"'
            )
        for count in ('partitions', 'replication_factor'):
            check_count(getattr(self, count), count, set_by(count))

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


@dataclass(frozen=True, kw_only=True)
class MediaSettings:
    """The media store (S3 or S3-compatible), and which payloads go there."""

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

    def __post_init__(self) -> None:
        as_secret(self, 's3_secret_access_key')
        MediaSettings.check_threshold(
            self.media_threshold_bytes, 'media_threshold_bytes', set_by('media_threshold_bytes')
        )
        if self.s3_cafile and (self.s3_endpoint or '').startswith('http://'):
            raise ValueError(
                f'{name("s3_cafile")} is set but {name("s3_endpoint")} is {self.s3_endpoint}, '
                'which is not TLS: use an https:// endpoint, or drop the CA file'
            )

    @staticmethod
    def check_threshold(value: object, what: str, where: str = '') -> None:
        """Refuse a media threshold that is not a positive int, naming `what`: the one check of it.

        The setting's, and that of the parts that take a threshold directly (`offload_media`,
        `StepPersistence(media_threshold_bytes=...)`, `MediaExternalizer`).
        """
        check_count(value, what, where)


@dataclass(frozen=True, kw_only=True)
class ProjectionSettings:
    """Where the projector's read model lives, and how long it keeps ended runs."""

    db_path: str = '.stepstream/projection'
    """Directory of the projector's RocksDB."""
    retain_ended_days: float | None = None
    """Retention of the read model: runs that ended more than this many days before the newest
    step event of their partition (log time, not the clock) are dropped from the projection, and
    their media once no kept run references it (`stepstream retention`). Unset keeps every run;
    it is part of what a projection is, so changing it means a rebuild (docs/retention.md)."""

    def __post_init__(self) -> None:
        if self.retain_ended_days is not None and not 0 < self.retain_ended_days < 1e6:
            raise ValueError(
                f'{name("retain_ended_days")} must be a positive number of days, got {self.retain_ended_days}'
            )

    @property
    def retain_ended_us(self) -> int | None:
        """`retain_ended_days` in microseconds, as the projection keeps it (None: keep every run)."""
        return None if self.retain_ended_days is None else round(self.retain_ended_days * 86_400_000_000)


@dataclass(frozen=True, kw_only=True)
class SecuritySettings:
    """What writers do to content before it reaches the log: redact, seal (erasure) and sign."""

    redaction: str = 'default'
    """What writers redact before anything reaches the log: `default` (values under secret-named keys
    and secrets of well-known formats, decision 0047) or `off` (nothing: every secret an agent
    hands a tool is written as it is)."""
    redaction_keys: str | None = None
    """More key names whose values are secrets, comma-separated (`pin,ssn`), besides the default ones."""
    redaction_hash_key: SecretStr | None = field(default=None, repr=False)
    """A key (from `STEPSTREAM_REDACTION_HASH_KEY` or its `_FILE`, never a flag): set, each marker
    carries the redacted value's HMAC-SHA256, so two redacted values compare without being read."""
    erasure_key: SecretStr | None = field(default=None, repr=False)
    """The key-encryption key of erasure by crypto-shredding (base64 of 32 random bytes, from
    `STEPSTREAM_ERASURE_KEY` or its `_FILE`, never a flag): set, writers seal message content and
    media with per-conversation keys that `stepstream forget` can destroy; unset (the default),
    nothing is sealed. Every writer and reader of one log needs the same key (decision 0033)."""
    signing_key: SecretStr | None = field(default=None, repr=False)
    """A writer's Ed25519 private key, PEM (from `STEPSTREAM_SIGNING_KEY` or its `_FILE`, never a
    flag): set, each writer signs its runs' chain heads at their durability points, and `stepstream
    audit checkpoint` signs its checkpoints, so an auditor holding the public key can tell the
    writer's records from anyone else's (docs/audit.md). Unset (the default), nothing is signed."""

    def __post_init__(self) -> None:
        as_secret(self, 'redaction_hash_key', 'erasure_key', 'signing_key')
        if self.redaction not in ('default', 'off'):
            raise ValueError(f'{name("redaction")} must be default or off, got {self.redaction!r}')
        if self.erasure_key is not None:  # a clear error now, not at the first sealed write
            parse_kek(self.erasure_key.get_secret_value())
        if self.signing_key is not None:  # a clear error now, not at the first durability point
            _check_signing_key(self.signing_key)


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


@dataclass(frozen=True, kw_only=True)
class LivenessSettings:
    """How writers show they are alive, and when views call a quiet run stale."""

    heartbeat_interval_s: float = 5.0
    """A writer appends a `run_heartbeat` for each open run that has written nothing else for this
    many seconds, so that readers can tell a quiet run from a dead one (0: no heartbeats)."""
    stale_after_s: float = 20.0
    """Views show a `running` run as `stale` once it has had no record for this many seconds (keep
    it a few heartbeat intervals: a writer whose process died reads stale within it)."""

    def __post_init__(self) -> None:
        not_negative(self, 'stale_after_s', 'heartbeat_interval_s')


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """The read service (`stepstream serve`) and the people who use it: token, URLs, operator."""

    serve_token: SecretStr | None = field(default=None, repr=False)
    """Bearer token `stepstream serve` requires (from `STEPSTREAM_SERVE_TOKEN` or its `_FILE`, never
    a flag); needed to serve on anything but loopback, and enforced on every request when set."""
    serve_url: str | None = None
    """A read service (`stepstream serve`, `http://host:port`) the CLI's views ask instead of opening
    the projection: set, `runs`, `tree`, `events`, ... print its answer (they read `db_path` when it
    does not answer). Unset, they ask the stack's service when their settings are the stack's."""
    trace_url: str | None = None
    """The trace viewer's URL with `{trace_id}` (and `{span_id}` if it takes one), for example
    Jaeger's `http://localhost:16686/trace/{trace_id}`: the explorer links each event to the trace
    it was written under. Unset, the explorer shows the trace id."""
    operator: str | None = None
    """Who resolves unknown tool effects from this process (`stepstream resolve`, the explorer); the
    OS user when unset. Recorded in the log with every resolution."""

    def __post_init__(self) -> None:
        as_secret(self, 'serve_token')
        http_url('serve_url', self.serve_url)
        if self.trace_url is not None and '{trace_id}' not in self.trace_url:
            raise ValueError(
                f'{name("trace_url")} must hold {{trace_id}} where the trace id goes, got {self.trace_url!r}'
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
