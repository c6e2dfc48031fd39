"""How every Kafka client stepstream makes connects: the one place TLS and SASL options are built.

The producer (`EventLog`), the projector's consumer and DLQ producer, the admin client that
creates topics, and the CLI all pass `client_options(kafka)` to aiokafka, so a security
setting reaches all of them or none.

aiokafka reports a client that cannot bootstrap as `Unable to bootstrap from [...]` and logs the
reason (a name that does not resolve, a refused port, a refused password, an untrusted
certificate) out of sight. `connection_error` asks the bootstrap servers once more to find that
reason and name the setting that fixes it; only a real timeout mentions the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import socket
import ssl
from typing import Any

from aiokafka.abc import AbstractTokenProvider
from aiokafka.conn import create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    KafkaError,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
    UnsupportedSaslMechanismError,
)
from aiokafka.protocol.metadata import MetadataRequest

from stepstream.errors import AccessDenied, SecureConnectionError, StepStreamError, StepStreamUnavailable
from stepstream.settings import KafkaSettings

AUTHORIZATION_ERRORS = (
    TopicAuthorizationFailedError,
    GroupAuthorizationFailedError,
    ClusterAuthorizationFailedError,
)
"""What a broker with an authorizer answers a principal that lacks an ACL."""


def client_options(kafka: KafkaSettings) -> dict[str, Any]:
    """The keyword arguments every aiokafka client stepstream makes is built with.

    ```python
    consumer = AIOKafkaConsumer(group_id='analytics', **client_options(kafka))
    ```
    """
    options: dict[str, Any] = {
        'bootstrap_servers': kafka.bootstrap_servers,
        'security_protocol': kafka.security_protocol,
    }
    if kafka.uses_tls:
        options['ssl_context'] = ssl_context(kafka)
    if kafka.sasl_mechanism is not None:
        options['sasl_mechanism'] = kafka.sasl_mechanism
        if kafka.sasl_mechanism == 'OAUTHBEARER':
            options['sasl_oauth_token_provider'] = token_provider(kafka)
        else:
            assert kafka.sasl_password is not None  # Settings refuses SASL without one
            options['sasl_plain_username'] = kafka.sasl_username
            options['sasl_plain_password'] = kafka.sasl_password.get_secret_value()
    return options


def ssl_context(kafka: KafkaSettings) -> ssl.SSLContext:
    """A TLS client context: the CA file (else the system's CAs), the client certificate if any.

    Hostname checking stays on: a broker's certificate must name the address clients use.
    """
    if kafka.ssl_cafile:
        _check_file(kafka.ssl_cafile, 'ssl_cafile')
    try:
        context = ssl.create_default_context(cafile=kafka.ssl_cafile)
    except ssl.SSLError as exc:
        raise SecureConnectionError(
            f'STEPSTREAM_SSL_CAFILE={kafka.ssl_cafile!r} holds no CA certificate that can be loaded '
            f'({exc.reason or exc}): set it to a PEM file of the CA that signed the broker certificate'
        ) from None
    if kafka.ssl_certfile:
        _check_file(kafka.ssl_certfile, 'ssl_certfile')
        if kafka.ssl_keyfile:
            _check_file(kafka.ssl_keyfile, 'ssl_keyfile')
        try:
            context.load_cert_chain(kafka.ssl_certfile, kafka.ssl_keyfile)
        except ssl.SSLError as exc:
            raise SecureConnectionError(
                f'the client certificate {kafka.ssl_certfile} and its key '
                f'{kafka.ssl_keyfile or "(in the same file)"} cannot be loaded ({exc.reason or exc}): '
                'set STEPSTREAM_SSL_CERTFILE and STEPSTREAM_SSL_KEYFILE to a PEM certificate and its '
                'unencrypted private key'
            ) from None
    return context


def _check_file(path: str, field_name: str) -> None:
    try:
        with open(path, 'rb'):
            pass
    except OSError as exc:
        raise SecureConnectionError(
            f'STEPSTREAM_{field_name.upper()}={path!r} cannot be read: {exc.strerror}'
        ) from None


def token_provider(kafka: KafkaSettings) -> AbstractTokenProvider:
    """The OAUTHBEARER token provider `kafka.sasl_oauth_token_provider` names.

    `module:attribute` (or `module.attribute`) of an `aiokafka.abc.AbstractTokenProvider`
    instance, or of a class or factory that returns one when called with no arguments.
    """
    spec = kafka.sasl_oauth_token_provider or ''
    module_name, _, attribute = spec.partition(':') if ':' in spec else spec.rpartition('.')
    where = f'STEPSTREAM_SASL_OAUTH_TOKEN_PROVIDER={spec!r}'
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise SecureConnectionError(f'{where} cannot be imported ({exc}): use module:attribute') from None
    provider = found if isinstance(found, AbstractTokenProvider) else found() if callable(found) else found
    if not isinstance(provider, AbstractTokenProvider):
        raise SecureConnectionError(
            f'{where} is a {type(provider).__name__}, not an aiokafka.abc.AbstractTokenProvider '
            '(or a class or factory that returns one)'
        )
    return provider


def principal(kafka: KafkaSettings) -> str:
    """Who these settings authenticate as, in words an error message can use."""
    if kafka.sasl_mechanism == 'OAUTHBEARER':
        return f'the OAUTHBEARER principal of {kafka.sasl_oauth_token_provider}'
    if kafka.sasl_mechanism is not None:
        return f'SASL user {kafka.sasl_username!r}'
    if kafka.ssl_certfile:
        return f'the client certificate {kafka.ssl_certfile}'
    return 'the anonymous principal (no SASL, no client certificate)'


def access_denied(kafka: KafkaSettings, doing: str, exc: BaseException, *, fix: str) -> AccessDenied:
    """The error for a principal the broker's ACLs refuse, saying what was refused and how to fix it."""
    return AccessDenied(
        f'Kafka at {kafka.bootstrap_servers} refused {principal(kafka)} to {doing} '
        f'({type(exc).__name__}): {fix}. docs/security.md lists the ACLs each stepstream role needs.'
    )


def unavailable(kafka: KafkaSettings, what: str, exc: BaseException | None = None) -> StepStreamUnavailable:
    """The error for a Kafka cluster that does not answer, naming the servers and the timeout."""
    cause = f': {exc!r}' if exc is not None else ''
    return StepStreamUnavailable(
        f'Kafka at {kafka.bootstrap_servers} {what} within {kafka.ack_timeout_s:g}s{cause}. '
        'Check that the broker is running and reachable (STEPSTREAM_BOOTSTRAP_SERVERS), '
        'or raise STEPSTREAM_ACK_TIMEOUT_S.'
    )


async def connection_error(kafka: KafkaSettings, what: str, exc: BaseException) -> StepStreamError:
    """The error to raise when a client could not start: the TLS or SASL cause if there is one.

    Asks the first bootstrap server again on one connection (bounded by the timeout) to learn
    why; a server that is simply down or slow gives the plain `unavailable` error.
    """
    if isinstance(exc, StepStreamError):
        return exc
    probe_s = min(kafka.ack_timeout_s, 3.0)
    network = await _network_problem(kafka.bootstrap_servers, probe_s)
    if network is not None:
        return StepStreamUnavailable(
            f'Kafka at {kafka.bootstrap_servers} {what}: {network}. Check STEPSTREAM_BOOTSTRAP_SERVERS '
            '(`stepstream stack up` starts an embedded broker and points the CLI at it).'
        )
    # A TLS or SASL cause shows at once; a service that is silent to a Kafka request would hold
    # the diagnosis to its timeout, so after `probe_s` a plain ApiVersions probe decides that.
    diagnosis = asyncio.ensure_future(asyncio.wait_for(_diagnose(kafka), kafka.ack_timeout_s))
    try:
        done, _ = await asyncio.wait([diagnosis], timeout=probe_s)
        if not (done and diagnosis.exception() is None and diagnosis.result()) and not kafka.uses_tls:
            host, port = _first_server(kafka)
            if not await _speaks_plain_kafka(host, port, probe_s):
                return StepStreamUnavailable(
                    f'Kafka at {kafka.bootstrap_servers} {what}: the service on {host}:{port} accepts '
                    'connections but does not answer a Kafka request, so it is not a Kafka broker (or '
                    'not a Kafka listener). Check STEPSTREAM_BOOTSTRAP_SERVERS.'
                )
        try:
            cause = await diagnosis
        except TimeoutError:
            cause = None
    finally:
        diagnosis.cancel()
    return cause or unavailable(kafka, what, exc)


async def broker_answers(kafka: KafkaSettings) -> bool:
    """Whether a bootstrap server completes a connection as these settings make it (TLS, SASL).

    One connection with no retries and no log lines: the projector service asks it to notice a
    lost broker coming back.
    """
    options = client_options(kafka)
    options.pop('bootstrap_servers')
    timeout = min(kafka.ack_timeout_s, 3.0)
    for server in kafka.bootstrap_servers.split(','):
        host, _, port = server.strip().rpartition(':')
        try:
            conn = await asyncio.wait_for(
                create_conn(
                    host.strip('[]'),
                    int(port),
                    client_id='stepstream-probe',
                    request_timeout_ms=int(timeout * 1000),
                    **options,
                ),
                timeout,
            )
        except (KafkaError, OSError, TimeoutError, ValueError):
            continue
        conn.close()
        return True
    return False


async def _network_problem(servers: str, timeout_s: float) -> str | None:
    """Why no bootstrap server accepts a TCP connection, in one sentence; None if one does.

    Separates a host name that does not resolve, a refused port and a connection that times out,
    which aiokafka reports alike.
    """
    problems = []
    for server in servers.split(','):
        problem = await _server_problem(server.strip(), timeout_s)
        if problem is None:
            return None
        problems.append(problem)
    return '; '.join(problems)


async def _server_problem(server: str, timeout_s: float) -> str | None:
    host, _, port_text = server.rpartition(':')
    host = host.strip('[]')
    if not host or not port_text.isdigit():
        return f'{server!r} is not HOST:PORT'
    port = int(port_text)
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout_s)
    except socket.gaierror as exc:
        return f'the host name {host!r} does not resolve ({exc.strerror})'
    except TimeoutError:
        return f'the host name {host!r} did not resolve within {timeout_s:g}s'
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except ConnectionRefusedError:
        return f'nothing listens on {host}:{port} (connection refused)'
    except TimeoutError:
        return (
            f'{host}:{port} did not accept a connection within {timeout_s:g}s (a firewall, or a host '
            'that is down); raise STEPSTREAM_ACK_TIMEOUT_S only if the network is just slow'
        )
    except OSError as exc:
        return f'cannot connect to {host}:{port} ({exc.strerror or exc})'
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


async def _diagnose(kafka: KafkaSettings) -> SecureConnectionError | None:
    host, port = _first_server(kafka)
    where = f'Kafka at {host}:{port}'
    options = client_options(kafka)
    options.pop('bootstrap_servers')
    try:
        conn = await create_conn(
            host,
            port,
            client_id='stepstream-diagnosis',
            request_timeout_ms=int(kafka.ack_timeout_s * 1000),
            **options,
        )
        try:
            await conn.send(MetadataRequest([]))
        finally:
            conn.close()
    except ssl.SSLCertVerificationError as err:
        if err.verify_code == 62:  # X509_V_ERR_HOSTNAME_MISMATCH
            return SecureConnectionError(
                f"{where}: the broker's TLS certificate does not name {host} ({err.verify_message}). "
                'Connect through a name the certificate holds (STEPSTREAM_BOOTSTRAP_SERVERS), '
                'or reissue the certificate with that name'
            )
        trusted = (
            f'the CA in STEPSTREAM_SSL_CAFILE={kafka.ssl_cafile}' if kafka.ssl_cafile else "the system's CAs"
        )
        return SecureConnectionError(
            f"{where}: the broker's TLS certificate is not trusted by {trusted} ({err.verify_message}). "
            'Set STEPSTREAM_SSL_CAFILE to the PEM file of the CA that signed the broker certificate'
        )
    except ssl.SSLError as err:
        return _tls_refused(kafka, where, err)
    except (SaslAuthenticationFailed, AuthenticationFailedError) as err:
        return SecureConnectionError(
            f'{where} refused SASL {kafka.sasl_mechanism} authentication as {principal(kafka)} '
            f'({err}). Check STEPSTREAM_SASL_USERNAME and STEPSTREAM_SASL_PASSWORD '
            '(or STEPSTREAM_SASL_PASSWORD_FILE), and that the user exists for this mechanism'
        )
    except UnsupportedSaslMechanismError as err:
        return SecureConnectionError(
            f'{where} does not offer SASL {kafka.sasl_mechanism} on this listener ({err}). '
            'Set STEPSTREAM_SASL_MECHANISM to one the listener enables'
        )
    except (KafkaError, OSError, TimeoutError) as err:
        tls_error = _ssl_cause(err)
        if tls_error is not None:
            return _tls_refused(kafka, where, tls_error)
        if isinstance(err, ConnectionRefusedError | TimeoutError):
            return None  # down or slow, not refused: the plain "unavailable" error says so
        if not kafka.uses_tls and await _speaks_tls(host, port, kafka.ack_timeout_s):
            wanted = 'SASL_SSL' if kafka.security_protocol == 'SASL_PLAINTEXT' else 'SSL or SASL_SSL'
            return SecureConnectionError(
                f'{where} speaks TLS, but STEPSTREAM_SECURITY_PROTOCOL is {kafka.security_protocol}: '
                f'set it to {wanted} (and STEPSTREAM_SSL_CAFILE if a private CA signed the broker)'
            )
        if kafka.uses_tls and await _speaks_plain_kafka(host, port, kafka.ack_timeout_s):
            plain = 'SASL_PLAINTEXT' if kafka.security_protocol == 'SASL_SSL' else 'PLAINTEXT'
            return SecureConnectionError(
                f'{where} does not speak TLS on this listener, but STEPSTREAM_SECURITY_PROTOCOL is '
                f'{kafka.security_protocol}: use the TLS listener (STEPSTREAM_BOOTSTRAP_SERVERS) or '
                f'set the protocol to {plain}'
            )
        if kafka.security_protocol == 'PLAINTEXT' and await _speaks_plain_kafka(
            host, port, kafka.ack_timeout_s
        ):
            return SecureConnectionError(
                f'{where} closed the connection before answering ({err!r}); a listener that requires '
                'SASL does that. Set STEPSTREAM_SECURITY_PROTOCOL and STEPSTREAM_SASL_* to what the '
                'listener expects'
            )
    return None


def _tls_refused(kafka: KafkaSettings, where: str, err: ssl.SSLError) -> SecureConnectionError:
    reason = (err.reason or str(err)).upper()
    if 'WRONG_VERSION_NUMBER' in reason or 'RECORD_LAYER' in reason or 'UNEXPECTED_EOF' in reason:
        plain = 'SASL_PLAINTEXT' if kafka.security_protocol == 'SASL_SSL' else 'PLAINTEXT'
        return SecureConnectionError(
            f'{where} does not speak TLS on this listener ({err.reason or err}), but '
            f'STEPSTREAM_SECURITY_PROTOCOL is {kafka.security_protocol}: use the TLS listener '
            f'(STEPSTREAM_BOOTSTRAP_SERVERS) or set the protocol to {plain}'
        )
    # The alerts a broker sends for a missing or untrusted client certificate (Java sends BAD_CERTIFICATE
    # for a missing one, CERTIFICATE_UNKNOWN for one of another CA).
    refused = (
        'CERTIFICATE_REQUIRED',
        'HANDSHAKE_FAILURE',
        'BAD_CERTIFICATE',
        'UNKNOWN_CA',
        'CERTIFICATE_UNKNOWN',
    )
    if not kafka.ssl_certfile and any(word in reason for word in refused):
        return SecureConnectionError(
            f'{where} requires a client certificate (mutual TLS) and none was sent '
            f'({err.reason or err}). Set STEPSTREAM_SSL_CERTFILE (and STEPSTREAM_SSL_KEYFILE) to a '
            'certificate its CA signed'
        )
    if any(word in reason for word in refused):
        return SecureConnectionError(
            f'{where} refused the client certificate STEPSTREAM_SSL_CERTFILE={kafka.ssl_certfile} '
            f'({err.reason or err}): the broker does not trust the CA that signed it'
        )
    return SecureConnectionError(f'{where}: the TLS handshake failed ({err.reason or err})')


def _ssl_cause(err: BaseException) -> ssl.SSLError | None:
    """The TLS error behind a connection error, if any (aiokafka wraps some of them)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


async def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether the server completes a TLS handshake (its certificate is not checked here)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=context), timeout)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError):
        await writer.wait_closed()
    return True


async def _speaks_plain_kafka(host: str, port: int, timeout: float) -> bool:
    """Whether the server answers a Kafka ApiVersions request without TLS."""
    try:
        conn = await asyncio.wait_for(
            create_conn(host, port, client_id='stepstream-diagnosis', request_timeout_ms=int(timeout * 1000)),
            timeout,
        )
    except (KafkaError, OSError, TimeoutError):
        return False
    conn.close()
    return True


def _first_server(kafka: KafkaSettings) -> tuple[str, int]:
    first = kafka.bootstrap_servers.split(',')[0].strip()
    host, _, port = first.rpartition(':')
    return (host.strip('[]') or first), int(port or 9092)
