"""The retention view: the policy and what it keeps, and the media the kept runs reference.

The projector's retention (stepstream.projector, docs/decisions/0032-retention.md) drops expired
runs as it applies the log; this view reads its figures, previews another policy, and gives the
media sweep its two answers: the media index (`referenced_media`) and, without the index, what
reading the kept runs fetches (`media_read`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

from stepstream.erasure import ContentErased, ErasureError
from stepstream.errors import StepStreamError
from stepstream.media import MEDIA_URI_SCHEME
from stepstream.readmodel._shards import Shards
from stepstream.readmodel._snapshots import Snapshots
from stepstream.storage import (
    RUN,
    RUN_MEDIA,
    RetentionPreview,
    RetentionState,
    referenced_media,
    retention_preview,
    retention_state,
)

if TYPE_CHECKING:
    from pydantic_ai.messages import ModelMessage


class Retention:
    """Each shard's retention figures and media index, and the kept runs' snapshots walked for media."""

    def __init__(self, shards: Shards, snapshots: Snapshots) -> None:
        self._shards = shards
        self._snapshots = snapshots

    async def retention(self) -> tuple[int | None, list[RetentionState]]:
        """`ProjectionReader.retention`."""

        def query() -> tuple[int | None, list[RetentionState]]:
            shards = self._shards.all()
            identity = next((i for i in (s.identity() for s in shards) if i is not None), None)
            policy = identity.retain_ended_us if identity is not None else None
            held = self._shards.held
            partitions = sorted(held) if self._shards.partitions is not None else [0]
            return policy, [retention_state(held[p], p, policy) for p in partitions if p in held]

        return await self._shards.query(query)

    async def retention_preview(self, retain_us: int) -> list[RetentionPreview]:
        """`ProjectionReader.retention_preview`."""

        def query() -> list[RetentionPreview]:
            self._shards.all()  # every shard, or `ShardUnavailable`
            return [retention_preview(shard, p, retain_us) for p, shard in sorted(self._shards.held.items())]

        return await self._shards.query(query)

    async def referenced_media(self) -> set[str]:
        """`ProjectionReader.referenced_media`."""
        return await self._shards.query(
            lambda: set().union(*(referenced_media(s) for s in self._shards.all()))
        )

    async def media_index_versions(self) -> dict[int, int]:
        """`ProjectionReader.media_index_versions`."""

        def query() -> dict[int, int]:
            self._shards.all()  # every shard, or `ShardUnavailable`
            versions = {}
            for partition, shard in sorted(self._shards.held.items()):
                identity = shard.identity()
                versions[partition] = identity.media_index if identity is not None else 1
            return versions

        return await self._shards.query(query)

    async def media_read(self) -> set[str]:
        """`ProjectionReader.media_read`: each kept run's tails, walked as a reader walks them."""
        from stepstream.media import media_read

        keys = self._snapshots.keys
        if keys is not None:
            await keys.refresh(thorough=True)  # a key not seen yet must not read as erased
        store = self._snapshots.store()
        run_ids = await self._shards.query(
            lambda: [RUN.last_str(k) for s in self._shards.all() for k, _ in s.scan(RUN.tag)]
        )
        read: set[str] = set()
        for run_id in run_ids:
            found = await self._shards.query(functools.partial(self._tails_or_listed, run_id))
            if isinstance(found, set):
                read |= found
                continue
            for tail in found:
                # A JSON payload sealed with a key destroyed since holds nothing to keep.
                with contextlib.suppress(ContentErased):
                    if tail is not None:
                        read |= await media_read(tail, store)
        return read

    def _tails_or_listed(self, run_id: str) -> list[list[ModelMessage] | None] | set[str]:
        """The run's snapshot tails; if they cannot be read, the media its records list."""
        try:
            return self._snapshots.tails(run_id, self._snapshots.entries(run_id))[1]
        except ErasureError:
            raise  # sealed content and no (or the wrong) key: say so, guess nothing
        except StepStreamError:
            return {
                MEDIA_URI_SCHEME + RUN_MEDIA.last_str(k)
                for k, _ in self._shards.db(run_id).scan(RUN_MEDIA.prefix(run_id))
            }
