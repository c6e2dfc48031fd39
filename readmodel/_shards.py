"""The shards a reader reads: a run routed to its shard, lists merged, writers caught up with.

Every view of the read model (`_runs.py`, `_snapshots.py`, ...) reads through one `Shards`: a
run's own reads go to the shard the producer's partitioner puts it in, lists merge the shards
in key order, and a read that needs a shard this process cannot see raises `ShardUnavailable`
naming the partition, never a partial answer. Over another process's projection (`open_under`)
the shards are RocksDB secondary instances, caught up with their writers before every query.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import tempfile
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from stepstream.errors import StepStreamError
from stepstream.storage import MemoryShard, Shard, shard_paths
from stepstream.timestamps import from_micros
from stepstream.topics import murmur2_partition

T = TypeVar('T')
ReadableShard = Shard | MemoryShard
"""A shard a reader can read: on disk (its writer's own, or a read-only secondary), or in memory."""


class ShardUnavailable(StepStreamError):
    """A read needs a shard this reader cannot see (moving to another member, or on another host)."""


def ts(value: int | None) -> datetime | None:
    """A stored time (microseconds), or None."""
    return None if value is None else from_micros(value)


Record = TypeVar('Record')

_CARRIED: dict[tuple[type, type], tuple[tuple[str, Callable[[Any], Any]], ...]] = {}


def carry(state: object, record: type[Record], **given: Any) -> Record:
    """The read-side `record` of a projection `state`: every field the state has under the same name.

    A field of the record the state also has (a field or a property) is carried over: a time
    (microseconds stored) as a `datetime`, a list or dict as a copy (a record never shares the
    state's mutable parts), anything else as it is. `given` supplies the rest, and overrides:
    what the record shows that the state stores otherwise, or that is judged at read time. So a
    field added to both a state and its record needs no copy written here.
    """
    plan = _CARRIED.get((type(state), record))
    if plan is None:
        hints = get_type_hints(record)
        steps = []
        for f in dataclasses.fields(record):  # type: ignore[arg-type]
            if not hasattr(type(state), f.name):
                continue
            hint = hints[f.name]
            kinds = set(get_args(hint)) or {hint}
            origin = get_origin(hint)
            convert: Callable[[Any], Any] = (
                ts if datetime in kinds else list if origin is list else dict if origin is dict else _same
            )
            steps.append((f.name, convert))
        plan = _CARRIED[(type(state), record)] = tuple(steps)
    values = {name: convert(getattr(state, name)) for name, convert in plan if name not in given}
    return record(**values, **given)


def _same(value: T) -> T:
    return value


def _key(item: tuple[bytes, bytes]) -> bytes:
    return item[0]


class Shards:
    """A projection's shards as its views read them: routing, merging, query threads and scope."""

    def __init__(
        self,
        shards: ReadableShard | Mapping[int, ReadableShard],
        *,
        partitions: int | None = None,
        secondary: bool = False,
        owns_db: bool = False,
        scope: Callable[[], Collection[int] | None] | None = None,
    ) -> None:
        """Open shards (`{partition: shard}` with the topics' `partitions`), or one shard alone.

        `secondary`: catch each shard up with its writer before every query; `owns_db`: close
        them with `close`; `scope`: as `ProjectionReader` says.
        """
        self._shards: Mapping[int, ReadableShard] = (
            {0: shards} if isinstance(shards, Shard | MemoryShard) else shards
        )
        self._partitions = partitions
        """None: one db holds every partition's runs (tests and benchmarks)."""
        self._secondary = secondary
        self._owns_db = owns_db
        self._scope = scope
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._root: Path | None = None

    def open_under(self, root: Path) -> None:
        """Read the shards under the projection directory `root`, and those that appear there later."""
        self._tmp = tempfile.TemporaryDirectory(prefix='stepstream-reader-')
        self._root = root
        self._open_new_shards()

    @property
    def root(self) -> Path | None:
        """The projection directory these shards were opened under; None: a projector's own."""
        return self._root

    @property
    def partitions(self) -> int | None:
        """The topics' partition count; None: one shard holds every partition's runs."""
        return self._partitions

    @property
    def held(self) -> Mapping[int, ReadableShard]:
        """The shards readable here, by partition (whatever the scope)."""
        return self._shards

    def missing(self) -> list[int]:
        """The partitions with no shard here."""
        if self._partitions is None:
            return []
        return [p for p in range(self._partitions) if p not in self._shards]

    def _open_new_shards(self) -> None:
        """Open shards that appeared under the directory since the last query."""
        assert self._root is not None and self._tmp is not None and isinstance(self._shards, dict)
        for partition, path in shard_paths(self._root).items():
            if partition in self._shards:
                continue
            shard = Shard.open_read_only(path, Path(self._tmp.name) / path.name)
            identity = shard.identity()
            assert identity is not None  # open_read_only checked it
            if self._partitions is not None and identity.partitions != self._partitions:
                shard.close()
                raise StepStreamError(
                    f'{path} is a shard of {identity.partitions} partitions, '
                    f'the others of {self._partitions}: '
                    'the directory mixes two projections; rebuild it'
                )
            self._partitions = identity.partitions
            self._shards[partition] = shard

    def close(self) -> None:
        """Release the database handles if these shards were opened here."""
        if self._owns_db:
            for shard in self._shards.values():
                shard.close()
            if isinstance(self._shards, dict):
                self._shards.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def query(self, fn: Callable[[], T]) -> T:
        """`fn` in a worker thread, after catching up with the writers (secondaries)."""

        def run() -> T:
            if self._secondary:
                if self._root is not None:
                    self._open_new_shards()
                for shard in self._shards.values():
                    shard.catch_up()
            return fn()

        return await asyncio.to_thread(run)

    async def point(self, fn: Callable[[], T]) -> T:
        """A point read (a few RocksDB gets): on the event loop over a projector's own shards.

        Such a read takes microseconds; a hop to a worker thread and back costs the loop two
        wake-ups, which while it serves writers too was most of a read-your-writes `get_run`
        (docs/benchmarks/history/issue-27.md, "Issue 27, third pass"). A reader of another process's shards
        catches up with them first, which can take longer: that one goes to a thread.
        """
        if self._secondary:
            return await self.query(fn)
        return fn()

    def db(self, run_id: str) -> ReadableShard:
        """The shard holding `run_id`'s records."""
        if self._partitions is None:
            return self._shards[0]
        partition = murmur2_partition(run_id.encode(), self._partitions)
        shard = self._shards.get(partition)
        if shard is None:
            raise ShardUnavailable(self._missing_message([partition]))
        return shard

    def all(self) -> list[ReadableShard]:
        """Every shard in scope, or `ShardUnavailable` naming those missing."""
        if self._partitions is None:
            return list(self._shards.values())
        only = self._scope() if self._scope is not None else None
        wanted = range(self._partitions) if only is None else sorted(only)
        missing = [p for p in wanted if p not in self._shards]
        if missing:
            raise ShardUnavailable(self._missing_message(missing))
        return [self._shards[p] for p in wanted]

    def _missing_message(self, partitions: list[int]) -> str:
        where = f' under {self._root}' if self._root is not None else ' in this process'
        return (
            f'the shard of partition(s) {partitions} is not readable{where}: it is moving to another '
            'group member, held by a member on another host, or not made yet; try again, or read '
            'a directory that holds every shard'
        )

    def scan(
        self, prefix: bytes, *, start: bytes | None = None, reverse: bool = False
    ) -> Iterator[tuple[bytes, bytes]]:
        """Every shard's keys under `prefix`, merged in key order (a k-way merge, not a sort).

        `reverse` walks each shard from its end, `start` seeks each shard there first
        (`Shard.scan`): a page reads about its own keys per shard, however many there are.
        """
        shards = self.all()
        if len(shards) == 1:
            return shards[0].scan(prefix, start=start, reverse=reverse)
        walks = (shard.scan(prefix, start=start, reverse=reverse) for shard in shards)
        return heapq.merge(*walks, key=_key, reverse=reverse)

    def walk(self, prefixes: Sequence[bytes], cursor: bytes, *, reverse: bool = False) -> Iterator[bytes]:
        """The places of every shard's index entries under `prefixes`, merged in order, from `cursor`.

        A place is what follows its entry's prefix: the indexes of one listing end their keys
        alike (a run index's (started_at, run_id), a waiting call's (since, run_id, call)), so
        several ranges (a filter's, one per status or kind) merge into one order. `cursor` (a
        place; empty: the range's end, `reverse` its start) is where each range's walk seeks to,
        included; a page leaves it out.
        """
        walks = [self._places(prefix, cursor, reverse) for prefix in prefixes]
        return walks[0] if len(walks) == 1 else heapq.merge(*walks, reverse=reverse)

    def _places(self, prefix: bytes, cursor: bytes, reverse: bool) -> Iterator[bytes]:
        start = prefix + cursor if cursor else None
        return (k[len(prefix) :] for k, _ in self.scan(prefix, start=start, reverse=reverse))
