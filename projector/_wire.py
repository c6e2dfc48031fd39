"""Reading both wire formats: Confluent-framed records are turned into their single-object form.

Each record says its own format by its first bytes (`C3 01` single-object, `00` Confluent), so a
topic may hold both, even within one run, and moves from one to the other without a rebuild. A
Confluent record's schema id is resolved through the registry (once per id and process) to the
committed schema version it names; the record is then the same Avro body under the other header,
and the projection stores and compares that single-object form. So the projection (and `verify`,
the export, a rebuild) is the same whichever format the records were written in, and a record
written once in each format is one record (a duplicate).

Records that cannot be resolved are marked unreadable and go to the DLQ (`unknown_version`): an id
the registry does not hold, a schema that is not a stepstream version, or no registry configured.
A registry that does not answer is not the record's fault: the batch waits and is retried, and
nothing is dead-lettered for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from stepstream.errors import SchemaError, SchemaRegistryError
from stepstream.projector._apply import SourceRecord
from stepstream.schema_registry import SchemaRegistry
from stepstream.schemas import CONFLUENT_MAGIC, SchemaVersion, confluent_schema_id, from_confluent
from stepstream.settings import Settings

log = logging.getLogger('stepstream.projector')


class WireFormats:
    """Turns the Confluent-framed records of a batch into single-object records, or marks them."""

    def __init__(self, settings: Settings) -> None:
        """A registry client when `settings` name one; without, Confluent records are unreadable."""
        self.registry = (
            SchemaRegistry(settings.registry, timeout_s=settings.kafka.ack_timeout_s)
            if settings.registry.schema_registry_url
            else None
        )

    async def close(self) -> None:
        """Close the registry client."""
        if self.registry is not None:
            await self.registry.close()

    async def read(
        self, records: list[SourceRecord], stopping: Callable[[], bool]
    ) -> list[SourceRecord] | None:
        """`records`, with every Confluent-framed one in single-object form or marked unreadable.

        Waits (retrying with backoff) while the registry does not answer; None when `stopping()`
        becomes true meanwhile: the batch is then not applied, and is read again on restart.
        """
        ids = {
            schema_id
            for r in records
            if r.value
            and r.value[0] == CONFLUENT_MAGIC
            and (schema_id := confluent_schema_id(r.value)) is not None
        }
        if not ids:
            return records  # the common case: nothing to resolve
        resolved = await self._resolve(sorted(ids), stopping)
        if resolved is None:
            return None
        out = []
        for record in records:
            value = record.value
            schema_id = confluent_schema_id(value) if value and value[0] == CONFLUENT_MAGIC else None
            if schema_id is None:
                out.append(record)
                continue
            assert value is not None
            found = resolved[schema_id]
            where = (record.topic, record.partition, record.offset, record.key)
            if isinstance(found, SchemaVersion):
                out.append(SourceRecord(*where, from_confluent(value, found)))
            else:
                out.append(SourceRecord(*where, value, unreadable=found))
        return out

    async def _resolve(
        self, ids: Sequence[int], stopping: Callable[[], bool]
    ) -> dict[int, SchemaVersion | SchemaError] | None:
        registry = self.registry
        if registry is None:
            return {
                schema_id: SchemaError(
                    f'a Confluent wire-format record (schema id {schema_id}), and no schema registry '
                    'is configured to read it: set STEPSTREAM_SCHEMA_REGISTRY_URL, then rebuild the '
                    'projection to apply the records dead-lettered meanwhile',
                    reason='unknown_version',
                )
                for schema_id in ids
            }
        delay = 0.2
        while True:
            try:
                found = await asyncio.gather(*(_version_or_error(registry, i) for i in ids))
                return dict(zip(ids, found, strict=True))
            except SchemaRegistryError as exc:
                if stopping():
                    return None
                log.warning('%s; the batch waits, retrying in %.1fs', exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


async def _version_or_error(registry: SchemaRegistry, schema_id: int) -> SchemaVersion | SchemaError:
    try:
        return await registry.version_of(schema_id)
    except SchemaError as exc:
        return exc
