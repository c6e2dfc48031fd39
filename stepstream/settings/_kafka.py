"""The sections of how stepstream talks to its brokers: Kafka itself and the schema registry."""

from __future__ import annotations

from dataclasses import dataclass, field

from stepstream.secret import SecretStr
from stepstream.settings._names import ENV_PREFIX, FILE_SUFFIX, as_secret, http_url, name, positive

SECURITY_PROTOCOLS = ('PLAINTEXT', 'SSL', 'SASL_PLAINTEXT', 'SASL_SSL')
SASL_MECHANISMS = ('PLAIN', 'SCRAM-SHA-256', 'SCRAM-SHA-512', 'OAUTHBEARER')


@dataclass(frozen=True, kw_only=True)
class KafkaSettings:
    """Where the Kafka brokers are, how clients authenticate to them, and how long they wait."""

    bootstrap_servers: str = '127.0.0.1:9092'
    """Comma-separated Kafka bootstrap servers."""
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

    def __post_init__(self) -> None:
        """Refuse a setup that cannot work, naming the variable to change."""
        as_secret(self, 'sasl_password')
        positive(self, 'ack_timeout_s')
        protocol = self.security_protocol.upper()
        object.__setattr__(self, 'security_protocol', protocol)
        if protocol not in SECURITY_PROTOCOLS:
            choices = ', '.join(SECURITY_PROTOCOLS)
            raise ValueError(f'{name("security_protocol")} must be one of {choices}, got {protocol!r}')
        mechanism = self.sasl_mechanism.upper() if self.sasl_mechanism else None
        object.__setattr__(self, 'sasl_mechanism', mechanism)
        if protocol.startswith('SASL_'):
            self._check_sasl(protocol, mechanism)
        elif mechanism is not None or self.sasl_username is not None:
            raise ValueError(
                f'SASL credentials are set but {name("security_protocol")} is {protocol}: '
                'use SASL_SSL (or SASL_PLAINTEXT), or drop the SASL settings'
            )
        tls = (self.ssl_cafile, self.ssl_certfile, self.ssl_keyfile)
        if protocol not in ('SSL', 'SASL_SSL') and any(tls):
            raise ValueError(
                f'TLS files are set but {name("security_protocol")} is {protocol}: use SSL or SASL_SSL, '
                'or drop the STEPSTREAM_SSL_* settings'
            )
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError(f'{name("ssl_keyfile")} is set without {name("ssl_certfile")}')

    def _check_sasl(self, protocol: str, mechanism: str | None) -> None:
        if mechanism is None:
            raise ValueError(
                f'{name("security_protocol")}={protocol} needs {name("sasl_mechanism")}: '
                f'one of {", ".join(SASL_MECHANISMS)}'
            )
        if mechanism not in SASL_MECHANISMS:
            choices = ', '.join(SASL_MECHANISMS)
            raise ValueError(f'{name("sasl_mechanism")} must be one of {choices}, got {mechanism!r}')
        if mechanism == 'OAUTHBEARER':
            if not self.sasl_oauth_token_provider:
                raise ValueError(
                    f'{name("sasl_mechanism")}=OAUTHBEARER needs {name("sasl_oauth_token_provider")} '
                    '(module:attribute of an aiokafka AbstractTokenProvider)'
                )
        elif not self.sasl_username or self.sasl_password is None:
            raise ValueError(
                f'{name("sasl_mechanism")}={mechanism} needs {name("sasl_username")} and '
                f'{ENV_PREFIX}SASL_PASSWORD (or {ENV_PREFIX}SASL_PASSWORD{FILE_SUFFIX}, a file '
                'holding it)'
            )

    @property
    def uses_tls(self) -> bool:
        """Whether clients talk TLS to Kafka (`SSL` or `SASL_SSL`)."""
        return self.security_protocol in ('SSL', 'SASL_SSL')


@dataclass(frozen=True, kw_only=True)
class RegistrySettings:
    """A Confluent-compatible schema registry, or none (the default)."""

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

    def __post_init__(self) -> None:
        """Refuse a registry setup that cannot work, naming the variable to change."""
        as_secret(self, 'schema_registry_password')
        url = self.schema_registry_url
        if url is None:
            extra = [
                name(n)
                for n in ('schema_registry_username', 'schema_registry_password', 'schema_registry_cafile')
                if getattr(self, n) is not None
            ]
            if extra:
                raise ValueError(
                    f'{", ".join(extra)} set without {name("schema_registry_url")}: set the registry URL, '
                    'or drop the registry settings'
                )
            return
        http_url('schema_registry_url', url)
        if (self.schema_registry_username is None) != (self.schema_registry_password is None):
            raise ValueError(
                f'{name("schema_registry_username")} and {ENV_PREFIX}SCHEMA_REGISTRY_PASSWORD (or '
                f'{ENV_PREFIX}SCHEMA_REGISTRY_PASSWORD{FILE_SUFFIX}) go together: set both, or neither'
            )
        if self.schema_registry_cafile and not url.startswith('https://'):
            raise ValueError(
                f'{name("schema_registry_cafile")} is set but {name("schema_registry_url")} is {url}, '
                'which is not TLS: use an https:// URL, or drop the CA file'
            )
