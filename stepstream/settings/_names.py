"""How a user names a setting (`STEPSTREAM_<FIELD>`, `--<field>`), and the checks sections share."""

from __future__ import annotations

from typing import Any

from stepstream.secret import SecretStr

ENV_PREFIX = 'STEPSTREAM_'
FILE_SUFFIX = '_FILE'
"""`STEPSTREAM_<SECRET>_FILE` names a file that holds a secret (a mounted Kubernetes or docker secret)."""


def name(field_name: str) -> str:
    """How a user sets a field: its variable and its flag."""
    return f'{ENV_PREFIX}{field_name.upper()} (--{field_name.replace("_", "-")})'


def secret_name(field_name: str) -> str:
    """How a user sets a secret field: its variable or its `_FILE` (a secret has no flag)."""
    variable = ENV_PREFIX + field_name.upper()
    return f'{variable} (or {variable}{FILE_SUFFIX})'


def as_secret(section: object, *secrets: str) -> None:
    """Make `SecretStr` of the `secrets` fields of a frozen `section` given as strings.

    A plain string or Pydantic's `SecretStr` comes from Python code; either becomes a `SecretStr`.
    """
    for field_name in secrets:
        value: Any = getattr(section, field_name)
        if isinstance(value, str):
            object.__setattr__(section, field_name, SecretStr(value))
        elif value is not None and not isinstance(value, SecretStr):
            object.__setattr__(section, field_name, SecretStr(value.get_secret_value()))


def set_by(field_name: str) -> str:
    """What an error about a field appends: the variable and the flag that set it."""
    return f' (set by {name(field_name)})'


def positive(section: object, *field_names: str) -> None:
    """Refuse a field of `section` that is not a positive number, naming its variable and flag."""
    for field_name in field_names:
        value = getattr(section, field_name)
        if not value > 0:
            raise ValueError(f'{field_name} must be positive, got {value}{set_by(field_name)}')


def check_count(value: object, what: str, where: str = '', *, optional: bool = False) -> None:
    """Refuse a count or size bound that is not an int of at least 1, naming `what` (and `where` set it).

    A bool is refused although Python counts it an int, and so is a float even when whole: `1.5`
    snapshots per run, or `True` partitions, is a mistake to report now, not a puzzle later. With
    `optional`, None (no bound) is accepted.
    """
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        wanted = 'a positive int' + (' or None' if optional else '')
        raise ValueError(f'{what} must be {wanted}, got {value!r}{where}')


def not_negative(section: object, *field_names: str) -> None:
    """Refuse a field of `section` that is negative, naming its variable and flag."""
    for field_name in field_names:
        value = getattr(section, field_name)
        if value < 0:
            raise ValueError(f'{field_name} must not be negative, got {value}{set_by(field_name)}')


def http_url(field_name: str, url: str | None) -> None:
    """Refuse a URL setting that is not `http://` or `https://`."""
    if url is not None and not url.startswith(('http://', 'https://')):
        raise ValueError(f'{name(field_name)} must be an http:// or https:// URL, got {url!r}')
