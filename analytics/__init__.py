"""The analytics export: the projection as Parquet tables for DuckDB, Polars or Spark (docs/analytics.md).

A role of its own beside `serve/`: it reads the projection through `ProjectionReader`, as the API does,
and needs the `export` extra (pyarrow).
"""

from stepstream.analytics._export import ExportReport, export_parquet
from stepstream.analytics._mark import ExportMark, export_filesystem, read_mark

__all__ = ['ExportMark', 'ExportReport', 'export_filesystem', 'export_parquet', 'read_mark']
