"""One settings object for producer, projector, media and CLI, made of typed sections.

`Settings` is the one loader of the environment (`STEPSTREAM_<FIELD>`) and the command line
(`--<field>`); it builds one section per concern, each checking its own fields, and each part takes
the section(s) it uses (docs/decisions/0055-settings-in-sections.md):

| section | class | settings |
|---|---|---|
| `kafka` | `KafkaSettings` | `bootstrap_servers`, `ack_timeout_s`, `security_protocol`, `sasl_*`, `ssl_*` |
| `topics` | `TopicSettings` | `topic_prefix`, `partitions`, `replication_factor` |
| `registry` | `RegistrySettings` | `schema_registry_*` |
| `media` | `MediaSettings` | `s3_*`, `media_threshold_bytes` |
| `projection` | `ProjectionSettings` | `db_path`, `retain_ended_days` |
| `security` | `SecuritySettings` | `redaction*`, `erasure_key`, `signing_key` |
| `liveness` | `LivenessSettings` | `heartbeat_interval_s`, `stale_after_s` |
| `serve` | `ServeSettings` | `serve_token`, `serve_url`, `trace_url`, `operator` |
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.settings._kafka import (
        SASL_MECHANISMS,
        SECURITY_PROTOCOLS,
        KafkaSettings,
        RegistrySettings,
    )
    from stepstream.settings._names import ENV_PREFIX, FILE_SUFFIX, check_count
    from stepstream.settings._sections import (
        LivenessSettings,
        MediaSettings,
        ProjectionSettings,
        SecuritySettings,
        ServeSettings,
        TopicSettings,
    )
    from stepstream.settings._settings import SECRET_FIELDS, SECTION_OF, SECTIONS, SETTING_NAMES, Settings

_WHERE = {
    'ENV_PREFIX': 'stepstream.settings._names',
    'FILE_SUFFIX': 'stepstream.settings._names',
    'SASL_MECHANISMS': 'stepstream.settings._kafka',
    'SECRET_FIELDS': 'stepstream.settings._settings',
    'SECTIONS': 'stepstream.settings._settings',
    'SECTION_OF': 'stepstream.settings._settings',
    'SECURITY_PROTOCOLS': 'stepstream.settings._kafka',
    'SETTING_NAMES': 'stepstream.settings._settings',
    'KafkaSettings': 'stepstream.settings._kafka',
    'LivenessSettings': 'stepstream.settings._sections',
    'MediaSettings': 'stepstream.settings._sections',
    'ProjectionSettings': 'stepstream.settings._sections',
    'RegistrySettings': 'stepstream.settings._kafka',
    'SecuritySettings': 'stepstream.settings._sections',
    'ServeSettings': 'stepstream.settings._sections',
    'Settings': 'stepstream.settings._settings',
    'TopicSettings': 'stepstream.settings._sections',
    'check_count': 'stepstream.settings._names',
}
"""Where each public name lives: imported on first use, so a command pays only for what it uses."""

__all__ = [
    'ENV_PREFIX',
    'FILE_SUFFIX',
    'SASL_MECHANISMS',
    'SECRET_FIELDS',
    'SECTIONS',
    'SECTION_OF',
    'SECURITY_PROTOCOLS',
    'SETTING_NAMES',
    'KafkaSettings',
    'LivenessSettings',
    'MediaSettings',
    'ProjectionSettings',
    'RegistrySettings',
    'SecuritySettings',
    'ServeSettings',
    'Settings',
    'TopicSettings',
    'check_count',
]

__getattr__ = lazy_exports(__name__, _WHERE)
