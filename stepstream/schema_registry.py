"""A small async client of a Confluent-compatible schema registry: what stepstream needs of one.

The producer asks it for the id of the schema version it writes (looked up, else registered,
once per process), readers ask it which schema an id names (once per id: ids never change). It
speaks the Confluent Schema Registry REST API, which Confluent's registry, Karapace, Apicurio (in
its Confluent-compatible API), Redpanda's and AxonOps' registries serve. Built on httpx, the
`registry` extra (`pip install 'stepstream[registry]'`); see docs/decisions/0028-schema-registry.md.

Every failure names the registry, the setting to check, and the registry's own answer. A registry
that does not answer is a `SchemaRegistryError` (the caller retries or fails its durability point);
an id the registry does not hold, or one that names a schema that is not a committed stepstream
version, is a `SchemaError` with reason `unknown_version` (the record cannot be read, whatever is
retried).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from stepstream.errors import SchemaError, SchemaRegistryError, StepStreamError
from stepstream.schemas import SchemaVersion, version_of_schema
from stepstream.settings import RegistrySettings

if TYPE_CHECKING:
    import httpx

_CONTENT_TYPE = 'application/vnd.schemaregistry.v1+json'
_SETTING = 'STEPSTREAM_SCHEMA_REGISTRY_URL'

MAX_UNKNOWN_IDS = 4096
"""How many ids the registry did not hold a reader remembers (anyone can write any id)."""


class SchemaRegistry:
    """The registry at `schema_registry_url`, with the ids and schemas learnt from it cached.

    ```python
    async with SchemaRegistry(settings.registry, timeout_s=settings.kafka.ack_timeout_s) as registry:
        schema_id = await registry.id_of('stepstream.step-events-value', STEP_EVENT_SCHEMA)
        version = await registry.version_of(schema_id)   # STEP_EVENT_SCHEMA
    ```
    """

    def __init__(self, registry: RegistrySettings, *, timeout_s: float) -> None:
        """Configure the client (each request waits up to `timeout_s`); nothing connects before the first."""
        if registry.schema_registry_url is None:
            raise StepStreamError(f'no schema registry is configured: set {_SETTING}')
        try:
            import httpx
        except ImportError:  # pragma: no cover - the extra is installed wherever tests run
            raise StepStreamError(
                f'{_SETTING} is set, and talking to a schema registry needs httpx: '
                "pip install 'stepstream[registry]'"
            ) from None
        self.url = registry.schema_registry_url.rstrip('/')
        auth = None
        if registry.schema_registry_username is not None and registry.schema_registry_password is not None:
            auth = httpx.BasicAuth(
                registry.schema_registry_username,
                registry.schema_registry_password.get_secret_value(),
            )
        verify: ssl.SSLContext | bool = True
        if registry.schema_registry_cafile:
            verify = ssl.create_default_context()
            verify.load_verify_locations(cafile=registry.schema_registry_cafile)  # besides the system's CAs
        self._client = httpx.AsyncClient(
            base_url=self.url,
            auth=auth,
            verify=verify,
            timeout=timeout_s,
            headers={'Accept': f'{_CONTENT_TYPE}, application/json', 'Content-Type': _CONTENT_TYPE},
        )
        self._httpx = httpx
        self._ids: dict[tuple[str, bytes], int] = {}
        self._looking_up: dict[tuple[str, bytes], asyncio.Future[int]] = {}
        self._versions: dict[int, SchemaVersion] = {}
        self._unknown: dict[int, SchemaError] = {}

    async def __aenter__(self) -> SchemaRegistry:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP connections."""
        await self._client.aclose()

    # -- writing: the id of a schema version under a subject --------------------------------------

    def cached_id(self, subject: str, version: SchemaVersion) -> int | None:
        """The id `id_of` found for this subject and version, without asking; None if not yet."""
        return self._ids.get((subject, version.fingerprint))

    async def id_of(self, subject: str, version: SchemaVersion) -> int:
        """The registry id of `version` under `subject`: looked up, else registered; once per process.

        Concurrent callers share one request. Raises `SchemaRegistryError` when the registry does
        not answer, refuses the credentials, or refuses to register the version (incompatible
        with the versions the subject holds, or no right to register).
        """
        key = (subject, version.fingerprint)
        found = self._ids.get(key)
        if found is not None:
            return found
        pending = self._looking_up.get(key)
        if pending is None:
            pending = self._looking_up[key] = asyncio.ensure_future(
                self._look_up_or_register(subject, version)
            )
            pending.add_done_callback(lambda _: self._looking_up.pop(key, None))
        return await asyncio.shield(pending)

    async def _look_up_or_register(self, subject: str, version: SchemaVersion) -> int:
        body = {'schema': version.path.read_text()}
        where = f'/subjects/{quote(subject, safe="")}'
        response = await self._request('POST', where, body, f'look up {version.name} v{version.version}')
        if response.status_code == 404:  # subject or schema not found: register it
            response = await self._request(
                'POST', f'{where}/versions', body, f'register {version.name} v{version.version}'
            )
            if response.status_code == 409:
                raise SchemaRegistryError(
                    f'the schema registry at {self.url} refused {version.name} v{version.version} under '
                    f'subject {subject!r} as incompatible with the versions it holds: {_said(response)}. '
                    "Check the subject's compatibility level and versions (stepstream registers every "
                    'committed version in order under FULL_TRANSITIVE; docs/analytics.md)',
                    refused=True,
                )
        schema_id = _field(response, 'id')
        if response.status_code != 200 or not isinstance(schema_id, int):
            raise self._refused(response, f'{version.name} v{version.version} under subject {subject!r}')
        self._ids[(subject, version.fingerprint)] = schema_id
        self._versions.setdefault(schema_id, version)
        return schema_id

    async def register_history(
        self, subject: str, versions: Sequence[SchemaVersion], compatibility: str = 'FULL_TRANSITIVE'
    ) -> list[int]:
        """Set `subject`'s compatibility level, then register `versions` in order; their ids.

        What an operator does once per topic so that the registry, not convention, refuses a
        schema change that breaks the evolution rules (docs/decisions/0028-schema-registry.md).
        Raises `SchemaRegistryError` naming the first version the registry refuses.
        """
        where = f'/subjects/{quote(subject, safe="")}'
        response = await self._request(
            'PUT', f'/config/{quote(subject, safe="")}', {'compatibility': compatibility}, 'set compatibility'
        )
        if response.status_code != 200:
            raise self._refused(response, f'compatibility {compatibility} for subject {subject!r}')
        ids = []
        for version in versions:
            response = await self._request(
                'POST', f'{where}/versions', {'schema': version.path.read_text()}, f'register {version.name}'
            )
            schema_id = _field(response, 'id')
            if response.status_code != 200 or not isinstance(schema_id, int):
                raise SchemaRegistryError(
                    f'the schema registry at {self.url} refused {version.path.name} under subject '
                    f'{subject!r} ({compatibility}): {_said(response)}',
                    refused=response.status_code < 500,
                )
            self._ids[(subject, version.fingerprint)] = schema_id
            ids.append(schema_id)
        return ids

    # -- reading: the schema version an id names -------------------------------------------------

    async def version_of(self, schema_id: int) -> SchemaVersion:
        """The committed schema version the registry holds under `schema_id`; asked once per id.

        Raises `SchemaError` (reason `unknown_version`) when the registry holds no such id or the
        schema under it is not a committed stepstream version, and `SchemaRegistryError` when the
        registry does not answer.
        """
        found = self._versions.get(schema_id)
        if found is not None:
            return found
        unknown = self._unknown.get(schema_id)
        if unknown is not None:
            raise unknown
        response = await self._request(
            'GET', f'/schemas/ids/{schema_id}', None, f'read schema id {schema_id}'
        )
        if response.status_code == 404:
            raise self._remember_unknown(
                schema_id,
                f'a Confluent wire-format record with schema id {schema_id}, which the schema registry '
                f'at {self.url} does not hold: written against another registry, or not by stepstream',
            )
        schema = _field(response, 'schema')
        if response.status_code != 200 or not isinstance(schema, str):
            raise self._refused(response, f'schema id {schema_id}')
        schema_type = _field(response, 'schemaType') or 'AVRO'
        version = version_of_schema(schema) if schema_type == 'AVRO' else None
        if version is None:
            raise self._remember_unknown(
                schema_id,
                f'a Confluent wire-format record with schema id {schema_id}, whose {schema_type} schema in '
                f'the registry at {self.url} is not a stepstream schema version this reader has '
                '(written by a newer stepstream? upgrade it)',
            )
        self._versions[schema_id] = version
        return version

    def _remember_unknown(self, schema_id: int, message: str) -> SchemaError:
        error = SchemaError(message, reason='unknown_version')
        if len(self._unknown) >= MAX_UNKNOWN_IDS:
            del self._unknown[next(iter(self._unknown))]
        self._unknown[schema_id] = error
        return error

    # -- HTTP ------------------------------------------------------------------------------------

    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None, what: str
    ) -> httpx.Response:
        try:
            response = await self._client.request(method, path, json=body)
        except self._httpx.HTTPError as exc:
            if _untrusted(exc):
                raise SchemaRegistryError(
                    f'the TLS certificate of the schema registry at {self.url} is not trusted ({what}): '
                    f'{exc}. Set STEPSTREAM_SCHEMA_REGISTRY_CAFILE to the CA that signed it'
                ) from exc
            raise SchemaRegistryError(
                f'the schema registry at {self.url} did not answer ({what}): {exc!r}. Check that it is '
                f'running and reachable ({_SETTING})'
            ) from exc
        if response.status_code in (401, 403):
            raise SchemaRegistryError(
                f'the schema registry at {self.url} refused to {what} ({response.status_code}): '
                f'{_said(response)}. Check STEPSTREAM_SCHEMA_REGISTRY_USERNAME and '
                'STEPSTREAM_SCHEMA_REGISTRY_PASSWORD, and what that principal may do',
                refused=True,
            )
        if response.status_code >= 500:
            raise SchemaRegistryError(
                f'the schema registry at {self.url} failed to {what} ({response.status_code}): '
                f'{_said(response)} ({_SETTING})'
            )
        return response

    def _refused(self, response: httpx.Response, what: str) -> SchemaRegistryError:
        return SchemaRegistryError(
            f'the schema registry at {self.url} answered {response.status_code} for {what}: '
            f'{_said(response)} ({_SETTING})',
            refused=response.status_code < 500,
        )


def _field(response: httpx.Response, name: str) -> Any:
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get(name) if isinstance(body, dict) else None


def _said(response: httpx.Response) -> str:
    """The registry's own message, or the start of its body."""
    message = _field(response, 'message')
    return str(message) if message else (' '.join(response.text[:300].split()) or '(no body)')


def _untrusted(exc: BaseException) -> bool:
    """Whether a request failed on the server's certificate (somewhere in its causes)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
