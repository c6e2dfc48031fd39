"""Text tables, and how they fit a terminal: `WIDTH` columns unless asked `--wide` (issue 51).

A view builds its rows in full and says which of its columns a narrow table shows and which it
may cut, in the order they give way; `fit` cuts each to no less than `MIN_CUT` characters, with
`…` where it cut. Ids are shortened by `stepstream.ids.short_id`, the explorer's too, so an
id reads the same everywhere; `--wide` shows every column, every id and every time in full.
"""

from __future__ import annotations

import textwrap
from collections.abc import Collection, Sequence
from datetime import datetime

from stepstream.ids import short_id

WIDTH = 120
"""The columns a table fits by default."""
MIN_CUT = 6
"""The fewest characters `fit` leaves of a column it may cut."""


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A left-aligned text table, each cell in full (`-` for None)."""
    cells = [[str(h) for h in headers], *[[('-' if c is None else str(c)) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ['  '.join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, '  '.join('-' * w for w in widths))
    return '\n'.join(lines)


def time_text(ts: datetime | None) -> str:
    """A time as the tables show it, to the millisecond (`-` for none)."""
    return ts.strftime('%Y-%m-%d %H:%M:%S.%f')[:-3] if ts is not None else '-'


def ident(value: str | None, wide: bool) -> str | None:
    """An id as a table shows it: in full when `wide`, else `short_id`'s start and tail."""
    return value if wide or value is None else short_id(value)


def when(ts: datetime | None, wide: bool) -> str:
    """A time as a table shows it: to the millisecond when `wide`, else `MM-DD HH:MM:SS`."""
    if wide or ts is None:
        return time_text(ts)
    return ts.strftime('%m-%d %H:%M:%S')


def wrap(line: str, wide: bool) -> str:
    """A line of text under a table, folded to `WIDTH` columns (indented after the first) unless `wide`."""
    if wide or len(line) <= WIDTH:
        return line
    return textwrap.fill(line, WIDTH, subsequent_indent='    ', break_on_hyphens=False)


def fit(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    wide: bool,
    shown: Collection[str] | None = None,
    cut: Sequence[str] = (),
) -> str:
    """`table` in `WIDTH` columns: only the `shown` columns (all when None), the `cut` ones cut to fit.

    The `cut` columns give way in that order, each down to `MIN_CUT` characters before the next;
    the others are never cut (their width is the view's to keep: ids by `ident`, times by `when`).
    With `wide`, every column in full.
    """
    if wide:
        return table(headers, rows)
    keep = [i for i, header in enumerate(headers) if shown is None or header in shown]
    names = [headers[i] for i in keep]
    cells = [['-' if row[i] is None else str(row[i]) for i in keep] for row in rows]
    caps = [max(len(text) for text in [name, *(row[j] for row in cells)]) for j, name in enumerate(names)]
    over = sum(caps) + 2 * (len(caps) - 1) - WIDTH
    for name in cut:
        if over <= 0 or name not in names:
            continue
        j = names.index(name)
        given = min(over, max(caps[j] - MIN_CUT, 0))
        caps[j] -= given
        over -= given
    return table(
        [_cut(name, caps[j]) for j, name in enumerate(names)],
        [[_cut(c, caps[j]) for j, c in enumerate(row)] for row in cells],
    )


def _cut(text: str, cap: int) -> str:
    return text if len(text) <= cap else text[: cap - 1] + '…'
