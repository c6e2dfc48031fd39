"""`DiskMediaStore`: media as files in a local directory, for development and single machines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import ParamSpec, TypeVar

from stepstream.errors import MediaUnavailable
from stepstream.media._types import (
    NO_CONTEXT,
    KeyStrategy,
    MediaContext,
    MediaNotFound,
    PublicUrlResolver,
    default_key_strategy,
    media_uri_off_loop,
    parse_media_uri,
    verified,
)

__all__ = ['DiskMediaStore']

_P = ParamSpec('_P')
_T = TypeVar('_T')

SIDECAR_SUFFIX = '.meta.json'


class DiskMediaStore:
    """Media as files under `directory`, one file per distinct payload plus a metadata sidecar.

    Files live at `directory/key_strategy(uri, ctx)`, by default `<sha256>.bin`, with the
    `MediaContext` of the first put in `<file>.meta.json` next to it. Both are written to a temp
    file, fsynced and renamed into place, so a crash never leaves a half-written payload under its
    final name, and a payload a record refers to has reached the disk. A key strategy that returns
    an absolute path, a `..` segment, or nothing but the directory itself (`''`, `'.'`) is rejected
    with `ValueError`, and so is a key whose file, once symlinks are resolved, lies outside the
    directory: a strategy (or a URI read from a record) can never make the store read or write
    outside its directory.

    File I/O runs in worker threads (`asyncio.to_thread`), never on the event loop.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        key_strategy: KeyStrategy | None = None,
        *,
        public_url: PublicUrlResolver | None = None,
    ) -> None:
        self.directory = Path(directory).absolute()
        self._key_strategy = key_strategy or default_key_strategy
        self._public_url = public_url

    def __repr__(self) -> str:
        return f'DiskMediaStore({str(self.directory)!r})'

    @property
    def location(self) -> str:
        """Where the files live, as error messages name it."""
        return f'media directory {self.directory}'

    def key_for(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> str:
        """The relative path of `uri` in the directory, checked not to escape it."""
        parse_media_uri(uri)
        key = self._key_strategy(uri, ctx)
        posix = PurePosixPath(key.replace('\\', '/'))
        if (
            not posix.parts  # '', '.', './.': the directory itself
            or posix.is_absolute()
            or PureWindowsPath(key).anchor
            or '..' in posix.parts
            or key.endswith(SIDECAR_SUFFIX)
        ):
            raise ValueError(
                f'key_strategy returned {key!r} for {uri}: a disk store key must be a relative path '
                f'inside the directory, without ".." segments and not ending in {SIDECAR_SUFFIX!r}'
            )
        return posix.as_posix()

    def path_for(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> Path:
        """The file that holds `uri`, checked (symlinks resolved) to lie inside the directory."""
        key = self.key_for(uri, ctx)
        path = self.directory / key
        root = self.directory.resolve()
        final = path.resolve()
        if final == root or not final.is_relative_to(root):
            raise ValueError(
                f'key_strategy returned {key!r} for {uri}, which resolves to {final}: a disk store key must '
                f'be a relative path inside the directory {root} (a symlink on the way leads out of it)'
            )
        return path

    async def put(self, data: bytes, ctx: MediaContext = NO_CONTEXT) -> str:
        """Write `data` unless a file of the same size is already at its key; return its URI."""
        uri = await media_uri_off_loop(data)
        path = self.path_for(uri, ctx)
        await self._io('store', uri, _write_payload, path, data, ctx)
        return uri

    async def get(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bytes:
        """The bytes of `uri`, verified against its SHA-256 (`MediaIntegrityError` otherwise)."""
        path = self.path_for(uri, ctx)
        try:
            data = await self._io('read', uri, path.read_bytes)
        except FileNotFoundError as exc:
            raise MediaNotFound(uri, self.location) from exc
        return await verified(uri, data, self.location)

    async def exists(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> bool:
        """Whether the file of `uri` exists."""
        path = self.path_for(uri, ctx)
        return await self._io('look up', uri, path.is_file)

    async def public_url(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> str | None:
        """The resolver's URL for `uri`, or None without a `public_url=` resolver."""
        key = self.key_for(uri, ctx)
        return None if self._public_url is None else await self._public_url(uri, ctx, key)

    async def get_metadata(self, uri: str, ctx: MediaContext = NO_CONTEXT) -> MediaContext:
        """The `MediaContext` the payload was first stored with (empty if it had no sidecar)."""
        path = self.path_for(uri, ctx)
        try:
            return await self._io('read the metadata of', uri, _read_metadata, path)
        except FileNotFoundError as exc:
            raise MediaNotFound(uri, self.location) from exc

    async def _io(
        self, action: str, uri: str, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
    ) -> _T:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise MediaUnavailable(
                f'could not {action} media {uri} in {self.location}: {exc}. Check that the directory '
                'exists, is writable by this process and has free space.'
            ) from exc


def _write_payload(path: Path, data: bytes, ctx: MediaContext) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_size == len(data):
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    sidecar = {'media_type': ctx.media_type, 'filename': ctx.filename, 'metadata': dict(ctx.metadata)}
    # The sidecar first: a payload file that exists always has its metadata next to it.
    _write_atomically(path.with_name(path.name + SIDECAR_SUFFIX), json.dumps(sidecar).encode())
    _write_atomically(path, data)


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f'.{path.name}.', suffix='.tmp')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows, where directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_metadata(path: Path) -> MediaContext:
    if not path.is_file():
        raise FileNotFoundError(path)
    try:
        raw = json.loads(path.with_name(path.name + SIDECAR_SUFFIX).read_bytes())
    except FileNotFoundError:
        return NO_CONTEXT
    return MediaContext(
        media_type=raw.get('media_type'), filename=raw.get('filename'), metadata=raw.get('metadata') or {}
    )
