"""The analytics export: the projection as Parquet tables for DuckDB, Polars or Spark (docs/analytics.md).

A role of its own beside `serve/`: it reads the projection through `ProjectionReader`, as the API does,
and needs the `export` extra (pyarrow).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.analytics._export import ExportReport, export_parquet
    from stepstream.analytics._mark import ExportMark, export_filesystem, read_mark

_WHERE = {
    'ExportMark': 'stepstream.analytics._mark',
    'ExportReport': 'stepstream.analytics._export',
    'export_filesystem': 'stepstream.analytics._mark',
    'export_parquet': 'stepstream.analytics._export',
    'read_mark': 'stepstream.analytics._mark',
}
"""Where each public name lives: imported on first use, so a command pays only for what it uses."""

__all__ = [
    'ExportMark',
    'ExportReport',
    'export_filesystem',
    'export_parquet',
    'read_mark',
]

__getattr__ = lazy_exports(__name__, _WHERE)
