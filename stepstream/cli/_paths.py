"""The places flags name, checked before a command does any work.

A path that is missing, or is a file where a folder is wanted (or the other way round), is a
`UsageError` (exit 2) that names the flag, the path and what to give instead, rather than a
traceback or a message about another flag. A place a command creates (`--out`, `--into`,
`audit key --new`) must be in a folder that exists: a mistyped parent is refused, not made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from stepstream.errors import UsageError
from stepstream.settings import Settings

Kind = Literal['file', 'folder', 'file or folder']


def existing(flag: str, path: str | Path, kind: Kind, fix: str) -> Path:
    """`path`, which must exist as `kind`; else `UsageError` naming `flag`, the path and `fix`."""
    place = Path(path)
    if not place.exists():
        raise UsageError(f'{flag} {path}: no such {kind}; {fix}')
    if kind == 'file' and place.is_dir():
        raise UsageError(f'{flag} {path} is a folder, not a file; {fix}')
    if kind == 'folder' and not place.is_dir():
        raise UsageError(f'{flag} {path} is a file, not a folder; {fix}')
    return place


def to_make(flag: str, path: str | Path, kind: Literal['file', 'folder'], fix: str) -> Path:
    """`path`, a place the command makes: in an existing folder, and not a file (a folder may be reused)."""
    place = Path(path)
    if not place.parent.is_dir():
        raise UsageError(
            f'{flag} {path}: the folder {place.parent} does not exist; create it first, or {fix}'
        )
    if kind == 'file' and place.exists():
        raise UsageError(f'{flag} {path} exists; it is never written over: {fix}')
    if kind == 'folder' and place.exists() and not place.is_dir():
        raise UsageError(f'{flag} {path} is a file, not a folder; {fix}')
    return place


def projection(flag: str, path: str | Path, fix: str) -> Path:
    """`path`, a folder that holds a projection (its shards); else `UsageError` naming `flag`."""
    from stepstream.storage import shard_paths

    place = existing(flag, path, 'folder', fix)
    if not shard_paths(place):
        raise UsageError(f'{flag} {path} holds no projection; {fix}')
    return place


PEM_FILES = {
    'ssl_cafile': "the PEM file of the CA(s) that signed the brokers' certificates, or unset it to use the "
    "system's CAs",
    'ssl_certfile': 'the PEM client certificate for mutual TLS',
    'ssl_keyfile': 'the PEM private key of the client certificate, or unset it when the certificate file '
    'holds it',
    'schema_registry_cafile': "the PEM file of the CA(s) that signed the schema registry's certificate",
    's3_cafile': "the PEM file of the CA(s) that signed the S3 endpoint's certificate",
}
"""The settings that name a file, and what each should be."""


def check_setting_files(settings: Settings) -> None:
    """Each file a setting names (TLS, the registry's and S3's CAs) is a file: else `UsageError`."""
    from stepstream.settings import ENV_PREFIX

    values = settings.values()
    for field, what in PEM_FILES.items():
        if values[field]:
            flag = f'--{field.replace("_", "-")} ({ENV_PREFIX}{field.upper()})'
            existing(flag, values[field], 'file', f'give {what}')


def check_projection(settings: Settings) -> None:
    """A `--db-path` given (flag or variable) that does not exist: `UsageError` naming it and the fix.

    The default path has its own message (`_common.check_default_projection`); a folder that is
    there but is no projection is the projection's own refusal, as for every reader.
    """
    where = settings.projection.db_path
    if Path(where).exists():
        return
    raise UsageError(
        f'no projection at {where} (--db-path or STEPSTREAM_DB_PATH): no such folder. Point --db-path at '
        "a projection (a running stack's: --stack-dir DIR), or make one there with "
        f'`stepstream projector --db-path {where}` or `stepstream rebuild --into {where}`'
    )
