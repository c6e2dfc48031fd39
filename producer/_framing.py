"""`Framing`: how a record's bytes leave, as the serializer wrote them or in the registry's framing.

By default a record leaves as its serializer wrote it (Avro single-object encoding). In registry
mode (`settings.registry.schema_registry_url`) the log reframes it in the Confluent wire format, its
schema's id asked of the registry once per process.
"""

from __future__ import annotations

import asyncio

from stepstream.errors import SchemaRegistryError, StepStreamError
from stepstream.schema_registry import SchemaRegistry
from stepstream.schemas import LogRecord, schema_of, subject_of, to_confluent
from stepstream.settings import RegistrySettings


class Framing:
    """The registry framing of one log: no `registry` outside registry mode (records leave as written)."""

    __slots__ = ('failure', 'registry', 'registry_settings', 'timeout_s')

    def __init__(self, registry: RegistrySettings, timeout_s: float) -> None:
        self.registry_settings = registry
        self.timeout_s = timeout_s
        """`ack_timeout_s`: the registry client's timeout; asking it for a schema id waits half of it."""
        self.registry: SchemaRegistry | None = None
        """Set in registry mode (`schema_registry_url`) once started: records leave framed for it."""
        self.failure: SchemaRegistryError | None = None
        """Why the registry last failed to give a schema id; None once it gives one."""

    def start(self) -> None:
        if self.registry_settings.schema_registry_url is not None:
            self.registry = SchemaRegistry(self.registry_settings, timeout_s=self.timeout_s)

    async def close(self) -> None:
        registry, self.registry = self.registry, None
        if registry is not None:
            await registry.close()

    async def confluent(self, record: LogRecord, value: bytes, topic: str) -> bytes:
        """The record in the Confluent wire format, its schema's id asked of the registry once per process.

        Raises `SchemaRegistryError` when the id is not cached and the registry does not give it:
        the record is then kept and sent again like one the broker did not take.
        """
        assert self.registry is not None
        schema, subject = schema_of(record), subject_of(topic)
        schema_id = self.registry.cached_id(subject, schema)
        if schema_id is None:
            try:
                # Within the send's own timeout, so that a registry that hangs is named as the cause.
                async with asyncio.timeout(self.timeout_s / 2):
                    schema_id = await self.registry.id_of(subject, schema)
            except (SchemaRegistryError, TimeoutError) as exc:
                self.failure = SchemaRegistryError(
                    f'{exc if isinstance(exc, SchemaRegistryError) else self._timeout()}. '
                    f'Records of {schema.name} are kept, and sent once it gives their schema id'
                )
                raise self.failure from exc
            self.failure = None
        if value[2:10] != schema.fingerprint:
            raise StepStreamError(
                f'the serializer did not write {schema.name} v{schema.version} in single-object encoding, '
                'which the registry mode reframes: use the default serializer with a schema registry'
            )
        return to_confluent(value, schema_id)

    def _timeout(self) -> str:
        assert self.registry is not None
        return (
            f'the schema registry at {self.registry.url} did not answer within '
            f'{self.timeout_s / 2:g}s: check STEPSTREAM_SCHEMA_REGISTRY_URL'
        )
