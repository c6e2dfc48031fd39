"""Typed state records of the projection, each with one serialization (compact, key-sorted JSON).

The apply rules mutate these; the reader turns them into the public record types. Every field
is a function of the log (docs/decisions/0010-conflict-rules.md), so two projections of one
log have byte-identical values.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self

from stepstream.schemas import DECISIONS, RESOLUTIONS, RESUMES_KEY

_ENCODER = json.JSONEncoder(separators=(',', ':'), sort_keys=True)
"""What `json.dumps(value, separators=(',', ':'), sort_keys=True)` builds on every call."""


def dumps(value: Any) -> bytes:
    """Compact, key-sorted JSON: the same state always has the same bytes."""
    return _ENCODER.encode(value).encode()


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


class _Json:
    """One serialization for every state record: its fields as a JSON object."""

    __slots__ = ()

    def encode(self) -> bytes:
        """The record as stored."""
        names = _FIELD_NAMES.get(type(self))
        if names is None:
            names = _FIELD_NAMES[type(self)] = tuple(f.name for f in fields(self))  # type: ignore[arg-type]
        return dumps({name: getattr(self, name) for name in names})

    @classmethod
    def decode(cls, raw: bytes) -> Self:
        """The record from its stored bytes."""
        return cls(**json.loads(raw))


def _no_ranges() -> list[list[int]]:
    return []


def _no_counts() -> dict[str, int]:
    return {}


def _no_strings() -> list[str]:
    return []


def _no_ints() -> list[int]:
    return []


ANSWERS: dict[str, frozenset[str]] = {'started': RESOLUTIONS, 'deferred': DECISIONS}
"""What may answer a call's deciding status: an operator's resolution a `started` one (in doubt), a
decision a `deferred` one (waiting)."""


def _no_dicts() -> list[dict[str, Any]]:
    return []


def _highs() -> list[int]:
    return [-1, -1]


def _no_metadata() -> dict[str, str]:
    return {}


def ranges_hold(ranges: list[list[int]], value: int) -> bool:
    """Whether sorted, disjoint, inclusive [low, high] `ranges` cover `value`."""
    if not ranges or value > ranges[-1][1]:  # the common case: above every range so far
        return False
    i = bisect.bisect_right(ranges, [value, 1 << 64]) - 1
    return i >= 0 and ranges[i][0] <= value <= ranges[i][1]


def ranges_add(ranges: list[list[int]], value: int) -> None:
    """Add `value` (not covered yet) to `ranges`, merging neighbours."""
    if ranges and value == ranges[-1][1] + 1:  # the common case: the next one
        ranges[-1][1] = value
        return
    i = bisect.bisect_right(ranges, [value, 1 << 64])
    joins_left = i > 0 and ranges[i - 1][1] == value - 1
    joins_right = i < len(ranges) and ranges[i][0] == value + 1
    if joins_left and joins_right:
        ranges[i - 1][1] = ranges[i][1]
        del ranges[i]
    elif joins_left:
        ranges[i - 1][1] = value
    elif joins_right:
        ranges[i][0] = value
    else:
        ranges.insert(i, [value, value])


@dataclass(slots=True)
class RunState(_Json):
    """A registered run: its lineage from its `run_started`, its status and its seq bookkeeping."""

    run_id: str
    owner: str
    """The `writer_id` of the run's first `run_started` (the registration)."""
    started_at: int
    conversation_id: str | None = None
    parent_run_id: str | None = None
    agent_name: str | None = None
    metadata: dict[str, str] = field(default_factory=_no_metadata)
    status: str = 'running'
    terminal_seq: int = -1
    ended_at: int | None = None
    error: str | None = None
    last_record_at: int = 0
    """The newest timestamp of the owner's applied step events (micros): what `stale` is judged by."""
    seqs: list[list[int]] = field(default_factory=_no_ranges)
    """The seqs that hold a record, as sorted, disjoint, inclusive [low, high] ranges."""
    highs: list[int] = field(default_factory=_highs)
    """Per topic, the highest seq accepted so far (the base of the seq-jump rule)."""
    rejected: dict[str, int] = field(default_factory=_no_counts)
    """The owner's records dead-lettered by a state rule, by reason."""
    conflicting_writers: list[str] = field(default_factory=_no_strings)
    snapshots: list[list[int]] = field(default_factory=_no_ranges)
    """The snapshot_seqs saved so far, as ranges like `seqs`."""
    retained_snapshots: list[int] = field(default_factory=_no_ints)
    newest_complete_snapshot: int = -1
    usage: dict[str, int] = field(default_factory=_no_counts)
    """Sums over the owner's step events, by `RunUsage` field (only the ones not zero)."""
    cost_usd: str | None = None
    """The sum of the priced model requests' costs, as decimal text; None while none was."""
    chained: bool | None = None
    """Whether the run's writer links its records (its seq 0 is of a schema with `prev_hash`); None before."""
    chain_through: int = -1
    """The highest seq up to which each applied record links to the one before it (`_chain.py`)."""
    chain_head: str | None = None
    """`chain_hash` of the record at `chain_through`: what the next one must link to."""
    chain_break: list[int] | None = None
    """[seq, topic, partition] of the first record whose link is not the record before it."""
    snapshot_key_high: int = -1
    """The highest sequence prefix (`N:...`) of the snapshot idempotency keys applied; -1: none yet."""
    snapshot_keys_at_high: list[str] = field(default_factory=_no_strings)
    """The keys applied at that sequence: a snapshot keyed below it, or again at it, is a duplicate."""
    resumed_by: str | None = None
    """The run that resumes this one (the first `run_resumed` mark applied); its status is then `resumed`."""
    resumed_at: int | None = None
    """When that mark was written (micros): the run's end, for a retention policy."""
    marks: dict[str, list[Any]] = field(default_factory=dict)
    """A run of a conversation: the newest `conversation_marked` title and archived flag keyed by it,
    as [timestamp, value] under `title` and `archived` (decision 0062)."""
    first_prompt: str | None = None
    """A run of a conversation: the first user prompt of its first snapshot (`snapshot_seq` 0), its
    text cut to `MAX_PROMPT_CHARS` (decision 0062); None while there is none, or none readable."""
    prompt_words: list[str] = field(default_factory=_no_strings)
    """A run of a conversation: the words of the user prompts of its snapshots (`words_of`), each
    once, in the order its snapshots were applied, at most `MAX_RUN_WORDS` (what search finds it by)."""

    @property
    def chain(self) -> str:
        """`intact`, `broken` or `unchained` (written before the chain, or not checked yet)."""
        if self.chain_break is not None:
            return 'broken'
        return 'intact' if self.chained else 'unchained'

    @property
    def resumes(self) -> str | None:
        """The run this one resumes, as its `run_started` metadata names it (`RESUMES_KEY`), or None."""
        return self.metadata.get(RESUMES_KEY)

    @property
    def chain_break_seq(self) -> int | None:
        """The seq of the first record whose link does not match, or None."""
        return self.chain_break[0] if self.chain_break is not None else None

    @property
    def chain_break_at(self) -> str | None:
        """Where that record stands: `<topic>/<partition>`, or None."""
        if self.chain_break is None:
            return None
        _, topic, partition = self.chain_break
        return f'{("step_events", "tool_effects")[topic]}/{partition}'

    @property
    def last_seq(self) -> int:
        """The highest seq that holds a record, or -1."""
        return self.seqs[-1][1] if self.seqs else -1

    @property
    def record_count(self) -> int:
        """How many seqs hold a record."""
        return sum(high - low + 1 for low, high in self.seqs)

    def gaps(self) -> list[tuple[int, int]]:
        """The ranges below `last_seq` that hold no record, inclusive."""
        out, expected = [], 0
        for low, high in self.seqs:
            if low > expected:
                out.append((expected, low - 1))
            expected = high + 1
        return out

    def holds(self, seq: int) -> bool:
        """Whether `seq` holds a record already."""
        seqs = self.seqs
        if not seqs or seq > seqs[-1][1]:  # the common case inline: it runs for every record
            return False
        return ranges_hold(seqs, seq)

    def claim(self, seq: int) -> None:
        """Record that `seq` holds a record now (it did not before)."""
        seqs = self.seqs
        if seqs and seq == seqs[-1][1] + 1:  # the common case inline: the next seq
            seqs[-1][1] = seq
            return
        ranges_add(seqs, seq)

    def count_rejected(self, reason: str) -> None:
        """Mark the run: one more of its records went to the DLQ for `reason`."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


@dataclass(slots=True)
class EffectState(_Json):
    """The merged state of one tool call: each field from the transition that decides it.

    Status, end and error come from the highest-seq transition that is not `annotated`;
    `started_at` is the earliest `started`; annotations keep the value of their highest seq;
    the tool name is the lowest seq's. None of it depends on the order transitions arrive in.

    An operator's resolutions are kept in `resolutions` (offset order); the first of them that
    answers the `started` transition deciding the status resolves the effect (`resolved_offset`).
    """

    run_id: str
    tool_call_id: str
    tool_name: str
    tool_name_seq: int
    status: str = 'annotated'
    """`annotated` while only annotations exist (no `started` seen): neither pending nor done."""
    status_seq: int = -1
    started_at: int | None = None
    ended_at: int | None = None
    error: str | None = None
    idempotency_key: str | None = None
    idempotency_key_seq: int = -1
    effect_summary: str | None = None
    effect_summary_seq: int = -1
    last_seq: int = -1
    resolutions: list[dict[str, Any]] = field(default_factory=_no_dicts)
    """Every operator resolution and decision of this call, in log order: `offset`, `seq` (the
    `started` or `deferred` it answers), `resolution`, `resolved_by`, `writer_id`, `at` (micros),
    `note`, and a decision's `args`, `result` and `error` (absent before schema v5)."""
    resolved_offset: int = -1
    """The offset of the resolution that decides the status, or -1."""
    deferral: str | None = None
    """`approval` or `external` while `deferred` decides the status (from that transition)."""
    args: str | None = None
    """The deferred call's arguments (JSON, redacted), from the `deferred` transition."""
    deferral_metadata: str | None = None
    """What the tool gave when it deferred (JSON), from the `deferred` transition."""

    @property
    def unresolved(self) -> bool:
        """`started` is the latest status and no operator answered it: it may or may not have happened."""
        return self.status == 'started' and self.resolved_offset < 0

    @property
    def waiting(self) -> bool:
        """`deferred` is the latest status and no decision answered it: it waits for one."""
        return self.status == 'deferred' and self.resolved_offset < 0

    def settle(self) -> None:
        """Find the answer that decides the status: the first in log order that answers its transition.

        A resolution answers a `started` transition (a call in doubt), a decision a `deferred` one.
        """
        self.resolved_offset = -1
        kinds = ANSWERS.get(self.status)
        if kinds is None:
            return
        for r in self.resolutions:
            if r['seq'] == self.status_seq and r['resolution'] in kinds:
                self.resolved_offset = r['offset']
                return


@dataclass(slots=True)
class SnapshotEntry(_Json):
    """Where a snapshot's delta is in the log, and what the views need without decoding it."""

    seq: int
    snapshot_seq: int
    state: str
    step_index: int
    prefix_len: int
    timestamp: int
    idempotency_key: str | None
    retained: bool = True


@dataclass(slots=True)
class ConversationState(_Json):
    """One shard's share of a conversation: its runs in this shard, summed (decision 0062).

    Every field is a sum or a max over the shard's runs of the conversation, so the state is a
    function of their states, whatever order their records came in; the reader combines the
    shards' shares.
    """

    conversation_id: str
    runs: int = 0
    active: int = 0
    """The newest activity (micros): the newest of its runs' newest records (`_listing.latest`)."""
    latest: list[Any] = field(default_factory=list)
    """[started_at, run_id] of its latest-started run here (the greatest pair)."""
    usage: dict[str, int] = field(default_factory=_no_counts)
    """Its runs' `RunState.usage`, summed by field (only the ones not zero)."""
    priced: int = 0
    """How many of its runs have a `cost_usd`."""
    cost_usd: str | None = None
    """Their costs summed, as normalized decimal text; None while none has one."""
    prompt: list[Any] = field(default_factory=list)
    """[started_at, run_id, first_prompt] of its earliest-started run here that has a first prompt."""
    title: list[Any] = field(default_factory=list)
    """[timestamp, title]: the newest of its runs' title marks here (`RunState.marks`, the greatest pair)."""
    archived: list[Any] = field(default_factory=list)
    """[timestamp, archived]: the newest of its runs' archived marks here."""

    @property
    def filed(self) -> str:
        """Where `ACTIVITY` files it in this shard: `archived` when its newest flag here is, else `open`."""
        return ARCHIVED if self.archived and self.archived[1] else OPEN


ARCHIVED = 'archived'
"""The `ACTIVITY` range of the conversations whose newest archived mark in the shard archived them."""
OPEN = 'open'
"""The `ACTIVITY` range of the others (unmarked, or unarchived by their newest mark in the shard)."""


MAX_PROMPT_CHARS = 200
"""The most of a run's first user prompt the projection keeps (a conversation's title when none is set)."""

MAX_WORDS = 32
"""The most words of one text (a prompt, a title) the search index keeps: its first ones."""
MAX_RUN_WORDS = 64
"""The most words of a run's user prompts the search index keeps (`RunState.prompt_words`): the
first ones, in the order its snapshots were applied (its first prompt's first)."""
MAX_WORD_CHARS = 40
"""A longer word is kept cut to this many characters (a search for it is cut alike)."""
_WORD = re.compile(r'[^\W_]+')


def words_of(text: str | None, limit: int = MAX_WORDS) -> list[str]:
    """The words a text is found by: runs of letters and digits, lowercased, each once, in order.

    Each cut to `MAX_WORD_CHARS`, at most `limit` of them.
    """
    found: dict[str, None] = {}
    for word in _WORD.findall((text or '').lower()):
        found.setdefault(word[:MAX_WORD_CHARS])
        if len(found) >= limit:
            break
    return list(found)


RUN_INDEX_VERSION = 7
"""The run indexes a shard made now holds: 2 adds `STATUS` and `AGENT` (decision 0045); 3 files
`AGENT` by status too and adds `LATEST` and the `COUNT`s (decision 0046); 4 checks each run's
hash chain and lists the broken ones in `BROKEN` (decision 0049); 5 lists the waiting calls by
kind, agent and conversation (`WAITING_KIND`, `WAITING_AGENT`, `WAITING_CONVERSATION`; decision 0056);
6 sums each conversation's runs (`CONVERSATION_STATE`) and lists them by activity (`ACTIVITY`;
decision 0062); 7 files `ACTIVITY` apart for the archived ones and indexes the words of every user
prompt of a run, not only its first (`RunState.prompt_words`)."""


@dataclass(slots=True)
class Identity(_Json):
    """What a projection was built from, and how (docs/decisions/0011-projection-identity.md)."""

    FORMAT: ClassVar[int] = 3
    """3: a directory of shards, one RocksDB per partition (decision 0016); 2: one RocksDB."""

    format: int
    topic_prefix: str
    cluster: str
    """The Kafka cluster id, or `servers:<bootstrap servers>` where the broker reports none."""
    max_snapshots_per_run: int | None
    state: str = 'live'
    """`live` (a projector's), `rebuilding` (a rebuild that has not reached its end) or `rebuilt`."""
    partitions: int = 0
    """How many partitions each topic had when the shard was made (which shard holds a run)."""
    partition: int = -1
    """The partition number whose records this shard holds."""
    retain_ended_us: int | None = None
    """The retention policy: runs that ended this long (micros, log time) before the newest step
    event of their partition are dropped (`_retention.py`); None keeps every run."""
    media_index: int = 1
    """The version of the shard's media index (`_retention.MEDIA_INDEX_VERSION`); 1 (absent) in a
    shard made before version 2, whose index missed binaries: a media sweep refuses it."""
    run_index: int = 1
    """The version of the shard's run indexes (`RUN_INDEX_VERSION`); 1 (absent) in a shard made
    before version 2, which has no `STATUS` and `AGENT` index: its readers filter by walking, and
    count by walking below version 3 (`_listing`)."""

    def options(self) -> dict[str, Any]:
        """What must match for two projections of one log to be equal."""
        return {
            'topic_prefix': self.topic_prefix,
            'cluster': self.cluster,
            'max_snapshots_per_run': self.max_snapshots_per_run,
            'retain_ended_us': self.retain_ended_us,
            'partitions': self.partitions,
            'run_index': self.run_index,  # an older shard lacks indexes (`RUN_INDEX_VERSION`)
        }
