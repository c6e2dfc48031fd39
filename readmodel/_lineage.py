"""The lineage view: a run's tree of descendants and the root of its lineage, over the `CHILDREN` index."""

from __future__ import annotations

from stepstream.readmodel._runs import Runs
from stepstream.readmodel._shards import Shards
from stepstream.schemas import RunRecord
from stepstream.storage import CHILDREN


class Lineage:
    """Parents and children: the same index `list_runs(parent_run_id=)` reads."""

    def __init__(self, shards: Shards, runs: Runs) -> None:
        self._shards = shards
        self._runs = runs

    async def run_tree(self, run_id: str) -> list[RunRecord]:
        """`ProjectionReader.run_tree`: depth first, a run seen twice (a cycle) listed once."""

        def query() -> list[RunRecord]:
            root = self._runs.run(run_id)
            if root is None:
                return []
            tree, stack, seen = [], [root], {root.run_id}
            while stack:
                run = stack.pop()
                tree.append(run)
                children = [c for c in self._children(run.run_id) if c.run_id not in seen]
                seen.update(c.run_id for c in children)
                stack.extend(reversed(children))
            return tree

        return await self._shards.query(query)

    async def root_of(self, run_id: str) -> RunRecord | None:
        """`ProjectionReader.root_of`: stops at a parent the projection does not hold, or a cycle."""

        def query() -> RunRecord | None:
            run, seen = self._runs.run(run_id), set()
            while run is not None and run.parent_run_id is not None and run.run_id not in seen:
                seen.add(run.run_id)
                parent = self._runs.run(run.parent_run_id)
                if parent is None:
                    break
                run = parent
            return run

        return await self._shards.query(query)

    def _children(self, run_id: str) -> list[RunRecord]:
        """The runs naming `run_id` as parent: the same index `list_runs(parent_run_id=)` reads."""
        keys = self._shards.scan(CHILDREN.prefix(run_id))
        children = (self._runs.run(CHILDREN.last_str(k)) for k, _ in keys)
        return [c for c in children if c is not None and c.parent_run_id == run_id]
