"""What a console view is asked, the same whether the CLI parsed it or `serve` received it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

VIEW_HEADER = 'X-Stepstream-View'
"""The read service names the view on each `/api/console` answer: a 404 without it is a service
without that route (an older one), not a run it does not hold."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ViewArgs:
    """A view's arguments; a view reads those it takes and ignores the rest (all default to unset)."""

    run_id: str | None = None
    conversation_id: str | None = None
    parent_run_id: str | None = None
    status: str | None = None
    agent_name: str | None = None
    chain: str | None = None
    include_interrupted: bool = False
    json: bool = False
    limit: int | None = None
    """A list's page size (`runs`: 50 when not given)."""
    after: str | None = None
    """A list's cursor: the page after this run, in the list's order (`deferred`: after this call's
    `cursor`, the API's `next_after`)."""
    oldest_first: bool = False
    """A list in the order its runs started (default: newest first)."""
    deferral: str | None = None
    """`deferred`: only calls waiting for this (`approval`, `question`, `external`)."""
    newest_first: bool = False
    """`deferred`: the calls that started waiting last first (default: the longest waiting first)."""
    archived: str | None = None
    """`conversations`: `true` only the archived ones, `false` only the others (default: every one)."""
    search: str | None = None
    """`conversations`: only those whose title or a run's user prompts hold every word (by id)."""
    wide: bool = False
    """A table with every column, each id and time in full (default: it fits 120 columns)."""

    @classmethod
    def of(cls, namespace: Any) -> ViewArgs:
        """The arguments an `argparse.Namespace` (or any object) has of these names."""
        defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(cls)}
        return cls(**{name: getattr(namespace, name, default) for name, default in defaults.items()})

    def query(self) -> dict[str, str]:
        """The arguments that are set, as URL query parameters (`true` for a flag)."""
        query = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value is not False:
                query[f.name] = 'true' if value is True else str(value)
        return query

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> ViewArgs:
        """Read `query` back; `ValueError` for a name that is no argument or a flag that is not `true`."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, raw in query.items():
            if name not in fields:
                raise ValueError(f'{name!r} is not an argument of a console view ({", ".join(fields)})')
            if fields[name].default is False:
                if raw not in ('true', 'false'):
                    raise ValueError(f'{name} is a flag: true or false, got {raw!r}')
                values[name] = raw == 'true'
            elif fields[name].type == 'int | None':
                values[name] = _count(name, raw)
            else:
                values[name] = raw
        return cls(**values)


def _count(name: str, raw: str) -> int:
    """A positive whole number from a query, or `ValueError` naming the argument."""
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f'{name} is a whole number, got {raw!r}') from None
    if value < 1:
        raise ValueError(f'{name} must be at least 1, got {value}')
    return value
