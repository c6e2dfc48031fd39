"""Group membership: what a member tells the others, and who owns which partition.

Members find each other through the consumer group itself, not a second registry: each
member's join metadata carries the URL its `stepstream serve` answers on, and the group
leader's assignment hands every member the whole table (partition -> owner's URL) in its
`user_data`. Assignment stays range-style, so a member owns partition p of both log topics
(decision 0016). The protocol has its own name and is the only one a member offers: a client
that offers only plain `range` cannot join the group (the broker says the protocols are
inconsistent), which keeps foreign members out of a shard's partitions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata

log = logging.getLogger(__name__)

PROTOCOL = 'stepstream-range'
"""The assignment protocol's name: range assignment that also shares each member's endpoint."""


@dataclass
class Membership:
    """One member's view of its group: its endpoint, and the owner of every partition.

    `endpoint` is read when the member joins (set it before the projector starts); `routes`,
    `own` and `partitions` are replaced at every assignment.
    """

    endpoint: str | None = None
    """The base URL of this member's service (`http://host:port`), or None if it serves none."""
    routes: dict[int, str | None] = field(default_factory=dict)
    """Partition -> the base URL of the member that owns it (None: that member serves no HTTP)."""
    own: frozenset[int] = frozenset()
    """The partitions this member owns."""
    partitions: int = 0
    """How many partitions each log topic has (0 until the first assignment)."""
    generation: int = 0
    """Assignments received so far."""

    def owner(self, partition: int) -> str | None:
        """The base URL of the member that owns `partition`, or `LookupError` if it has none."""
        if partition not in self.routes:
            raise LookupError(f'no member of the group owns partition {partition} yet')
        return self.routes[partition]


def _decode(data: bytes) -> dict[str, object]:
    if not data:
        return {}
    try:
        decoded = json.loads(data)
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


def membership_assignor(membership: Membership) -> type[AbstractPartitionAssignor]:
    """A range assignor that shares `membership.endpoint` and keeps `membership` current.

    Its join metadata carries the endpoint; the leader's assignments carry every member's
    partitions and endpoint, and each assignment this member receives updates `membership`.
    """

    class StepstreamAssignor(RangePartitionAssignor):
        name = PROTOCOL

        @classmethod
        def metadata(cls, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
            endpoint = json.dumps({'endpoint': membership.endpoint}).encode()
            return ConsumerProtocolMemberMetadata(cls.version, list(topics), endpoint)

        @classmethod
        def assign(
            cls, cluster: ClusterMetadata, members: Mapping[str, ConsumerProtocolMemberMetadata]
        ) -> dict[str, ConsumerProtocolMemberAssignment]:
            assigned = super().assign(cluster, members)
            routes: dict[int, str | None] = {}
            partitions = 0
            for member, assignment in assigned.items():
                endpoint = _decode(members[member].user_data).get('endpoint')
                for topic, numbers in assignment.assignment:
                    partitions = max(partitions, len(cluster.partitions_for_topic(topic) or ()))
                    for p in numbers:
                        routes[p] = endpoint if isinstance(endpoint, str) else None
            table = json.dumps(
                {'partitions': partitions, 'routes': {str(p): url for p, url in sorted(routes.items())}}
            ).encode()
            return {
                member: ConsumerProtocolMemberAssignment(a.version, a.assignment, table)
                for member, a in assigned.items()
            }

        @classmethod
        def on_assignment(cls, assignment: ConsumerProtocolMemberAssignment) -> None:
            table = _decode(assignment.user_data)
            routes = table.get('routes')
            partitions = table.get('partitions')
            membership.routes = (
                {int(p): url if isinstance(url, str) else None for p, url in routes.items()}
                if isinstance(routes, dict)
                else {}
            )
            membership.partitions = partitions if isinstance(partitions, int) else 0
            membership.own = frozenset(p for _, numbers in assignment.assignment for p in numbers)
            membership.generation += 1
            log.info('group routes: %s (this member: %s)', membership.routes, sorted(membership.own))

    return StepstreamAssignor
