"""The projection's key layout: every keyspace, its builder and its parser, in one place.

A key is one prefix byte naming its keyspace, then its components, each encoded so that the
encoding is injective and keeps order (docs/decisions/0009-key-layout.md):

- text: the UTF-8 bytes with every `00` escaped as `00 FF`, then the terminator `00 01`. No id
  can end a component early or run into the next one, whatever characters it holds, and the
  encoding of a whole component is never a prefix of another's.
- integer: 8 bytes big-endian of `value + 2**63`, so negative values sort before positive.

No other module spells key bytes: they ask a `Keyspace` for a key, a prefix or the parts.

| keyspace           | byte | components                            | value                          |
| ------------------ | ---- | ------------------------------------- | ------------------------------ |
| `META`             | `m`  | name                                  | JSON (identity, DLQ counts)    |
| `OFFSET`           | `o`  | topic, partition                      | next offset to apply (ASCII)   |
| `RUN`              | `r`  | run_id                                | `RunState`                     |
| `EVENT`            | `e`  | run_id, seq                           | the step event as logged (Avro)|
| `TRANSITION`       | `t`  | run_id, seq                           | its offset (8 bytes), then the |
|                    |      |                                       | first transition at seq (Avro) |
| `SNAPSHOT`         | `s`  | run_id, snapshot_seq                  | `SnapshotEntry`                |
| `EFFECT`           | `x`  | run_id, tool_call_id                  | `EffectState`                  |
| `UNRESOLVED`       | `u`  | started_at, run_id, tool_call_id      | empty: oldest first, all runs  |
| `UNRESOLVED_RUN`   | `v`  | run_id, tool_call_id                  | empty: per run                 |
| `WAITING`          | `W`  | deferred_at, run_id, tool_call_id     | empty: deferred calls that     |
|                    |      |                                       | wait for a decision, all runs  |
| `WAITING_KIND`     | `K`  | kind, deferred_at, run_id,            | empty: `WAITING` by kind       |
|                    |      | tool_call_id                          |                                |
| `WAITING_AGENT`    | `A`  | agent_name, kind, deferred_at,        | empty: an agent's, by kind     |
|                    |      | run_id, tool_call_id                  |                                |
| `WAITING_CONVERSATION` | `C` | conversation_id, kind, deferred_at, | empty: a conversation's, by    |
|                    |      | run_id, tool_call_id                  | kind                           |
| `RUNS`             | `a`  | started_at, run_id                    | empty: every run, in order     |
| `CONVERSATION`     | `c`  | conversation_id, started_at, run_id   | empty                          |
| `CONVERSATION_STATE` | `V` | conversation_id                    | `ConversationState`: this      |
|                    |      |                                       | shard's share of it            |
| `ACTIVITY`         | `Y`  | filed (`archived`, `open`), newest    | empty: conversations, by their |
|                    |      | activity, conversation_id             | newest activity in this shard, |
|                    |      |                                       | the archived ones apart        |
| `WORD`             | `X`  | word, conversation_id, run_id         | empty: the words of a run's    |
|                    |      |                                       | user prompts and title mark    |
| `CHILDREN`         | `p`  | parent_run_id, started_at, run_id     | empty                          |
| `STATUS`           | `b`  | status, started_at, run_id            | empty: runs by stored status   |
| `AGENT`            | `d`  | agent_name, status, started_at, run_id| empty: an agent's runs, by     |
|                    |      |                                       | stored status                  |
| `LATEST`           | `L`  | newest record's time, run_id          | empty: the runs stored running |
| `COUNT`            | `i`  | kind, name                            | how many (ASCII): runs per     |
|                    |      |                                       | status, per agent; unresolved  |
| `PARKED`           | `q`  | run_id, topic, partition, offset      | a record before its run exists |
| `APART`            | `w`  | run_id, writer_id, topic, seq         | another writer's record        |
| `CONFLICT`         | `k`  | run_id, writer_id                     | JSON: records kept apart       |
| `RESOLUTION`       | `z`  | run_id, tool_call_id, offset          | an operator's resolution (Avro)|
| `CLOCK`            | `l`  | partition                             | newest step-event time (ASCII) |
| `ENDED`            | `n`  | partition, ended_at, run_id           | empty: runs awaiting expiry    |
| `ENDS`             | `f`  | run_id, ended_at                      | empty: `ENDED` by run          |
| `EXPIRED`          | `g`  | run_id                                | JSON: when a dropped run began |
| `MEDIA`            | `h`  | sha256 hex, run_id                    | empty: a run references it     |
| `RUN_MEDIA`        | `j`  | run_id, sha256 hex                    | empty: `MEDIA` by run          |
| `TALLY`            | `y`  | run_id                                | JSON: its dead letters, by why |

The last seven exist only in a projection built with a retention policy (`_retention.py`,
docs/decisions/0032-retention.md).

Values that are not a state record are read and written through `_shard` (its
`pack_transition`, `offsets`, `dlq_counts`, ...): no other module slices stored bytes.

`topic` in `PARKED` and `APART` is the topic's index (0 step events, 1 tool effects). `offset` in
`RESOLUTION` is the resolution's offset in its tool-effects partition: resolutions are not the
run's records and hold no seq of their own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

_ESCAPED_NUL = b'\x00\xff'
_END = b'\x00\x01'
_INT_BIAS = 1 << 63

Part = Literal['str', 'int']


@functools.lru_cache(maxsize=1 << 16)
def encode_text(value: str) -> bytes:
    """One text component: escaped UTF-8 and its terminator (cached: a run's ids recur)."""
    return value.encode().replace(b'\x00', _ESCAPED_NUL) + _END


def encode_int(value: int) -> bytes:
    """One integer component: 8 bytes that sort like the numbers they encode."""
    return (value + _INT_BIAS).to_bytes(8, 'big')


def decode_int(encoded: bytes) -> int:
    """The inverse of `encode_int`."""
    return int.from_bytes(encoded, 'big') - _INT_BIAS


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key above every key that starts with `prefix` (None: no key is, `prefix` is all FF).

    Where a descending walk of the keys under `prefix` seeks to.
    """
    stripped = prefix.rstrip(b'\xff')
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


@dataclass(frozen=True, slots=True)
class Keyspace:
    """A named family of keys: a prefix byte and the kinds of its components."""

    name: str
    tag: bytes
    parts: tuple[Part, ...]
    _encoders: tuple[Callable[[Any], bytes], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        encoders = tuple(encode_text if kind == 'str' else encode_int for kind in self.parts)
        object.__setattr__(self, '_encoders', encoders)

    def key(self, *values: str | int) -> bytes:
        """The key of one entry; every component must be given."""
        if len(values) != len(self.parts):
            raise TypeError(f'{self.name} keys have {len(self.parts)} parts, got {len(values)}')
        return self.prefix(*values)

    def prefix(self, *values: str | int) -> bytes:
        """The prefix shared by every key whose leading components are `values`."""
        # On the apply path for every record: one join, no per-part branching.
        return self.tag + b''.join(
            [encode(value) for encode, value in zip(self._encoders, values, strict=False)]
        )

    def under(self, *leading: str | int) -> Callable[[Any], bytes]:
        """A builder of the keys that share every component but the last: it takes the last.

        For loops over one run's records, so that the shared components are encoded once:

        ```python
        event_key = EVENT.under('run-1')
        assert event_key(7) == EVENT.key('run-1', 7)
        ```
        """
        if len(leading) != len(self.parts) - 1:
            raise TypeError(f'{self.name} keys take {len(self.parts) - 1} leading parts, got {len(leading)}')
        head = self.prefix(*leading)
        if self.parts[-1] == 'int':  # a seq: `encode_int` inline, since this runs for every record
            return lambda value: head + (value + _INT_BIAS).to_bytes(8, 'big')
        last = self._encoders[-1]
        return lambda value: head + last(value)

    def parse(self, key: bytes) -> tuple[str | int, ...]:
        """The components of a key of this keyspace (the inverse of `key`)."""
        if key[:1] != self.tag:
            raise ValueError(f'not a {self.name} key: {key[:16]!r}')
        values: list[str | int] = []
        at = 1
        for kind in self.parts:
            if kind == 'int':
                values.append(decode_int(key[at : at + 8]))
                at += 8
                continue
            chunks = []
            while True:
                nul = key.index(b'\x00', at)
                chunks.append(key[at:nul])
                marker = key[nul + 1 : nul + 2]
                at = nul + 2
                if marker == b'\x01':
                    break
                if marker != b'\xff':
                    raise ValueError(f'malformed {self.name} key: {key[:64]!r}')
                chunks.append(b'\x00')
            values.append(b''.join(chunks).decode())
        if at != len(key):
            raise ValueError(f'{self.name} key has trailing bytes: {key[:64]!r}')
        return tuple(values)

    def last_str(self, key: bytes) -> str:
        """The last component of a key whose last component is text (a run or call id)."""
        value = self.parse(key)[-1]
        assert isinstance(value, str)
        return value


META = Keyspace('meta', b'm', ('str',))
OFFSET = Keyspace('offset', b'o', ('str', 'int'))
RUN = Keyspace('run', b'r', ('str',))
EVENT = Keyspace('event', b'e', ('str', 'int'))
TRANSITION = Keyspace('transition', b't', ('str', 'int'))
SNAPSHOT = Keyspace('snapshot', b's', ('str', 'int'))
EFFECT = Keyspace('effect', b'x', ('str', 'str'))
UNRESOLVED = Keyspace('unresolved', b'u', ('int', 'str', 'str'))
UNRESOLVED_RUN = Keyspace('unresolved_run', b'v', ('str', 'str'))
WAITING = Keyspace('waiting', b'W', ('int', 'str', 'str'))
WAITING_KIND = Keyspace('waiting_kind', b'K', ('str', 'int', 'str', 'str'))
WAITING_AGENT = Keyspace('waiting_agent', b'A', ('str', 'str', 'int', 'str', 'str'))
WAITING_CONVERSATION = Keyspace('waiting_conversation', b'C', ('str', 'str', 'int', 'str', 'str'))
RUNS = Keyspace('runs', b'a', ('int', 'str'))
STATUS = Keyspace('status', b'b', ('str', 'int', 'str'))
AGENT = Keyspace('agent', b'd', ('str', 'str', 'int', 'str'))
LATEST = Keyspace('latest', b'L', ('int', 'str'))
BROKEN = Keyspace('broken', b'B', ('int', 'str'))
COUNT = Keyspace('count', b'i', ('str', 'str'))
CONVERSATION = Keyspace('conversation', b'c', ('str', 'int', 'str'))
CHILDREN = Keyspace('children', b'p', ('str', 'int', 'str'))
PARKED = Keyspace('parked', b'q', ('str', 'int', 'int', 'int'))
APART = Keyspace('apart', b'w', ('str', 'str', 'int', 'int'))
CONFLICT = Keyspace('conflict', b'k', ('str', 'str'))
RESOLUTION = Keyspace('resolution', b'z', ('str', 'str', 'int'))
CLOCK = Keyspace('clock', b'l', ('int',))
ENDED = Keyspace('ended', b'n', ('int', 'int', 'str'))
ENDS = Keyspace('ends', b'f', ('str', 'int'))
EXPIRED = Keyspace('expired', b'g', ('str',))
MEDIA = Keyspace('media', b'h', ('str', 'str'))
RUN_MEDIA = Keyspace('run_media', b'j', ('str', 'str'))
TALLY = Keyspace('tally', b'y', ('str',))
CONVERSATION_STATE = Keyspace('conversation_state', b'V', ('str',))
ACTIVITY = Keyspace('activity', b'Y', ('str', 'int', 'str'))
WORD = Keyspace('word', b'X', ('str', 'str', 'str'))
SNAPSHOT_KEY = Keyspace('snapshot_key', b'S', ('str', 'str'))
"""A run's snapshot idempotency keys without a sequence prefix, each once: a later snapshot with one
is a keyed duplicate, whatever retention dropped since (`projector/_step_events.py`)."""

KEYSPACES = (
    META,
    OFFSET,
    RUN,
    EVENT,
    TRANSITION,
    SNAPSHOT,
    EFFECT,
    UNRESOLVED,
    UNRESOLVED_RUN,
    WAITING,
    WAITING_KIND,
    WAITING_AGENT,
    WAITING_CONVERSATION,
    RUNS,
    STATUS,
    AGENT,
    LATEST,
    BROKEN,
    COUNT,
    CONVERSATION,
    CHILDREN,
    PARKED,
    APART,
    CONFLICT,
    RESOLUTION,
    CLOCK,
    ENDED,
    ENDS,
    EXPIRED,
    MEDIA,
    RUN_MEDIA,
    TALLY,
    SNAPSHOT_KEY,
    CONVERSATION_STATE,
    ACTIVITY,
    WORD,
)
BY_TAG = {ks.tag: ks for ks in KEYSPACES}
assert len(BY_TAG) == len(KEYSPACES)

IDENTITY = META.key('identity')
DLQ_COUNTS = META.key('dlq')
PROGRESS = META.key('progress')
PROCESS_LOCAL = (OFFSET.tag, PROGRESS, IDENTITY)
"""Keys (or keyspace tags) that depend on the consuming process, not only on the log."""


def render_key(key: bytes) -> str:
    """A key as readable text: its keyspace and parts joined by '/'."""
    space = BY_TAG.get(key[:1])
    if space is None:
        return repr(key)
    try:
        return '/'.join([space.name, *map(str, space.parse(key))])
    except ValueError:
        return f'{space.name}/{key[1:]!r}'


# -- the counts every shard keeps ------------------------------------------------------------

UNRESOLVED_COUNT = COUNT.key('effects', 'unresolved')
"""The count of calls whose effect is in doubt (`UNRESOLVED` entries), in every shard."""

PARKED_COUNT = COUNT.key('records', 'parked')
"""The count of records waiting for their run's registration (`PARKED` entries)."""

CONFLICTING_COUNT = COUNT.key('runs', 'conflicting')
"""The count of runs that keep another writer's records apart (runs with `CONFLICT` entries)."""

BROKEN_COUNT = COUNT.key('chain', 'broken')
"""The count of runs whose hash chain is broken (`BROKEN` entries)."""


def status_count(status: str) -> bytes:
    """The `COUNT` key of the runs stored with `status`."""
    return COUNT.key('status', status)


def agent_count(agent_name: str) -> bytes:
    """The `COUNT` key of an agent's runs."""
    return COUNT.key('agent', agent_name)


def waiting_count(deferral: str) -> bytes:
    """The `COUNT` key of the deferred calls of one kind (`approval`, `question`, `external`) that wait."""
    return COUNT.key('waiting', deferral)
