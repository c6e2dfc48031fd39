"""An export's mark and its place: what a later `--since` export must not write again, and where.

The mark (`ExportMark`) is stored in the manifest beside the tables (`MANIFEST`); `read_mark` reads
it back and `_check_mark` refuses one from another log. `_digest` and `_exported` are what it
records of a run and how it is compared. The place is a local directory or an `s3://` prefix
(`export_filesystem`); an export appending to its mark's own place first removes what a failed
export left there (`_remove_strays`). `_export.py` writes the tables and the manifest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepstream.analytics._tables import ROWS
from stepstream.errors import UsageError
from stepstream.schemas import RunRecord
from stepstream.settings import Settings

if TYPE_CHECKING:
    import pyarrow.fs as pafs

TABLES = tuple(ROWS)
"""The tables an export writes, each a directory under the target (their rows: `_tables.py`)."""

MANIFEST = '_stepstream_export.json'
"""The file beside the tables that says what an export wrote, and its mark for a later `--since`."""

MARK_VERSION = 1
"""The layout of the mark in the manifest; a mark of another version is refused."""


@dataclass
class ExportMark:
    """An export's high-water mark: what a later export `since` it must not write again.

    `runs` maps a run_id to `[last_seq, digest, gaps]`: the events of that run with seq at most
    `last_seq` and outside `gaps` were exported, and `digest` is the hash of the run's state rows
    (its `runs` row, gaps, `tool_effects` and `resolutions` rows) as exported. `offsets` are the
    projection's applied offsets (`topic:partition` -> next offset) read before any row: a mark
    ahead of a projection is from another log.
    """

    export_id: str
    export_seq: int
    topic_prefix: str | None
    offsets: dict[str, int]
    runs: dict[str, list[Any]]
    exports: list[str]
    """The export ids whose files are in the mark's directory (a chain appended into one place): files
    of any other id there are what a failed export left, and the next export into it removes them."""
    location: str = ''
    """Where the mark was read from (the export's directory or `s3://` prefix)."""

    def to_json(self) -> dict[str, Any]:
        """The mark as it is stored in the manifest."""
        return {
            'version': MARK_VERSION,
            'export_id': self.export_id,
            'export_seq': self.export_seq,
            'topic_prefix': self.topic_prefix,
            'offsets': self.offsets,
            'runs': self.runs,
            'exports': self.exports,
        }


def export_filesystem(out: str, settings: Settings) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and base path of `out`: a local directory, or `s3://bucket/prefix`.

    S3 uses the settings' endpoint, region and credentials (the media store's), path-style, over
    http or https as the endpoint says.
    """
    import pyarrow.fs as pafs

    if not out.startswith('s3://'):
        return pafs.LocalFileSystem(), out
    endpoint = settings.media.s3_endpoint
    scheme = 'https'
    if endpoint is not None and '://' in endpoint:
        scheme, endpoint = endpoint.split('://', 1)
    s3 = pafs.S3FileSystem(
        access_key=settings.media.s3_access_key_id,
        secret_key=(
            settings.media.s3_secret_access_key.get_secret_value()
            if settings.media.s3_secret_access_key
            else None
        ),
        region=settings.media.s3_region,
        endpoint_override=endpoint,
        scheme=scheme,
        force_virtual_addressing=False,
    )
    return s3, out.removeprefix('s3://').rstrip('/')


def _same_place(a: str, b: str) -> bool:
    if a.startswith('s3://') or b.startswith('s3://'):
        return a.rstrip('/') == b.rstrip('/')
    return Path(a).resolve() == Path(b).resolve()


def read_mark(since: str, settings: Settings) -> ExportMark:
    """The mark of an earlier export: `since` is its directory (or `s3://` prefix) or its manifest.

    Raises `UsageError` (exit code 2) when there is no manifest there, or it holds no mark this
    version of stepstream wrote (an export made before incremental exports, or not an export).
    """
    import pyarrow.fs as pafs

    location = since.rstrip('/')
    if location.endswith('.json'):
        location = location.rsplit('/', 1)[0] if '/' in location else '.'
    fs, base = export_filesystem(location, settings)
    path = f'{base}/{MANIFEST}'
    try:
        if fs.get_file_info(path).type != pafs.FileType.File:
            raise UsageError(f'--since {since}: no {MANIFEST} at {location} (not an export)')
        with fs.open_input_stream(path) as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise UsageError(f'--since {since}: cannot read {MANIFEST} at {location}: {exc}') from exc
    mark = manifest.get('mark') if isinstance(manifest, dict) else None
    if not isinstance(mark, dict) or mark.get('version') != MARK_VERSION:
        raise UsageError(
            f'--since {since}: {MANIFEST} at {location} holds no export mark of version {MARK_VERSION} '
            '(an export made before incremental exports, or not an export): make a full export first'
        )
    try:
        return ExportMark(
            export_id=str(mark['export_id']),
            export_seq=int(mark['export_seq']),
            topic_prefix=mark['topic_prefix'],
            offsets={str(k): int(v) for k, v in mark['offsets'].items()},
            runs={str(k): list(v) for k, v in mark['runs'].items()},
            exports=[str(e) for e in mark['exports']],
            location=location,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(
            f'--since {since}: the mark in {MANIFEST} at {location} is malformed: {exc!r}'
        ) from exc


def _check_mark(mark: ExportMark, topic_prefix: str | None, offsets: dict[str, int]) -> None:
    """Refuse a mark from another log: another topic prefix, or offsets this projection has not reached."""
    if mark.topic_prefix != topic_prefix:
        raise UsageError(
            f'--since {mark.location}: that export is of topic prefix {mark.topic_prefix!r}, '
            f'this projection of {topic_prefix!r}: a mark from another log'
        )
    ahead = sorted(tp for tp, offset in mark.offsets.items() if offset > offsets.get(tp, 0))
    if ahead:
        raise UsageError(
            f'--since {mark.location}: that export had applied more of {", ".join(ahead)} than this '
            'projection has: a mark from another log, or a projection behind it (let it catch up, '
            'or make a full export)'
        )


def _remove_strays(fs: pafs.FileSystem, base: str, exports: set[str]) -> None:
    """Delete the table files under `base` that no export in `exports` wrote (a failed export's)."""
    import pyarrow.fs as pafs

    for table in TABLES:
        selector = pafs.FileSelector(f'{base}/{table}', allow_not_found=True, recursive=True)
        for info in fs.get_file_info(selector):
            name = info.base_name
            if (
                info.type == pafs.FileType.File
                and name.startswith('part-')
                and name.split('-')[1] not in exports
            ):
                fs.delete_file(info.path)


def _digest(
    run: RunRecord,
    run_row: dict[str, Any],
    effect_rows: list[dict[str, Any]],
    resolution_rows: list[dict[str, Any]],
) -> str:
    """The hash of a run's state rows: a later export rewrites the run's state only when it differs.

    A run with no resolution hashes as before the `resolutions` table (its mark still holds).
    """
    state: list[Any] = [run_row, run.gaps, effect_rows]
    if resolution_rows:
        state.append(resolution_rows)
    content = json.dumps(state, sort_keys=True, default=str)
    return hashlib.sha256(content.encode()).hexdigest()[:32]


def _exported(seq: int, last_seq: int, gaps: Sequence[Sequence[int]]) -> bool:
    """Whether a mark of `last_seq` and `gaps` covers the event `seq`."""
    return seq <= last_seq and not any(low <= seq <= high for low, high in gaps)
