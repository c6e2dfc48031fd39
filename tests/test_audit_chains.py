"""The pure rules of `stepstream audit`: `verify_run` (audit/_chains.py) and signing (stepstream/signing.py).

Generated runs of 1 to 30 records, split at random across the two topics (step events, tool
effects), each linking to the one before (decision 0048), with signed heads at random durability
points and always one over the final head when signing is on. Proved here, with no broker:

- an untouched run verifies (`intact`, no breaks, ended, every record counted and, with the
  trusted key, signed through), whatever order its records are handed over in;
- records written before the chain (no link, no signed head) are `unchained`, not broken;
- each tamper is named where it is: an altered record, a dropped one, two swapped, a second
  record for a seq, a forged record appended with a valid link but no signature, heads signed by
  a key not trusted or with altered signature bytes, a record placed as another run's; a resent
  duplicate is not a break;
- `TrustedKeys.load` reads a PEM file with several public keys and a directory of `.pem` files,
  and names a file that holds a private key or garbage; `Signer.from_pem` refuses keys that are
  not Ed25519.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, ed448, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    BestAvailableEncryption,
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepstream.audit._chains import Break, RunIntegrity, Seen, verify_run
from stepstream.signing import SIGNED_KIND, Signer, TrustedKeys, key_id, public_pem, statement

pytestmark = pytest.mark.fast

EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def private_pem(key: object) -> bytes:
    return key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())  # type: ignore[attr-defined]


def new_signer() -> tuple[Signer, Ed25519PrivateKey]:
    private_key = Ed25519PrivateKey.generate()
    return Signer.from_pem(private_pem(private_key)), private_key


SIGNER, PRIVATE = new_signer()
KEYS = TrustedKeys({SIGNER.key_id: PRIVATE.public_key()})
OTHER, OTHER_PRIVATE = new_signer()
"""A key the verifier is not given."""

STEP_KINDS = ('model_request_started', 'model_request_completed', 'tool_call_started', 'tool_call_completed')
TOOL_STATUSES = ('started', 'completed', 'failed')


@dataclass(frozen=True)
class Run:
    """A run's records as its writer wrote them, and how they stand in the log."""

    run_id: str
    trail: list[Seen]
    """Seq 0..n-1, in seq order."""
    heads: list[Seen]
    """Signed heads (`chain_signed`), in seq order."""
    others: list[Seen]
    """Heartbeats: on the log, not of the trail."""
    signed: bool

    @property
    def n(self) -> int:
        return len(self.trail)

    @property
    def seen(self) -> list[Seen]:
        return [*self.trail, *self.heads, *self.others]

    def next_offset(self, topic: int) -> int:
        return 1 + max((r.offset for r in self.seen if r.topic == topic), default=0)


def digest_of(*parts: object) -> str:
    return hashlib.sha256('/'.join(map(str, parts)).encode()).hexdigest()


def head_for(run_id: str, seq: int, head: str, offset: int, signer: Signer = SIGNER) -> Seen:
    signature = (signer.key_id, signer.sign(run_id, seq, head))
    return Seen(0, 0, offset, seq, digest_of('head', run_id, seq), head, SIGNED_KIND, signature=signature)


@st.composite
def runs(draw: st.DrawFn, signed: bool | None = None, chained: bool = True, least: int = 1) -> Run:
    """A run of 1 to 30 records on the two topics, linked in seq order; signed heads when `signed`."""
    n = draw(st.integers(least, 30))
    run_id = 'run-' + draw(st.text('abcdef0123456789', min_size=1, max_size=8))
    salt = draw(st.integers(0, 2**32))
    middle = draw(st.lists(st.integers(0, 1), min_size=max(n - 2, 0), max_size=max(n - 2, 0)))
    topics = [0] if n == 1 else [0, *middle, 0]
    sign = draw(st.booleans()) if signed is None else signed
    points = (draw(st.sets(st.integers(1, n))) | {n}) if sign else set()
    heartbeats = draw(st.sets(st.integers(0, n - 1), max_size=3))
    gaps = st.integers(1, 3)
    offsets = [draw(st.integers(0, 5)), draw(st.integers(0, 5))]
    trail: list[Seen] = []
    heads: list[Seen] = []
    others: list[Seen] = []
    previous: str | None = None
    for seq, topic in enumerate(topics):
        if seq == n - 1:
            kind = 'run_completed'
        elif seq == 0:
            kind = 'run_started'
        else:
            kind = draw(st.sampled_from(STEP_KINDS if topic == 0 else TOOL_STATUSES))
        digest = digest_of(run_id, salt, seq)
        trail.append(Seen(topic, topic, offsets[topic], seq, digest, previous if chained else None, kind))
        offsets[topic] += draw(gaps)
        if seq in heartbeats:
            others.append(Seen(0, 0, offsets[0], 0, digest_of('beat', run_id, seq), None, 'run_heartbeat'))
            offsets[0] += draw(gaps)
        if seq + 1 in points:
            heads.append(head_for(run_id, seq + 1, digest, offsets[0]))
            offsets[0] += draw(gaps)
        previous = digest
    return Run(run_id, trail, heads, others, sign)


def verify(run: Run, seen: list[Seen] | None = None, keys: TrustedKeys | None = None) -> RunIntegrity:
    return verify_run(run.run_id, run.seen if seen is None else seen, keys)


def verdict(result: RunIntegrity) -> tuple[object, ...]:
    """Everything `verify_run` says, with the breaks in a fixed order."""
    breaks = sorted(result.breaks, key=lambda b: (b.seq, b.topic, b.partition, b.offset, b.problem, b.detail))
    return (
        result.chain,
        result.records,
        result.ended,
        result.signed_through,
        result.head,
        sorted(result.digests.items()),
        breaks,
        result.first_break,
    )


def problems(result: RunIntegrity) -> set[tuple[str, int]]:
    return {(b.problem, b.seq) for b in result.breaks}


def first(result: RunIntegrity) -> tuple[str, int]:
    found = result.first_break
    assert found is not None, 'no break found'
    return found.problem, found.seq


def chain_of(run: Run) -> str:
    """What an untouched run's chain reads as: a lone unsigned `run_started` carries no link at all."""
    return 'intact' if run.n > 1 or run.signed else 'unchained'


def keys_for(run: Run) -> TrustedKeys | None:
    """The trusted keys a signed run is checked against (an unsigned one is checked without)."""
    return KEYS if run.signed else None


# 1. An untouched run verifies, in any order.


@EXAMPLES
@given(run=runs(), with_keys=st.booleans(), data=st.data())
def test_an_untouched_run_verifies_in_any_order(run: Run, with_keys: bool, data: st.DataObject) -> None:
    keys = KEYS if with_keys and run.signed else None
    result = verify(run, keys=keys)
    assert result.breaks == []
    assert result.ok and result.first_break is None
    assert result.chain == chain_of(run)
    assert result.ended is True
    assert result.records == run.n
    assert result.signed_through == (run.n if keys is not None else None)
    assert result.head == (run.n - 1, run.trail[-1].digest)
    assert result.digests == {r.seq: r.digest for r in run.trail}
    shuffled = data.draw(st.permutations(run.seen))
    assert verdict(verify(run, shuffled, keys)) == verdict(result)


@EXAMPLES
@given(run=runs(signed=False, least=2))
def test_a_chained_run_without_signatures_is_unsigned_for_a_verifier_with_keys(run: Run) -> None:
    result = verify(run, keys=KEYS)
    assert result.chain == 'broken'
    assert result.signed_through == 0
    assert first(result) == ('unsigned', 0)
    assert len(result.breaks) == 1  # one break names where coverage ends, not one a record


# 2. Records from before the chain.


@EXAMPLES
@given(run=runs(signed=False, chained=False))
def test_a_run_without_links_or_heads_is_unchained(run: Run) -> None:
    result = verify(run)
    assert result.chain == 'unchained'
    assert result.breaks == []
    assert result.records == run.n
    assert result.ended is True
    assert result.signed_through is None
    assert result.head == (run.n - 1, run.trail[-1].digest)


# 3. Each tamper is named.


@EXAMPLES
@given(run=runs(least=2), data=st.data())
def test_an_altered_record_is_named_where_it_is(run: Run, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, run.n - 2))
    trail = list(run.trail)
    trail[k] = dataclasses.replace(trail[k], digest=digest_of('altered', k))
    result = verify(run, [*trail, *run.heads, *run.others], keys_for(run))
    assert result.chain == 'broken'
    assert first(result) == ('altered', k)
    first_break = result.first_break
    assert first_break is not None
    assert (first_break.topic, first_break.offset) == (
        ('step_events', 'tool_effects')[trail[k].topic],
        trail[k].offset,
    )


@EXAMPLES
@given(run=runs(least=3), data=st.data())
def test_a_dropped_record_is_missing_at_the_next(run: Run, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, run.n - 2))  # record k + 1 exists
    seen = [r for r in run.seen if r is not run.trail[k]]
    result = verify(run, seen)
    assert result.chain == 'broken'
    assert first(result) == ('missing', k + 1)
    assert result.records == run.n - 1
    if run.signed:
        checked = verify(run, seen, KEYS)
        assert ('missing', k + 1) in problems(checked)
        assert min(b.seq for b in checked.breaks) == k + 1


def test_a_dropped_record_under_a_signed_head_is_first_named_missing() -> None:
    trail: list[Seen] = []
    previous = None
    for seq, kind in enumerate(
        ('run_started', 'model_request_started', 'model_request_completed', 'run_completed')
    ):
        digest = digest_of('r', seq)
        trail.append(Seen(0, 0, seq * 10, seq, digest, previous, kind))
        previous = digest
    heads = [head_for('r', seq, trail[seq - 1].digest, seq * 10 - 5) for seq in (1, 2, 3, 4)]
    seen = [r for r in [*trail, *heads] if r is not trail[1]]
    result = verify_run('r', seen, KEYS)
    assert ('missing', 2) in problems(result)
    assert first(result) == ('missing', 2)


@EXAMPLES
@given(run=runs(least=2), data=st.data())
def test_two_swapped_records_are_reordered(run: Run, data: st.DataObject) -> None:
    topic = data.draw(st.sampled_from([t for t in (0, 1) if sum(r.topic == t for r in run.trail) >= 2]))
    indices = [i for i, r in enumerate(run.trail) if r.topic == topic]
    i, j = sorted(data.draw(st.lists(st.sampled_from(indices), min_size=2, max_size=2, unique=True)))
    trail = list(run.trail)
    trail[i], trail[j] = (
        dataclasses.replace(trail[i], offset=trail[j].offset),
        dataclasses.replace(trail[j], offset=trail[i].offset),
    )
    result = verify(run, [*trail, *run.heads, *run.others], keys_for(run))
    assert result.chain == 'broken'
    assert {b.problem for b in result.breaks} == {'reordered'}
    assert first(result) == ('reordered', i)  # the earlier record now stands after the later one
    assert all(i <= b.seq < j for b in result.breaks)


@EXAMPLES
@given(run=runs(), data=st.data())
def test_a_second_record_for_a_seq_that_links_to_nothing_is_inserted(run: Run, data: st.DataObject) -> None:
    seq = data.draw(st.integers(0, run.n - 1))
    topic = data.draw(st.integers(0, 1))
    link = digest_of('nowhere', seq)
    forged = Seen(topic, topic, run.next_offset(topic), seq, digest_of('forged', seq), link, 'completed')
    result = verify(run, [*run.seen, forged], keys_for(run))
    assert result.chain == 'broken'
    assert ('inserted', seq) in problems(result)
    assert {b.problem for b in result.breaks} <= {'inserted', 'reordered'}
    assert result.digests == {r.seq: r.digest for r in run.trail}  # the chain keeps the written record
    assert first(result)[1] == seq


@EXAMPLES
@given(run=runs(signed=True), topic=st.integers(0, 1))
def test_a_forged_record_with_a_valid_link_but_no_signature_is_unsigned(run: Run, topic: int) -> None:
    forged = Seen(
        topic,
        topic,
        run.next_offset(topic),
        run.n,
        digest_of('forged'),
        run.trail[-1].digest,
        'run_completed',
    )
    result = verify(run, [*run.seen, forged], KEYS)
    assert result.chain == 'broken'
    assert result.signed_through == run.n
    assert first(result) == ('unsigned', run.n)
    assert len(result.breaks) == 1
    assert verify(run, [*run.seen, forged]).ok  # the chain alone cannot tell


@EXAMPLES
@given(run=runs(signed=True))
def test_heads_signed_by_an_untrusted_key_are_named(run: Run) -> None:
    # The final head, over everything, signed by a key the verifier does not have.
    final = run.heads[-1]
    replaced = head_for(run.run_id, final.seq, final.prev_hash or '', final.offset, OTHER)
    result = verify(run, [*run.trail, *run.heads[:-1], replaced, *run.others], KEYS)
    covered = max((h.seq for h in run.heads[:-1]), default=0)
    assert result.signed_through == covered
    assert first(result) == ('unknown_key', covered)
    assert len(result.breaks) == 1
    # Every head by the untrusted key: nothing is covered.
    untrusted = TrustedKeys({OTHER.key_id: OTHER_PRIVATE.public_key()})
    alone = verify(run, keys=untrusted)
    assert alone.signed_through == 0
    assert first(alone) == ('unknown_key', 0)


@EXAMPLES
@given(run=runs(signed=True), data=st.data(), flip=st.integers(0, 63))
def test_a_head_with_altered_signature_bytes_is_a_bad_signature(
    run: Run, data: st.DataObject, flip: int
) -> None:
    """A bad signature on the head that covers the run is named; one below a valid head is implied by it.

    Heads are verified highest first, and a head stating a prefix of the chain under a valid one
    is not verified (it covers nothing more): the records are covered either way.
    """
    index = data.draw(st.integers(0, len(run.heads) - 1))
    head = run.heads[index]
    assert head.signature is not None
    key, signature = head.signature
    raw = bytearray(base64.b64decode(signature))
    raw[flip] ^= 0x01
    altered = dataclasses.replace(head, signature=(key, base64.b64encode(bytes(raw)).decode()))
    heads = [altered if h is head else h for h in run.heads]
    result = verify(run, [*run.trail, *heads, *run.others], KEYS)
    bad = [b for b in result.breaks if b.problem == 'bad_signature']
    highest = max(h.seq for h in run.heads)
    if head.seq < highest:  # below the valid head over the end: implied, not verified
        assert bad == [] and result.ok and result.signed_through == run.n
        return
    assert result.chain == 'broken'
    assert [(b.seq, b.topic, b.offset) for b in bad] == [(head.seq, 'step_events', head.offset)]
    valid = [h.seq for h in run.heads if h is not head]
    assert result.signed_through == max(valid, default=0)
    assert {b.problem for b in result.breaks} <= {'bad_signature', 'unsigned'}


@pytest.mark.parametrize(
    'signature',
    [None, (SIGNER.key_id, 'not base64!'), (SIGNER.key_id, ''), (SIGNER.key_id, 'é')],
    ids=['none', 'not-base64', 'empty', 'not-ascii'],
)
def test_a_head_without_a_valid_signature_is_a_bad_signature(signature: tuple[str, str] | None) -> None:
    first_record = Seen(0, 0, 0, 0, digest_of('only'), None, 'run_completed')
    head = Seen(0, 0, 1, 1, digest_of('head'), first_record.digest, SIGNED_KIND, signature=signature)
    result = verify_run('r', [first_record, head], KEYS)
    assert ('bad_signature', 1) in problems(result)
    assert result.signed_through == 0


@EXAMPLES
@given(run=runs(), data=st.data())
def test_a_record_placed_as_another_runs_is_inserted(run: Run, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, run.n - 1))
    misplaced = dataclasses.replace(run.trail[k], placed=False)
    trail = [misplaced if r is run.trail[k] else r for r in run.trail]
    result = verify(run, [*trail, *run.heads, *run.others], keys_for(run))
    assert not result.ok and result.chain != 'intact'  # 'unchained' when no other record links
    assert ('inserted', k) in problems(result)
    # Or a copy of it keyed as another run's, beside the written record.
    extra = dataclasses.replace(misplaced, offset=run.next_offset(misplaced.topic), partition=9)
    beside = verify(run, [*run.seen, extra], keys_for(run))
    assert [(b.problem, b.seq, b.partition) for b in beside.breaks] == [('inserted', k, 9)]


@EXAMPLES
@given(run=runs(), data=st.data())
def test_a_resent_duplicate_is_not_a_break(run: Run, data: st.DataObject) -> None:
    ks = data.draw(st.sets(st.integers(0, run.n - 1), min_size=1, max_size=3))
    seen = list(run.seen)
    for k in sorted(ks):
        record = run.trail[k]
        seen.append(
            dataclasses.replace(record, offset=1 + max(r.offset for r in seen if r.topic == record.topic))
        )
    keys = keys_for(run)
    result = verify(run, seen, keys)
    assert result.breaks == []
    assert result.chain == chain_of(run)
    assert result.records == run.n  # duplicates once
    assert result.signed_through == (run.n if keys else None)
    assert verdict(result) == verdict(verify(run, keys=keys))
    assert verdict(verify(run, data.draw(st.permutations(seen)), keys)) == verdict(result)


@EXAMPLES
@given(run=runs(), data=st.data())
def test_the_breaks_of_a_tampered_run_do_not_depend_on_the_order_read(run: Run, data: st.DataObject) -> None:
    trail = list(run.trail)
    altered = data.draw(st.none() | st.integers(0, run.n - 1))
    if altered is not None:
        trail[altered] = dataclasses.replace(trail[altered], digest=digest_of('altered', altered))
    dropped = data.draw(st.none() | st.integers(0, run.n - 1))
    if dropped is not None:
        del trail[dropped]
    seen = [*trail, *run.heads, *run.others]
    # A second record for a seq, but not right after the gap, at an offset no record of either topic has.
    seqs = [seq for seq in range(run.n) if dropped is None or seq != dropped + 1]
    if data.draw(st.booleans()):
        seq = data.draw(st.sampled_from(seqs))
        offset = 1 + max(r.offset for r in run.seen)
        seen.append(Seen(1, 1, offset, seq, digest_of('forged', seq), digest_of('x'), 'completed'))
    keys = keys_for(run)
    result = verify(run, seen, keys)
    assert verdict(verify(run, data.draw(st.permutations(seen)), keys)) == verdict(result)


@pytest.mark.parametrize('second', ['resent', 'forged'])
def test_where_a_break_is_named_does_not_depend_on_the_order_read(second: str) -> None:
    zero = Seen(0, 0, 0, 0, digest_of('d', 0), None, 'run_started')
    two = Seen(0, 0, 2, 2, digest_of('d', 2), digest_of('d', 1), 'run_completed')
    if second == 'resent':
        other = dataclasses.replace(two, offset=5)
    else:
        other = Seen(1, 1, 7, 2, digest_of('forged'), digest_of('x'), 'completed')
    forward = verify_run('r', [zero, two, other], None)
    backward = verify_run('r', [other, two, zero], None)
    assert ('missing', 2) in problems(forward) and problems(forward) == problems(backward)
    assert sorted(forward.breaks, key=repr) == sorted(backward.breaks, key=repr)


# 4. Trusted keys from PEM files.


def test_trusted_keys_load_a_file_of_several_public_keys(tmp_path: Path) -> None:
    other = Signer.from_pem(private_pem(Ed25519PrivateKey.generate()))
    path = tmp_path / 'auditors.pem'
    path.write_bytes(public_pem(SIGNER) + b'\n' + public_pem(other))
    keys = TrustedKeys.load(path)
    assert set(keys.keys) == {SIGNER.key_id, other.key_id}
    assert key_id(keys.keys[SIGNER.key_id]) == SIGNER.key_id
    signature = SIGNER.sign('r', 3, 'ab' * 32)
    assert keys.verify(SIGNER.key_id, signature, statement('r', 3, 'ab' * 32)) is True
    assert keys.verify(SIGNER.key_id, signature, statement('r', 4, 'ab' * 32)) is False
    assert keys.verify(other.key_id, signature, statement('r', 3, 'ab' * 32)) is False
    assert keys.verify('ed25519:' + '0' * 32, signature, statement('r', 3, 'ab' * 32)) is None
    assert TrustedKeys.load(str(path)).keys.keys() == keys.keys.keys()


def test_trusted_keys_load_a_directory_of_pem_files(tmp_path: Path) -> None:
    others = [Signer.from_pem(private_pem(Ed25519PrivateKey.generate())) for _ in range(2)]
    (tmp_path / 'a.pem').write_bytes(public_pem(SIGNER))
    (tmp_path / 'b.pem').write_bytes(public_pem(others[0]) + public_pem(others[1]))
    (tmp_path / 'notes.txt').write_text('not a key, and not a .pem file')
    keys = TrustedKeys.load(tmp_path)
    assert set(keys.keys) == {SIGNER.key_id, others[0].key_id, others[1].key_id}


def test_trusted_keys_refuse_an_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r'no \.pem file'):
        TrustedKeys.load(tmp_path)


@pytest.mark.parametrize(
    'content',
    [
        private_pem(PRIVATE),
        b'garbage, not PEM at all\n',
        b'',
        b'-----BEGIN PUBLIC KEY-----\nbm90IGEga2V5\n-----END PUBLIC KEY-----\n',
        b'-----BEGIN PUBLIC KEY-----\n!!!!\n-----END PUBLIC KEY-----\n',
        rsa.generate_private_key(65537, 1024)
        .public_key()
        .public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo),
    ],
    ids=['private-key', 'garbage', 'empty', 'garbage-in-a-public-block', 'not-base64', 'rsa-public-key'],
)
@pytest.mark.parametrize('in_directory', [False, True], ids=['file', 'directory'])
def test_trusted_keys_name_a_file_that_holds_something_else(
    tmp_path: Path, content: bytes, in_directory: bool
) -> None:
    good = tmp_path / 'a-good.pem'
    good.write_bytes(public_pem(SIGNER))
    bad = tmp_path / 'b-bad.pem'
    bad.write_bytes(content)
    with pytest.raises(ValueError) as raised:
        TrustedKeys.load(tmp_path if in_directory else bad)
    assert str(bad) in str(raised.value)


def test_trusted_keys_name_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / 'missing.pem'
    with pytest.raises(ValueError, match=r'missing\.pem'):
        TrustedKeys.load(missing)


def test_trusted_keys_name_a_file_with_a_private_key_after_a_public_key(tmp_path: Path) -> None:
    path = tmp_path / 'leaked.pem'
    path.write_bytes(public_pem(SIGNER) + private_pem(PRIVATE))
    with pytest.raises(ValueError, match=r'leaked\.pem'):
        TrustedKeys.load(path)


# 5. Only Ed25519 keys sign.


def test_a_signer_is_an_ed25519_key() -> None:
    signer = Signer.from_pem(private_pem(PRIVATE))
    assert signer.key_id == key_id(PRIVATE.public_key()) == SIGNER.key_id
    assert signer.key_id.startswith('ed25519:') and len(signer.key_id) == len('ed25519:') + 32
    assert signer.sign('r', 1, 'ab' * 32) == SIGNER.sign('r', 1, 'ab' * 32)  # deterministic


@pytest.mark.parametrize(
    ('pem', 'named'),
    [
        (private_pem(rsa.generate_private_key(65537, 1024)), 'RSA'),
        (private_pem(ec.generate_private_key(ec.SECP256R1())), 'EC'),
        (private_pem(ed448.Ed448PrivateKey.generate()), 'Ed448'),
        (public_pem(SIGNER), 'not an unencrypted PEM private key'),
        (b'garbage', 'not an unencrypted PEM private key'),
        (
            PRIVATE.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, BestAvailableEncryption(b'secret')),
            'not an unencrypted PEM private key',
        ),
    ],
    ids=['rsa', 'ec', 'ed448', 'public-key', 'garbage', 'encrypted'],
)
def test_a_signer_refuses_any_other_key(pem: bytes, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Signer.from_pem(pem)


def test_break_as_json() -> None:
    found = Break('missing', 3, 'tool_effects', 2, 17, 'records 2 to 2 of the run are not in the log')
    assert found.as_json() == {
        'problem': 'missing',
        'seq': 3,
        'topic': 'tool_effects',
        'partition': 2,
        'offset': 17,
        'detail': 'records 2 to 2 of the run are not in the log',
        'answer': None,
    }
