"""One settings object for producer, projector, media and CLI.

Every field maps to one environment variable (`STEPSTREAM_<FIELD>`) and one CLI flag
(`--<field-with-dashes>`), so a process, a child process and a shell command agree on where
the log and the media live.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

ENV_PREFIX = 'STEPSTREAM_'


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
    s3_region: str = 'us-east-1'
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = field(default=None, repr=False)
    media_threshold_bytes: int = 64 * 1024
    """Payloads at or above this size (UTF-8 bytes for text) are moved to the media store."""
    db_path: str = '.stepstream/projection'
    """Directory of the projector's RocksDB."""
    partitions: int = 6
    """Partition count used when stepstream creates its topics (the same for both topics)."""
    replication_factor: int = 1
    ack_timeout_s: float = 10.0
    """How long a durability point waits for the broker's acknowledgement before the run fails."""

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
            if raw is not None and raw != '':
                values[f.name] = _parse(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The `STEPSTREAM_*` variables that `from_env` turns back into these settings."""
        return {
            ENV_PREFIX + f.name.upper(): str(getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) is not None
        }

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one `--flag` per field; unset flags fall back to the environment."""
        group = parser.add_argument_group('settings (flags override STEPSTREAM_* variables)')
        for f in fields(cls):
            group.add_argument(
                '--' + f.name.replace('_', '-'),
                dest=f.name,
                default=None,
                metavar=ENV_PREFIX + f.name.upper(),
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Settings from parsed CLI flags over the environment."""
        flags = {f.name: getattr(args, f.name, None) for f in fields(cls)}
        parsed = {name: _parse(_field(name), raw) for name, raw in flags.items() if raw is not None}
        return cls.from_env(**parsed)


_TOPIC_CHARS = frozenset('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-')


def _field(name: str) -> dataclasses.Field[Any]:
    return next(f for f in fields(Settings) if f.name == name)


def _parse(f: dataclasses.Field[Any], raw: str) -> Any:
    kind = str(f.type)
    try:
        if kind.startswith('int'):
            return int(raw)
        if kind.startswith('float'):
            return float(raw)
    except ValueError:
        raise ValueError(f'{ENV_PREFIX}{f.name.upper()}={raw!r} is not a valid {kind.split()[0]}') from None
    return raw
