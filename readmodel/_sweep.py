"""The media sweep: delete payloads that no kept run references, once they are old enough.

Retention drops expired runs from the projection (`_retention.py`); their media stays in the
bucket until a sweep. A sweep is mark and sweep over the projection (docs/decisions/0032-retention.md):

0. Refuse an index that may be incomplete: every shard's media index must be of the current
   version (`MEDIA_INDEX_VERSION`); one made before it missed offloaded binaries (decision 0041).
1. Catch up: wait until the projection has applied the log up to the end it had when the sweep
   began (`stepstream retention sweep-media` does this), so every record written before then
   has its references in the `MEDIA` index.
2. Mark: the union of every shard's `MEDIA` index, i.e. what the kept runs reference. Shared
   payloads (content addressing stores identical bytes once) are marked while any kept run
   references them.
3. Sweep: list the bucket's payload objects; those not marked and older than the grace period
   are the candidates. A payload uploaded a moment ago for a record not applied yet is young; one a
   writer re-uses is uploaded again when older than `REFRESH_AFTER` (`S3MediaStore.put`), so it
   is young again too. The grace period covers that refresh age plus the time from a writer's
   put to its record being applied. Writers and the sweep must agree on that refresh age
   (`S3MediaStore(refresh_after=)`, one hour by default).
4. Check: before deleting a candidate, ask once more, without the index, whether a kept run
   reads it (`ProjectionReader.media_read`: every kept snapshot's tail walked as a reader walks
   it, JSON payloads opened). A candidate a kept run reads is kept and reported as `guarded`: an
   index bug makes the sweep skip, never delete. The check runs only when there are candidates.

A sweep keeps no state: one that dies half way (or whose member fails over) leaves objects for
the next, and deleting an object twice is harmless.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from stepstream.errors import UsageError
from stepstream.media import MEDIA_URI_SCHEME, S3MediaStore, StoredPayload
from stepstream.storage import MEDIA_INDEX_VERSION

if TYPE_CHECKING:
    from stepstream.readmodel import ProjectionReader

log = logging.getLogger(__name__)

DEFAULT_GRACE = timedelta(hours=24)
"""How old an unreferenced payload must be before a sweep deletes it."""


@dataclass(slots=True)
class SweepReport:
    """What one sweep saw and did."""

    referenced: int = 0
    """Distinct payloads the kept runs reference (the mark)."""
    listed: int = 0
    """Payload objects in the bucket."""
    young: int = 0
    """Unreferenced objects kept because they are younger than the grace period."""
    guarded: list[StoredPayload] = field(default_factory=list)
    """Unmarked by the index but read by a kept run (the last check): kept. Any here means the
    index is incomplete: rebuild the projection."""
    deleted: list[StoredPayload] = field(default_factory=list)
    """Unreferenced objects older than the grace period: deleted (or, in a dry run, to be)."""
    dry_run: bool = False

    @property
    def deleted_bytes(self) -> int:
        """The bytes the deleted objects held."""
        return sum(p.size for p in self.deleted)


async def sweep_media(
    reader: ProjectionReader,
    store: S3MediaStore,
    *,
    grace: timedelta = DEFAULT_GRACE,
    dry_run: bool = False,
    now: datetime | None = None,
) -> SweepReport:
    """Delete the payloads no kept run references that are older than `grace`.

    The caller has let the projection catch up with the log first (see the module's text).

    ```python
    async with ProjectionReader.from_settings(settings) as reader:
        report = await sweep_media(reader, S3MediaStore.from_settings(settings.media))
    ```
    """
    if grace <= store.refresh_after:
        raise UsageError(
            f'the grace period ({grace}) must be longer than the age at which a writer uploads a re-used '
            f'payload again ({store.refresh_after}), or a payload re-used a moment ago could be deleted'
        )
    policy, _ = await reader.retention()
    if policy is None:
        raise UsageError(
            'this projection was built without a retention policy, so it keeps every run and does not '
            'index their media: set STEPSTREAM_RETAIN_ENDED_DAYS and rebuild it (docs/retention.md)'
        )
    old = sorted(p for p, v in (await reader.media_index_versions()).items() if v < MEDIA_INDEX_VERSION)
    if old:
        raise UsageError(
            f'the shard(s) of partition(s) {old} hold a media index made before version '
            f'{MEDIA_INDEX_VERSION}, which missed offloaded images, audio and other binaries: a sweep '
            'over it would delete media that kept runs read. Rebuild the projection (`stepstream rebuild '
            '--into NEW_DIR`, then serve from NEW_DIR; docs/retention.md) and sweep that. Nothing was deleted'
        )
    report = SweepReport(dry_run=dry_run)
    marked = await reader.referenced_media()
    report.referenced = len(marked)
    cutoff = (now or datetime.now(UTC)) - grace
    candidates: list[StoredPayload] = []
    async for payload in store.payloads():
        report.listed += 1
        if payload.digest in marked:
            continue
        if payload.last_modified >= cutoff:
            report.young += 1
            continue
        candidates.append(payload)
    if candidates:
        read = await reader.media_read()
        for payload in candidates:
            if MEDIA_URI_SCHEME + payload.digest in read:
                report.guarded.append(payload)
                continue
            if not dry_run:
                await store.delete(MEDIA_URI_SCHEME + payload.digest)
            report.deleted.append(payload)
    if report.guarded:
        log.warning(
            'the media sweep kept %d payload(s) that kept runs read but the media index does not list: '
            'the index is incomplete; rebuild the projection',
            len(report.guarded),
        )
    return report
