"""The id rules every side shares: what an id in a log record may be.

The producer applies them before it appends (a `ValueError` at the source) and the projector
applies the same ones to everything it reads (a record that breaks them goes to the DLQ), so a
writer that follows them never has a record refused.

Two rules:

- Run ids (`run_id`, `parent_run_id`) end up in Kafka keys, media paths and file names: 1 to 200
  characters from `[A-Za-z0-9_.-]`, and no `..`. `to_run_id` maps any text to such an id,
  deterministically, for ids derived from text the caller does not control (a context run id).
- Every other id (`writer_id`, `tool_call_id`, `conversation_id`, `agent_name`, `tool_name`) may
  hold any text, because the projection's keys encode each component injectively
  (`stepstream.storage._keys`); it only has to be UTF-8 encodable and at most
  `MAX_ID_BYTES` long, so that no record can make a key of unbounded size.

And one way to show a long id where room is short: `short_id` (its start and its tail), used by the
CLI's tables and the explorer alike.
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any

_RUN_ID = re.compile(r'[A-Za-z0-9_.-]{1,200}')
_UNSAFE = re.compile(r'[^A-Za-z0-9_.-]')
MAX_RUN_ID = 200
_HASH_CHARS = 12

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


def is_run_id(value: str) -> bool:
    """Whether `check_run_id` takes `value`, without raising (cached: a run's ids recur)."""
    return len(value) <= MAX_RUN_ID and _passes_run_id_rule(value)


@functools.lru_cache(maxsize=1 << 14)
def _passes_run_id_rule(value: str) -> bool:
    try:
        check_run_id(value)
    except ValueError:
        return False
    return True


def is_plain_id(value: object) -> bool:
    """The common case of the second rule, decided without encoding: None or short ASCII text.

    False only means "not decided here": `check_id` has the last word.
    """
    return value is None or (type(value) is str and len(value) <= MAX_ID_BYTES and value.isascii())


def check_id(value: object, *, what: str) -> str:
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
    run_id, parent = record.run_id, record.parent_run_id
    # `is_run_id` and `is_plain_id`, inline: this runs for every record on both sides.
    if type(run_id) is not str or len(run_id) > MAX_RUN_ID or not _passes_run_id_rule(run_id):
        check_run_id(run_id)  # cached above: a run's ids recur on each record
    if parent is not None and (
        type(parent) is not str or len(parent) > MAX_RUN_ID or not _passes_run_id_rule(parent)
    ):
        check_run_id(parent, what='parent_run_id')
    for name in OTHER_ID_FIELDS:
        value = getattr(record, name, None)
        if value is not None and (type(value) is not str or len(value) > MAX_ID_BYTES or not value.isascii()):
            check_id(value, what=name)  # the common case is decided above


def to_run_id(text: str) -> str:
    """Map any text to a run id, deterministically: the same text always gives the same id.

    A text that already passes `check_run_id` is returned as it is. Otherwise every character
    outside `[A-Za-z0-9_.-]` becomes `_`, each `..` becomes `._`, the result is cut to leave room, and
    a `-` and the first 12 hex digits of the SHA-256 of the original text are
    appended, so two texts that read alike after the mapping still get different ids.

    ```python
    to_run_id('librarian-0195f3a2')        # 'librarian-0195f3a2' (already safe)
    to_run_id('tenant/caller-chosen')      # 'tenant_caller-chosen-<12 hex>'
    to_run_id('wf-7:1')                    # 'wf-7_1-<12 hex>' (a DBOS run id)
    ```
    """
    if _RUN_ID.fullmatch(text) and '..' not in text:
        return text
    digest = hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[:_HASH_CHARS]
    readable = _UNSAFE.sub('_', text)
    while '..' in readable:
        readable = readable.replace('..', '._')
    readable = readable[: MAX_RUN_ID - _HASH_CHARS - 1].rstrip('.')
    return check_run_id(f'{readable}-{digest}' if readable else digest)


SHORT_ID_WIDTH = 22
"""The most characters `short_id` shows of an id: a table's or a link's column."""
_SHORT_TAIL = 6


def short_id(value: str) -> str:
    """An id as a table or a link shows it: whole up to `SHORT_ID_WIDTH` characters, else its start and tail.

    Ids of one agent share their start (`{agent_name}-{ctx.run_id}`, a time-ordered UUIDv7): what
    tells them apart is at the end. So a long id keeps its first characters (the agent, the time)
    and its last six, with `…` between: `orchestrator-01…89abef`. The same id always reads the same
    (the CLI's tables and the explorer use this one function), two ids that differ in their last
    six characters or in their first fifteen read differently, and `--wide` or the explorer's
    tooltip shows the whole.

    ```python
    short_id('librarian-7')                                            # 'librarian-7' (short: as it is)
    short_id('orchestrator-019ae8c2-5b1e-7c3d-9f40-0a1b2c89abef')      # 'orchestrator-01…89abef'
    ```
    """
    if len(value) <= SHORT_ID_WIDTH:
        return value
    return f'{value[: SHORT_ID_WIDTH - _SHORT_TAIL - 1]}…{value[-_SHORT_TAIL:]}'
