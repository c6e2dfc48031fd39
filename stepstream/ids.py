"""The id rules every side shares: what an id in a log record may be.

The producer applies them before it appends (a `ValueError` at the source) and the projector
applies the same ones to everything it reads (a record that breaks them goes to the DLQ), so a
writer that follows them never has a record refused.

Two rules:

- Run ids (`run_id`, `parent_run_id`) end up in Kafka keys, media paths and file names: 1 to 200
  characters from `[A-Za-z0-9_.-]`, and no `..`.
- Every other id (`writer_id`, `tool_call_id`, `conversation_id`, `agent_name`, `tool_name`) may
  hold any text, because the projection's keys encode each component injectively
  (`stepstream.projector._keys`); it only has to be UTF-8 encodable and at most
  `MAX_ID_BYTES` long, so that no record can make a key of unbounded size.
"""

from __future__ import annotations

import re
from typing import Any

_RUN_ID = re.compile(r'[A-Za-z0-9_.-]{1,200}')

MAX_ID_BYTES = 1024
"""The longest id (in UTF-8 bytes) other than a run id."""

RUN_ID_FIELDS = ('run_id', 'parent_run_id')
OTHER_ID_FIELDS = ('writer_id', 'conversation_id', 'agent_name', 'tool_call_id', 'tool_name')


def check_run_id(run_id: str, *, what: str = 'run_id') -> str:
    """Return `run_id` if it is safe as a Kafka key, a RocksDB key and a path segment.

    ```python
    check_run_id('librarian-1a2b3c4d')   # returned as it is
    check_run_id('tenant/chosen')        # ValueError
    ```
    """
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id) or '..' in run_id:
        raise ValueError(
            f'{what} {run_id!r:.300} is not allowed: use 1 to 200 characters from [A-Za-z0-9_.-] '
            'and no ".." (ids end up in keys and paths)'
        )
    return run_id


def check_id(value: str, *, what: str) -> str:
    """Return `value` if it is usable as an id other than a run id (see the module docstring)."""
    if not isinstance(value, str):
        raise ValueError(f'{what} must be a string, got {type(value).__name__}')
    if len(value) <= MAX_ID_BYTES and value.isascii():  # the common case, without encoding
        return value
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        raise ValueError(f'{what} {value!r:.300} is not valid Unicode text (lone surrogate)') from None
    if size > MAX_ID_BYTES:
        raise ValueError(f'{what} is {size} bytes long; ids are at most {MAX_ID_BYTES} bytes')
    return value


def check_record_ids(record: Any) -> None:
    """Apply both rules to every id a log record carries (`None` is allowed where optional)."""
    check_run_id(record.run_id)
    if record.parent_run_id is not None:
        check_run_id(record.parent_run_id, what='parent_run_id')
    for name in OTHER_ID_FIELDS:
        value = getattr(record, name, None)
        # The common case inline (this runs for every record on both sides); the rest in check_id.
        if value is not None and not (type(value) is str and len(value) <= MAX_ID_BYTES and value.isascii()):
            check_id(value, what=name)
