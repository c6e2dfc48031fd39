"""Retention of the read model, by its rules (fast tier: the `Applier` on in-memory and RocksDB shards).

For every generated log (the hostile mix of test_apply_properties.py) and a retention policy:
the projection is still a pure function of the log (one pass == random interleavings, batches,
crashes and restarts, byte for byte), a run without an end is never dropped, a run is dropped
exactly when one of its ends is older than its partition's clock minus the period, nothing of
a dropped run is left but its marker, and the media index names exactly what the kept runs'
stored records reference. test_retention_e2e.py proves the same through the broker and S3.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_apply_properties import (
    PARTITIONS,
    SEQ_JUMP,
    STORES,
    T0,
    TOPICS,
    Op,
    apply_with_crashes,
    check_run_indexes,
    interleave,
    logs,
    make_log,
    open_store,
)

from stepstream.errors import UsageError
from stepstream.media import S3MediaStore, snapshot_media
from stepstream.media._types import MEDIA_URI_SCHEME
from stepstream.projector._apply import EFFECTS, EVENTS, Applier, SourceRecord
from stepstream.projector._retention import Retention
from stepstream.readmodel import ProjectionReader, ShardUnavailable, sweep_media
from stepstream.schemas._plain import read_plain, read_record
from stepstream.storage import MemoryShard, Shard, retention_preview, retention_state, shard_path
from stepstream.storage._keys import (
    BY_TAG,
    CLOCK,
    ENDED,
    ENDS,
    EVENT,
    EXPIRED,
    MEDIA,
    RUN,
    RUN_MEDIA,
)
from stepstream.storage._state import Identity, RunState
from stepstream.timestamps import micros
from stepstream.topics import murmur2_partition

pytestmark = [pytest.mark.fast, pytest.mark.once]

MINUTE = 60_000_000
Log = dict[tuple[int, int], list[SourceRecord]]


def retaining(minutes: int | None) -> Applier:
    return Applier(
        TOPICS,
        partitions=PARTITIONS,
        max_snapshots_per_run=2,
        max_seq_jump=SEQ_JUMP,
        retain_ended_us=None if minutes is None else minutes * MINUTE,
    )


def in_one_pass(path: str, log: Log, store: str, minutes: int | None) -> list[tuple[bytes, bytes]]:
    db = open_store(path, store)
    try:
        txn, _ = retaining(minutes).stage(db, [r for tp in sorted(log, reverse=True) for r in log[tp]])
        txn.commit()
        return list(db.logical_items())
    finally:
        db.close()


def spread(generated: list[Op], data: st.DataObject) -> list[Op]:
    """The generated ops over a longer stretch of log time, so clocks pass many ends."""
    return [replace(op, minute=op.minute + data.draw(st.integers(0, 20))) for op in generated]


@pytest.mark.parametrize('store', STORES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated=logs(), data=st.data(), seed=st.integers(0, 2**32), minutes=st.integers(1, 12))
def test_with_retention_the_projection_is_still_a_pure_function_of_the_log(
    generated: list[Op], data: st.DataObject, seed: int, minutes: int, store: str
) -> None:
    log = make_log(spread(generated, data))
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as other:
        reference = in_one_pass(one, log, store, minutes)
        replayed = apply_with_crashes(other, log, seed, store, make_applier=lambda: retaining(minutes))
    assert replayed == reference


def _applied_without_retention(log: Log) -> MemoryShard:
    db = MemoryShard()
    txn, _ = Applier(TOPICS, partitions=PARTITIONS, max_snapshots_per_run=2, max_seq_jump=SEQ_JUMP).stage(
        db, interleave(log, random.Random(0))
    )
    txn.commit()
    return db


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated=logs(), data=st.data(), minutes=st.integers(1, 12))
def test_exactly_the_runs_that_ended_before_the_cutoff_are_dropped_and_nothing_of_them_stays(
    generated: list[Op], data: st.DataObject, minutes: int
) -> None:
    """Against the projection without a policy: a run whose end (any of its end events) is older
    than its partition's clock minus the period is gone but for its marker; every other run is
    there, running ones included; the clock is the newest valid step event of the partition."""
    log = make_log(spread(generated, data))
    full = _applied_without_retention(log)
    kept = MemoryShard()
    txn, _ = retaining(minutes).stage(kept, interleave(log, random.Random(1)))
    txn.commit()

    clocks = {}
    for (topic, partition), records in log.items():
        if topic == EVENTS:
            checked = [Applier(TOPICS, partitions=PARTITIONS).check(r) for r in records if _valid(r)]
            if checked:
                clocks[partition] = max(f['timestamp'] for f in checked)
    for partition in range(PARTITIONS):
        raw = kept.get(CLOCK.key(partition))
        assert (int(raw) if raw is not None else None) == clocks.get(partition)

    for k, raw in full.scan(RUN.tag):
        run = RunState.decode(raw)
        partition = murmur2_partition(run.run_id.encode(), PARTITIONS)
        ends = _end_times(full, run.run_id)
        expired = bool(ends) and min(ends) < clocks[partition] - minutes * MINUTE
        if not ends:
            assert kept.get(k) is not None, 'a run without an end is never dropped'
        assert (kept.get(k) is None) == expired
        assert (kept.get(EXPIRED.key(run.run_id)) is not None) == expired
        if expired:
            leftovers = [BY_TAG[key[:1]].name for key, _ in kept.scan(b'') if _names(key, run.run_id)]
            assert leftovers == [], f'{run.run_id} expired but left {leftovers}'
        else:
            assert kept.get(k) == full.get(k)

    # The media index is exactly what the kept runs' stored snapshot records list, and its twin agrees.
    wanted = set()
    for k, value in kept.scan(EVENT.tag):
        snap = read_record(value)[1]['snapshot']
        if snap is not None:
            uris = snapshot_media(snap['messages'], snap['media'])
            wanted |= {(uri.removeprefix(MEDIA_URI_SCHEME), EVENT.parse(k)[0]) for uri in uris}
    assert {MEDIA.parse(k) for k, _ in kept.scan(MEDIA.tag)} == wanted
    assert {tuple(reversed(RUN_MEDIA.parse(k))) for k, _ in kept.scan(RUN_MEDIA.tag)} == wanted
    check_run_indexes(kept)  # a dropped run's STATUS and AGENT entries went with it
    # Every ENDED entry has its twin, and both belong to kept runs.
    for k, _ in kept.scan(ENDED.tag):
        _, ended_at, run_id = ENDED.parse(k)
        assert kept.get(ENDS.key(run_id, ended_at)) is not None
        assert kept.get(RUN.key(str(run_id))) is not None


def _names(key: bytes, run_id: str) -> bool:
    """Whether a key is about the run (a child's `CHILDREN` entry under it is about the child)."""
    if key[:1] in (EXPIRED.tag, CLOCK.tag, b'm', b'o'):
        return False
    parts = BY_TAG[key[:1]].parse(key)
    return parts[-1] == run_id if key[:1] == b'p' else run_id in parts


def _valid(source: SourceRecord) -> bool:
    try:
        Applier(TOPICS, partitions=PARTITIONS).check(source)
    except Exception:
        return False
    return True


def _end_times(full: MemoryShard, run_id: str) -> list[int]:
    """The times of a run's applied end events (its stored step events of an end kind), and of
    the mark of the run that resumed it (a waiting run is kept while it waits: decision 0057)."""
    state = full.get_state(RUN.key(run_id), RunState)
    out = [] if state is None or state.resumed_at is None else [state.resumed_at]
    for _, value in full.scan(EVENT.prefix(run_id)):
        read = read_plain(value)
        assert read is not None
        if read[1]['kind'] in ('run_completed', 'run_failed', 'run_cancelled'):
            out.append(read[1]['timestamp'])
    return out


def test_a_late_record_of_a_dropped_run_is_dropped_not_parked() -> None:
    """A run ends, the clock passes its end plus the period, and then its own records come:
    a retried `run_started`, a transition, an operator's resolution. None brings it back."""
    from stepstream.schemas import StepEvent, ToolEffectTransition, encode

    def at(minute: int) -> datetime:
        return T0.replace(minute=minute)

    part = murmur2_partition(b'old', PARTITIONS)
    other = next(r for r in ('new', 'new2', 'new3') if murmur2_partition(r.encode(), PARTITIONS) == part)
    offsets = {EVENTS: 0, EFFECTS: 0}

    def record(topic: int, rec: object) -> SourceRecord:
        offsets[topic] += 1
        return SourceRecord(topic, part, offsets[topic] - 1, rec.run_id.encode(), encode(rec))  # type: ignore[attr-defined]

    def event(run_id: str, seq: int, kind: str, minute: int) -> SourceRecord:
        return record(
            EVENTS, StepEvent(run_id=run_id, seq=seq, writer_id='w', timestamp=at(minute), kind=kind)
        )  # type: ignore[arg-type]

    started = event('old', 0, 'run_started', 0)
    batches = [
        [started, event('old', 1, 'run_completed', 1)],
        [event(other, 0, 'run_started', 10)],  # the clock passes 1 + 5
        [
            started,
            record(
                EFFECTS,
                ToolEffectTransition(
                    run_id='old',
                    seq=2,
                    writer_id='w',
                    timestamp=at(11),
                    tool_call_id='c',
                    tool_name='t',
                    status='started',
                ),
            ),
        ],
    ]
    db = MemoryShard()
    applier = retaining(5)
    outcomes = []
    for batch in batches:
        txn, outcome = applier.stage(db, batch)
        txn.commit()
        outcomes.append(outcome)
    assert outcomes[1].expired_runs == ['old']
    assert outcomes[2].expired_records == 2 and outcomes[2].applied == 0
    assert db.get(RUN.key('old')) is None and db.get(EXPIRED.key('old')) is not None
    assert [k for k, _ in db.scan(b'q')] == []  # nothing parked
    state = retention_state(db, part, 5 * MINUTE)
    assert (state.clock, state.expired, state.waiting) == (micros(at(10)), 1, 0)
    assert state.cutoff == micros(at(10)) - 5 * MINUTE


def test_a_policy_is_positive() -> None:
    with pytest.raises(ValueError, match='positive'):
        Retention(0)


def _projection(root: Path, partitions: list[int], of: int, retain_us: int | None) -> None:
    for partition in partitions:
        identity = Identity(
            format=Identity.FORMAT,
            topic_prefix='props',
            cluster='props',
            max_snapshots_per_run=None,
            partitions=of,
            partition=partition,
            retain_ended_us=retain_us,
        )
        Shard.create(root, partition, identity).close()


async def test_a_media_sweep_refuses_without_every_shard_or_without_a_policy(tmp_path: Path) -> None:
    """A sweep's mark must be every shard's (a group member's directory holds only its own) and
    must come from a projection that indexes media (one built with a policy). No S3 is reached."""
    store = S3MediaStore(bucket='never-reached', endpoint='http://127.0.0.1:9')
    _projection(tmp_path / 'member', [0], 2, MINUTE)
    reader = ProjectionReader.open(tmp_path / 'member')
    try:
        with pytest.raises(ShardUnavailable, match=r'\[1\]'):
            await sweep_media(reader, store)
    finally:
        reader.close()
    _projection(tmp_path / 'keeps-all', [0, 1], 2, None)
    reader = ProjectionReader.open(tmp_path / 'keeps-all')
    try:
        with pytest.raises(UsageError, match='without a retention policy'):
            await sweep_media(reader, store)
        with pytest.raises(UsageError, match='grace period'):
            await sweep_media(reader, store, grace=timedelta(minutes=30))
    finally:
        reader.close()


async def test_a_media_sweep_refuses_an_index_made_before_it_knew_binaries(tmp_path: Path) -> None:
    """A shard made by an earlier stepstream has a media index that missed every offloaded binary
    (media index 1): a sweep over it would delete kept runs' images, so it refuses, saying to
    rebuild. No S3 is reached."""
    store = S3MediaStore(bucket='never-reached', endpoint='http://127.0.0.1:9')
    _projection(tmp_path / 'old', [0, 1], 2, MINUTE)
    shard = Shard.open(shard_path(tmp_path / 'old', 1))
    identity = shard.identity()
    shard.close()
    assert identity is not None and identity.media_index == 1  # what an earlier shard reads as
    reader = ProjectionReader.open(tmp_path / 'old')
    try:
        assert await reader.media_index_versions() == {0: 1, 1: 1}
        with pytest.raises(UsageError, match=r'partition\(s\) \[0, 1\].*Rebuild the projection'):
            await sweep_media(reader, store)
    finally:
        reader.close()


def test_a_preview_counts_what_a_policy_would_drop_from_a_projection_without_one() -> None:
    from stepstream.schemas import StepEvent, encode

    part = murmur2_partition(b'a', PARTITIONS)
    ids = [r for r in (f'r{i}' for i in range(50)) if murmur2_partition(r.encode(), PARTITIONS) == part][:3]
    offsets = iter(range(100))

    def event(run_id: str, seq: int, kind: str, minute: int) -> SourceRecord:
        at = T0.replace(minute=minute)
        record = StepEvent(run_id=run_id, seq=seq, writer_id='w', timestamp=at, kind=kind)  # type: ignore[arg-type]
        return SourceRecord(EVENTS, part, next(offsets), run_id.encode(), encode(record))

    old, recent, running = ids
    db = MemoryShard()
    txn, _ = Applier(TOPICS, partitions=PARTITIONS).stage(
        db,
        [
            event(old, 0, 'run_started', 0),
            event(old, 1, 'run_completed', 1),
            event(recent, 0, 'run_started', 7),
            event(recent, 1, 'run_failed', 8),
            event(running, 0, 'run_started', 0),
            event(running, 1, 'model_request_started', 10),
        ],
    )
    txn.commit()
    preview = retention_preview(db, part, 5 * MINUTE)
    assert (preview.clock, preview.would_drop, preview.would_keep) == (micros(T0.replace(minute=10)), 1, 2)
