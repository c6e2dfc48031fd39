"""A `StepPersistence`'s options: checked when it is made, read from a spec, and the media store they choose.

The capability (`_capability.py`) keeps its fields and hooks; what its options mean lives here:
the checks `__post_init__` makes, the split of a serialisable spec (`from_spec`) into capability
options and `Settings`, and the media store a capability uses when it is given none: the S3
bucket of its log's settings, which its `EventLog` checks as it starts (`check_media_store`,
`EventLog.check_at_start`), so that a wrong bucket or key is found before a run, not at its
first large payload minutes later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from stepstream.errors import MediaUnavailable
from stepstream.ids import check_run_id
from stepstream.media import S3MediaStore
from stepstream.producer._log import EventLog
from stepstream.producer._protocol import StepLog
from stepstream.settings import SETTING_NAMES, MediaSettings, Settings

logger = logging.getLogger('stepstream.producer')

SPEC_OPTIONS = frozenset({'agent_name', 'run_id', 'parent_run_id', 'metadata', 'capture_frontier'})
"""The capability options a spec may set (`StepPersistence.from_spec`); every other key is a setting."""


def check_options(
    log: object, run_id: str | None, parent_run_id: str | None, threshold: object, *, default_media: bool
) -> None:
    """Refuse a capability's options now: its ids, its log and its media threshold.

    With `default_media` (no `media_store` given), an `EventLog` checks its settings' bucket as it starts.
    """
    if run_id is not None:
        check_run_id(run_id)
    if parent_run_id is not None:
        check_run_id(parent_run_id, what='parent_run_id')
    if not isinstance(log, StepLog):
        raise TypeError(
            f'StepPersistence(log=...) needs an EventLog (or another StepLog), got {type(log).__name__}'
        )
    limit = getattr(log, 'max_record_bytes', None)
    MediaSettings.check_threshold(threshold, 'media_threshold_bytes')
    assert isinstance(threshold, int)
    if limit is not None and threshold >= limit:
        raise ValueError(
            f'media_threshold_bytes ({threshold}) must stay below the record limit ({limit}): '
            'payloads under the threshold stay inline in records'
        )
    if default_media and isinstance(log, EventLog):
        log.check_at_start(check_media_store)


def split_spec(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Settings, dict[str, Any]]:
    """A spec's `Settings` (unset fields from `STEPSTREAM_*`) and its capability options.

    Anything that is neither a capability option nor a `Settings` field is rejected rather than
    guessed at.
    """
    if args:
        raise TypeError('StepPersistence.from_spec takes keyword options only')
    setting_names = SETTING_NAMES
    unknown = sorted(set(kwargs) - SPEC_OPTIONS - setting_names)
    if unknown:
        raise ValueError(
            f'unknown StepPersistence spec option(s) {unknown}; expected capability options '
            f'{sorted(SPEC_OPTIONS)} or settings {sorted(setting_names)}'
        )
    settings = Settings.from_env(**{k: v for k, v in kwargs.items() if k in setting_names})
    return settings, {k: v for k, v in kwargs.items() if k in SPEC_OPTIONS}


async def check_media_store(settings: Settings) -> None:
    """Find a wrong bucket or key now, not at the first large payload minutes into a run.

    A capability without a `media_store` of its own asks its `EventLog` for it
    (`EventLog.check_at_start`, `check_options`): the bucket checked is the one these settings name, which
    `StepPersistence` uses unless it is given a `media_store` of its own. Settings that name S3 (an
    endpoint, a key or a bucket of their own) must work: the start fails. Default settings on a
    machine without S3 only get a warning, since a run without payloads above the threshold never
    needs the store.
    """
    s, defaults = settings.media, MediaSettings()
    configured = (
        s.s3_endpoint is not None or s.s3_access_key_id is not None or s.s3_bucket != defaults.s3_bucket
    )
    try:
        await S3MediaStore.from_settings(s).check()
    except MediaUnavailable as exc:
        if configured:
            raise
        logger.warning(
            'payloads of %d bytes or more will fail until S3 is set up: %s', s.media_threshold_bytes, exc
        )


@dataclass
class DefaultMedia:
    """The media store of a capability given none: the S3 bucket of its log's settings, made once."""

    made: S3MediaStore | None = None

    def store(self, settings: Settings) -> S3MediaStore:
        """The settings' S3 store, made at the first use (never in workflow code under an engine)."""
        if self.made is None:
            self.made = S3MediaStore.from_settings(settings.media)
        return self.made
