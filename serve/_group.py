"""Members answering for each other: a run's reads go to the member that owns its partition.

A group member's service holds only its own shards (decision 0016). It learns who owns each
partition from the consumer group (`projector.Membership`, filled by the group's assignor), so
it forwards a run's reads to that member and asks every member for its part of a list. A
forwarded request carries `FORWARDED_HEADER`; a member answers one from its own shards only and
never forwards it again, so no request travels more than one hop.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import httpx

from stepstream.errors import NotUnknown, NotWaiting, StepStreamError
from stepstream.projector import Membership
from stepstream.readmodel import ShardUnavailable
from stepstream.topics import murmur2_partition

FORWARDED_HEADER = 'x-stepstream-forwarded'
"""Marks a request one member sent another: answered from the receiver's own shards only."""

forwarded: ContextVar[bool] = ContextVar('stepstream_forwarded', default=False)
"""Whether the request being answered was forwarded by another member (set by the app's middleware)."""


class NotFoundThere(LookupError):
    """The owning member answered 404 (the service maps it to its own `NotFound`)."""


class Peers:
    """The other members of this service's group, as HTTP endpoints, and how to ask them."""

    def __init__(self, membership: Membership, *, token: str | None, timeout_s: float) -> None:
        """Route by `membership`; send `token` as the bearer token (members share one)."""
        self.membership = membership
        self._token = token
        self._timeout = timeout_s
        self._client: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        """Close the HTTP client, if one was opened."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def owner_of(self, run_id: str) -> str | None:
        """The base URL of the member that owns `run_id`'s partition; None to answer here.

        None when this member owns it, or when the request was forwarded here (answered here
        whatever the shards say: never a second hop).
        """
        m = self.membership
        if forwarded.get():
            return None
        if m.partitions == 0:
            raise ShardUnavailable('this member has not been assigned its partitions yet; try again')
        partition = murmur2_partition(run_id.encode(), m.partitions)
        if partition in m.own:
            return None
        return self._url_of(partition)

    def others(self) -> list[str]:
        """Every other member's base URL, each once.

        `ShardUnavailable` if a partition has no member that serves: a list is never partial.
        """
        m = self.membership
        if m.partitions == 0:
            raise ShardUnavailable('this member has not been assigned its partitions yet; try again')
        urls = {self._url_of(p) for p in range(m.partitions) if p not in m.own}
        return sorted(urls)

    def _url_of(self, partition: int) -> str:
        try:
            url = self.membership.owner(partition)
        except LookupError as exc:
            raise ShardUnavailable(str(exc)) from None
        if url is None:
            raise ShardUnavailable(
                f'partition {partition} is owned by a group member that serves no HTTP: run the group '
                'members as `stepstream serve --group NAME`, or read a directory that holds every shard'
            )
        return url

    async def ask(
        self, url: str, method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None
    ) -> Any:
        """The JSON answer of the member at `url`; its errors as ours (404, 409, 400 and 422, 503).

        A 409 that names a `decision` (a decision on a deferred call refused) is `NotWaiting` whose
        `decision` is the member's whole answer.
        """
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout)
        headers = {FORWARDED_HEADER: '1'}
        if self._token is not None:
            headers['Authorization'] = f'Bearer {self._token}'
        query = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = await self._client.request(
                method, url + path, params=query, json=body, headers=headers
            )
        except httpx.HTTPError as exc:
            raise ShardUnavailable(f'the group member at {url} did not answer ({exc!r}); try again') from None
        if 200 <= response.status_code < 300:
            return response.json()
        try:
            answer = response.json()
            detail = str(answer.get('detail'))
        except (ValueError, AttributeError):
            answer, detail = None, response.text[:500]
        where = f'(from the member at {url})'
        if response.status_code == 404:
            raise NotFoundThere(f'{detail} {where}')
        if response.status_code == 409 and isinstance(answer, dict) and 'decision' in answer:
            raise NotWaiting(f'{detail} {where}', answer)
        if response.status_code == 409:
            raise NotUnknown(f'{detail} {where}')
        if response.status_code in (400, 422):
            raise ValueError(f'{detail} {where}')
        if response.status_code == 503:
            raise ShardUnavailable(f'{detail} {where}')
        raise StepStreamError(f'the group member at {url} answered {response.status_code}: {detail}')
