"""The snapshot writer: what the next snapshot record of a run holds, and the media it needs first.

A snapshot record is a delta against the previous snapshot of the same run: how many leading
messages it keeps (`prefix_len`), the fields Pydantic AI stamped on kept messages since (`patch`)
and the new tail, with every large value moved to the media store. The capability owns one writer
per run; nothing here talks to the log. See docs/decisions/0003-delta-snapshots.md and
docs/decisions/0019-snapshot-patches.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter

from stepstream.media import MediaStore, Offloaded, offload_media
from stepstream.producer._redaction import Redaction
from stepstream.producer._validity import ToolCallScan
from stepstream.schemas import (
    MessageState,
    SnapshotDelta,
    SnapshotState,
    message_json,
    message_state,
    patch_json,
    stamps_since,
)

Offload = Callable[[list[ModelMessage]], Awaitable[Offloaded]]
"""Moves the large values of messages to the media store; returns the lean messages and what it stored."""

RECENT = 2
"""How many of a snapshot's last messages the next delta compares field by field (see DeltaTracker)."""


@dataclass(frozen=True, slots=True)
class SnapshotPlan:
    """What the next snapshot record holds, and what the tracker keeps once it is acknowledged."""

    prefix_len: int
    tail_json: list[bytes]
    """Pydantic AI JSON of each message after `prefix_len`."""
    patch: list[tuple[int, dict[str, Any]]]
    """Stamped fields of kept messages: `(index, {field: JSON value})`."""
    valid: bool
    """`is_provider_valid` of the whole history."""
    messages: Sequence[ModelMessage]
    recent_from: int
    recent_states: list[MessageState]
    """`message_state` of each message from `recent_from` on, as this plan saw them."""
    scan_at_recent: ToolCallScan
    redacted: frozenset[int] = frozenset()
    """The indexes (in `messages`) of tail messages whose JSON the redaction policy changed."""


class DeltaTracker:
    """Plans each snapshot as (prefix shared with the previous snapshot, patch, new tail), cheaply.

    Comparing or validating whole histories at every step would cost O(history) per step. The
    older part of the previous snapshot is compared by identity (the graph appends to one list,
    so unchanged messages are the same objects) and else by value (a history processor or
    compaction replaces objects). Its last `RECENT` messages, the only ones the graph still
    touches in place (a folded tool-return request is stamped with its run id and timestamp once
    it is sent), are compared field by field, and their parts' fields, against their
    `message_state` of then; one whose parts are unchanged is kept with a patch of its stamped
    fields instead of being sent again. Only new messages are serialised, and a stamped
    message's changed fields. Provider validity is read on from the tool calls that were open at
    that point.
    """

    def __init__(self, redaction: Redaction | None = None) -> None:
        """Start with no previous snapshot: the first plan holds the whole history.

        `redaction` is applied to each message's JSON (None: nothing is redacted); a patch is
        redacted as it is written (`SnapshotWriter.delta`).
        """
        self.redaction = redaction if redaction is not None else Redaction.off()
        self._refs: list[ModelMessage] = []
        self._recent_from = 0
        self._recent_states: list[MessageState] = []
        self._scan_at_recent = ToolCallScan()
        self.saved = False

    def plan(self, messages: Sequence[ModelMessage]) -> SnapshotPlan:
        """The delta of `messages` against the last committed snapshot, and its validity."""
        refs = self._refs
        limit = min(len(refs), len(messages))
        stable = min(limit, self._recent_from)
        head = messages[:stable]
        if refs[:stable] == (head if isinstance(head, list) else list(head)):
            i = stable  # one loop in C, which checks each message by identity before equality
        else:
            i = 0
            while refs[i] is messages[i] or refs[i] == messages[i]:
                i += 1
        patch: list[tuple[int, dict[str, Any]]] = []
        if i == stable:
            while i < limit:
                stamped = stamps_since(self._recent_states[i - self._recent_from], messages[i])
                if stamped is None:
                    break  # the first changed message starts the new tail
                if stamped:
                    patch.append((i, stamped))
                i += 1
        prefix_len = i
        tail, redacted = self.json_of(messages, prefix_len, len(messages))

        # Validity, read on from the last point known to be unchanged.
        if prefix_len >= self._recent_from:
            scan, start = self._scan_at_recent.copy(), self._recent_from
        else:
            scan, start = ToolCallScan(), 0
        recent_from = max(len(messages) - RECENT, 0)
        if recent_from < start:
            scan, start = ToolCallScan(), 0
        scan_at_recent = scan.copy()
        for index in range(start, len(messages)):
            if index == recent_from:
                scan_at_recent = scan.copy()
            scan.advance(messages[index])
        if recent_from == len(messages):
            scan_at_recent = scan.copy()
        return SnapshotPlan(
            prefix_len=prefix_len,
            tail_json=tail,
            patch=patch,
            valid=scan.settled,
            messages=messages,
            recent_from=recent_from,
            recent_states=[message_state(m) for m in messages[recent_from:]],
            scan_at_recent=scan_at_recent,
            redacted=redacted,
        )

    def json_of(
        self, messages: Sequence[ModelMessage], start: int, end: int
    ) -> tuple[list[bytes], frozenset[int]]:
        """The JSON of `messages[start:end]` as snapshots carry it, redacted, and which the policy changed."""
        found: list[bytes] = []
        redacted = set()
        for index in range(start, end):
            raw = message_json(messages[index])
            clean = self.redaction.message_json(raw)
            if clean is not None:
                raw = clean
                redacted.add(index)
            found.append(raw)
        return found, frozenset(redacted)

    def unchanged(self, plan: SnapshotPlan) -> bool:
        """True when the planned snapshot is exactly the last saved one."""
        return self.saved and not plan.patch and plan.prefix_len == len(plan.messages) == len(self._refs)

    def commit(self, plan: SnapshotPlan) -> None:
        """Remember a snapshot once the broker acknowledged it."""
        self._refs = list(plan.messages)  # shallow: the next plan compares identities against it
        self._recent_from = plan.recent_from
        self._recent_states = plan.recent_states
        self._scan_at_recent = plan.scan_at_recent
        self.saved = True


def _message(raw: bytes) -> ModelMessage:
    """A message back from its JSON as snapshots carry it (a redacted one, to offload its values)."""
    return ModelMessagesTypeAdapter.validate_json(b'[' + raw + b']')[0]


class SnapshotWriter:
    """Turns a run's history into its next `SnapshotDelta`, large values moved to the media store.

    ```python
    writer = SnapshotWriter(media_store, threshold_bytes=64 * 1024)
    prepared = await writer.prepare(messages, snapshot_seq=0)   # uploads media first
    ...                                                          # append the record, wait for the ack
    writer.commit(prepared)                                      # the next delta is against it
    ```

    A snapshot is `complete` when every tool call in it is settled and `interrupted` otherwise.
    Media is uploaded before `prepare` returns, so a record never refers to a missing object.
    """

    def __init__(
        self, media_store: MediaStore | None, threshold_bytes: int, redaction: Redaction | None = None
    ) -> None:
        """Offload values of at least `threshold_bytes` to `media_store` (or None: by `delta`'s `offload`).

        `redaction` is applied to every message and patch before it is serialised or offloaded
        (None: nothing is redacted).
        """
        self.media_store = media_store
        self.threshold_bytes = threshold_bytes
        self._deltas = DeltaTracker(redaction)

    def plan(self, messages: Sequence[ModelMessage]) -> SnapshotPlan:
        """The delta of `messages` against the last committed snapshot (nothing uploaded yet)."""
        return self._deltas.plan(messages)

    def unchanged(self, plan: SnapshotPlan) -> bool:
        """True when `plan` would save exactly the last committed snapshot again."""
        return self._deltas.unchanged(plan)

    async def delta(
        self, plan: SnapshotPlan, snapshot_seq: int, *, offload: Offload | None = None
    ) -> SnapshotDelta:
        """The record payload of `plan`, after its large values reached the media store.

        `offload` moves a tail's large values (default: `offload_media` into this writer's
        store); under a durable-execution engine the capability passes its durable operation, so
        the walk and the upload run as the engine's activity or step, never in workflow code.
        The record lists every object the offload stored (`SnapshotDelta.media`).
        """
        state: SnapshotState = 'complete' if plan.valid else 'interrupted'
        prefix_len, tail_json, patch = plan.prefix_len, plan.tail_json, patch_json(plan.patch)
        redacted = plan.redacted
        if patch is not None:  # stamped fields (instructions) are redacted like the messages
            clean = self._deltas.redaction.message_json(patch.encode())
            patch = patch if clean is None else clean.decode()
        if patch is not None and len(patch) >= self.threshold_bytes:
            # A large stamp (long instructions): send those messages again, so the walk below
            # moves the large value to the media store like any other.
            prefix_len, patch = plan.patch[0][0], None
            resent, also = self._deltas.json_of(plan.messages, prefix_len, plan.prefix_len)
            tail_json, redacted = resent + tail_json, redacted | also
        # A value at or above the threshold makes its message's JSON at least that long, so only
        # such tails pay for the walk (in a worker thread) and the upload.
        media: list[str] = []
        if any(len(m) >= self.threshold_bytes for m in tail_json):
            # What is offloaded is what the record says: a redacted message as redacted.
            tail = [
                _message(tail_json[k]) if prefix_len + k in redacted else m
                for k, m in enumerate(plan.messages[prefix_len:])
            ]
            if offload is not None:
                offloaded = await offload(tail)
            else:
                assert self.media_store is not None, 'a writer without a media store is given `offload`'
                offloaded = await offload_media(tail, self.media_store, self.threshold_bytes)
            tail_json = [message_json(m) for m in offloaded.messages]
            media = offloaded.media
        return SnapshotDelta(
            snapshot_seq=snapshot_seq,
            state=state,
            prefix_len=prefix_len,
            messages='[' + ','.join(m.decode() for m in tail_json) + ']',
            patch=patch,
            media=media,
        )

    def commit(self, plan: SnapshotPlan) -> None:
        """Make `plan` the base of the next delta, once its record is acknowledged."""
        self._deltas.commit(plan)
