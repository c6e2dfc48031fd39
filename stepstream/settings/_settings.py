"""`Settings`: the one loader of the environment and the command line, made of typed sections."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from stepstream.secret import SecretStr
from stepstream.settings._kafka import KafkaSettings, RegistrySettings
from stepstream.settings._names import ENV_PREFIX, FILE_SUFFIX
from stepstream.settings._sections import (
    LivenessSettings,
    MediaSettings,
    ProjectionSettings,
    SecuritySettings,
    ServeSettings,
    TopicSettings,
)
from stepstream.shapes import field_docs

SECTIONS: dict[str, type[Any]] = {
    'kafka': KafkaSettings,
    'topics': TopicSettings,
    'registry': RegistrySettings,
    'media': MediaSettings,
    'projection': ProjectionSettings,
    'security': SecuritySettings,
    'liveness': LivenessSettings,
    'serve': ServeSettings,
}
"""Each section of `Settings` by its attribute name, in the order flags and variables are listed."""

SECTION_OF: dict[str, str] = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls)}
"""The section that holds each setting (`'db_path'` -> `'projection'`): one name per value."""

SETTING_NAMES = frozenset(SECTION_OF)
"""Every setting's name: `STEPSTREAM_<NAME>`, `--<name>` and `Settings(<name>=...)`."""

SECRET_FIELDS = frozenset(
    f.name for cls in SECTIONS.values() for f in fields(cls) if str(f.type).startswith('SecretStr')
)
"""Fields read only from the environment or a file, hidden from `repr`, and never a CLI flag."""


@dataclass(frozen=True, init=False)
class Settings:
    """Where stepstream's log, media and projection live, and how hard it waits for them.

    Every setting maps to one environment variable (`STEPSTREAM_<FIELD>`) and one CLI flag
    (`--<field-with-dashes>`), so a process, a child process and a shell command agree on where
    the log and the media live. It is made of sections, each checking its own fields; a part
    takes the section it uses (`settings.kafka`, `settings.media`, ...).

    ```python
    settings = Settings.from_env()             # STEPSTREAM_* variables, defaults otherwise
    settings.media.s3_bucket                   # each setting lives in one section
    Settings(bootstrap_servers='kafka:9092', db_path='/var/lib/proj')   # flat names are routed
    child_env = {**os.environ, **settings.to_env()}
    ```
    """

    kafka: KafkaSettings
    """The brokers: bootstrap servers, TLS and SASL, and how long a client waits for them."""
    topics: TopicSettings
    """The topics' prefix (hence names), partitions and replication."""
    registry: RegistrySettings
    """The schema registry, if any."""
    media: MediaSettings
    """The media store and the size at which payloads go there."""
    projection: ProjectionSettings
    """The projector's read model: where it lives and what it keeps."""
    security: SecuritySettings
    """What writers do to content: redaction, sealing (erasure) and signing."""
    liveness: LivenessSettings
    """Heartbeats and staleness."""
    serve: ServeSettings
    """The read service and its users: token, URLs and operator."""

    def __init__(self, **values: Any) -> None:
        """Settings from sections (`kafka=KafkaSettings(...)`) and/or flat settings (`db_path=...`).

        A flat setting goes to its section (over that section, if it is given too); a name that is
        neither a section nor a setting is a `TypeError` naming it.
        """
        given: dict[str, Any] = {}
        flat: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for key, value in values.items():
            if key in SECTIONS:
                given[key] = value
            elif key in SECTION_OF:
                flat[SECTION_OF[key]][key] = value
            else:
                raise TypeError(
                    f'Settings() got an unexpected keyword argument {key!r} (a setting or a section)'
                )
        for section, cls in SECTIONS.items():
            base = given.get(section)
            if base is None:
                value = cls(**flat[section])
            elif not isinstance(base, cls):
                raise TypeError(f'Settings({section}=...) takes a {cls.__name__}, got {type(base).__name__}')
            else:
                value = dataclasses.replace(base, **flat[section]) if flat[section] else base
            object.__setattr__(self, section, value)

    def replace(self, **changes: Any) -> Settings:
        """A copy with some settings (flat names: `db_path=...`) or whole sections changed."""
        return Settings(**{section: getattr(self, section) for section in SECTIONS}, **changes)

    def values(self) -> dict[str, Any]:
        """Every setting by its flat name (secrets as `SecretStr`)."""
        return {f.name: getattr(getattr(self, section), f.name) for section, f in _fields()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from `STEPSTREAM_*` variables (defaults for the rest), then `overrides`."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for _, f in _fields():
            raw = env.get(ENV_PREFIX + f.name.upper())
            if f.name in SECRET_FIELDS:
                raw = _secret(f.name, raw, env.get(ENV_PREFIX + f.name.upper() + FILE_SUFFIX))
            if raw is not None and raw != '':
                values[f.name] = _parse(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The `STEPSTREAM_*` variables that `from_env` turns back into these settings."""
        env: dict[str, str] = {}
        for key, value in self.values().items():
            if isinstance(value, SecretStr):
                value = value.get_secret_value()  # a child process needs the secret itself
            if value is not None:
                env[ENV_PREFIX + key.upper()] = str(value)
        return env

    @classmethod
    def add_arguments(
        cls,
        parser: argparse.ArgumentParser,
        *,
        documented: bool = True,
        title: str = 'settings (flags override STEPSTREAM_* variables)',
    ) -> None:
        """Add one `--flag` per setting but secrets, in a group of their own (`title`).

        Unset flags fall back to the environment. Secrets (`sasl_password`) have no flag: a command
        line shows in `ps` and shell history. Each flag's help is its field's docstring
        (`documented=False`: none, for a parser that will not print help and should not pay for
        reading the docstrings).
        """
        group = parser.add_argument_group(title)
        docs: dict[str, str] = {}
        if documented:
            for section_cls in SECTIONS.values():
                docs.update({k: v.replace('%', '%%') for k, v in field_docs(section_cls).items()})
        for _, f in _fields():
            if f.name in SECRET_FIELDS:
                continue
            group.add_argument(
                '--' + f.name.replace('_', '-'),
                dest=f.name,
                default=None,
                metavar=ENV_PREFIX + f.name.upper(),
                help=docs.get(f.name),
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from parsed CLI flags over `environ` (default: the process environment)."""
        flags = {
            f.name: (f, getattr(args, f.name, None)) for _, f in _fields() if f.name not in SECRET_FIELDS
        }
        parsed = {name: _parse(f, raw) for name, (f, raw) in flags.items() if raw is not None}
        return cls.from_env(environ, **parsed)


def _fields() -> list[tuple[str, dataclasses.Field[Any]]]:
    """Every setting's field, with its section's name, in order."""
    return [(section, f) for section, cls in SECTIONS.items() for f in fields(cls)]


def _secret(name: str, raw: str | None, file: str | None) -> str | None:
    """A secret from its variable or from the file its `_FILE` variable names (not both)."""
    variable = ENV_PREFIX + name.upper()
    if not file:
        return raw
    if raw:
        raise ValueError(f'set {variable} or {variable}{FILE_SUFFIX}, not both')
    try:
        return Path(file).read_text().rstrip('\r\n')
    except OSError as exc:
        raise ValueError(f'{variable}{FILE_SUFFIX}={file!r} cannot be read: {exc.strerror}') from None


def _parse(f: dataclasses.Field[Any], raw: str) -> Any:
    kind = str(f.type)
    if kind.startswith('SecretStr'):
        return SecretStr(raw)
    try:
        if kind.startswith('int'):
            return int(raw)
        if kind.startswith('float'):
            return float(raw)
    except ValueError:
        raise ValueError(f'{ENV_PREFIX}{f.name.upper()}={raw!r} is not a valid {kind.split()[0]}') from None
    return raw
