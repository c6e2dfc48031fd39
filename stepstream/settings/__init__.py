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

from stepstream.settings._kafka import SASL_MECHANISMS, SECURITY_PROTOCOLS, KafkaSettings, RegistrySettings
from stepstream.settings._names import ENV_PREFIX, FILE_SUFFIX
from stepstream.settings._sections import (
    LivenessSettings,
    MediaSettings,
    ProjectionSettings,
    SecuritySettings,
    ServeSettings,
    TopicSettings,
)
from stepstream.settings._settings import SECRET_FIELDS, SECTION_OF, SECTIONS, SETTING_NAMES, Settings

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
]
