"""Checkpoints: signed statements of what the log held at a moment, kept out of its administrator's reach.

A checkpoint names partitions by topic role and number (`step_events/3`), never by topic name,
so a copy of the topics under another prefix verifies against it. Per partition: the offsets it
started and ended at, how many records it held, and their rolling digest (`Digest`), with marks
every `MARK_EVERY` records, and (format 2) the length and hash of its last record; per run: the
`seq` and hash of the newest record of its trail, and where that record stood, and (format 2) the
answers beside its trail it saw, in log order (`SawAnswer`: decisions, resolutions, marks). Format
1 checkpoints, which list no answers, still load: nothing is said of answers against them. Signed
with the operator's key (`STEPSTREAM_SIGNING_KEY`): the body is canonical JSON (sorted keys, no
spaces), and the signature covers it with a domain prefix.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from stepstream.audit._answers import SawAnswer, answers_of
from stepstream.audit._read import Expected, read_partitions
from stepstream.audit._records import NOT_THE_TRAIL, TOPIC_NAMES
from stepstream.settings import Settings
from stepstream.signing import Signer, TrustedKeys

FORMAT = 2
"""2 adds each run's answers and each partition's last record; 1 still loads."""
_DOMAIN = b'stepstream checkpoint v1\x00'
S3_PREFIX = 'audit/checkpoints/'
"""Where `audit checkpoint --s3` puts checkpoints in the media bucket (the media sweep never lists it)."""


@dataclass(frozen=True, slots=True)
class PartitionState:
    """One topic partition as the checkpoint saw it."""

    topic: str
    partition: int
    start: int
    end: int
    count: int
    digest: str
    marks: tuple[tuple[int, int, str], ...]
    last: tuple[int, str] | None = None
    """Its last record's length and SHA-256 (`Digest.last_record`); None in format 1 or when empty."""


@dataclass(frozen=True, slots=True)
class RunHead:
    """The newest record of a run's trail the checkpoint saw: its `seq`, its hash, where it stood."""

    seq: int
    digest: str
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A signed statement of the log at `taken_at`."""

    taken_at: str
    partitions: tuple[PartitionState, ...]
    runs: dict[str, RunHead]
    signing_key: str
    signature: str
    answers: dict[str, tuple[SawAnswer, ...]] | None = None
    """Each run's answers, in log order; None for a format 1 checkpoint, which does not list them."""

    @property
    def format(self) -> int:
        """1 for a checkpoint without answers, `FORMAT` otherwise."""
        return 1 if self.answers is None else FORMAT

    def signed(self, signer: Signer) -> Checkpoint:
        """The checkpoint signed by `signer` (its key id and signature replaced)."""
        unsigned = replace(self, signing_key=signer.key_id, signature='')
        signature = signer.private_key.sign(_DOMAIN + _canonical(_body(unsigned)))
        return replace(unsigned, signature=base64.b64encode(signature).decode())

    def expected(self) -> dict[tuple[str, int], Expected]:
        """What it saw of each topic partition, for `read_partitions`."""
        return {(p.topic, p.partition): Expected(p.start, p.count, p.marks, p.last) for p in self.partitions}

    def known(self) -> dict[tuple[str, int], set[str]]:
        """By topic role and partition, the hashes of the records it names: runs' newest, answers."""
        known: dict[tuple[str, int], set[str]] = {}
        for head in self.runs.values():
            known.setdefault((head.topic, head.partition), set()).add(head.digest)
        for answers in (self.answers or {}).values():
            for answer in answers:
                known.setdefault((answer.topic, answer.partition), set()).add(answer.digest)
        return known

    def to_json(self) -> str:
        """The checkpoint file's text."""
        return json.dumps(
            {**_body(self), 'signing_key': self.signing_key, 'signature': self.signature}, indent=1
        )

    @staticmethod
    def load(path: str | Path, keys: TrustedKeys) -> Checkpoint:
        """A checkpoint file whose signature is valid by one of `keys`; `ValueError` says what is wrong."""
        try:
            raw = json.loads(Path(path).read_text())
            if raw.get('stepstream_checkpoint') not in (1, FORMAT):
                raise ValueError(f'not a stepstream checkpoint of format 1 to {FORMAT}')
            checkpoint = Checkpoint(
                taken_at=raw['taken_at'],
                partitions=tuple(
                    PartitionState(
                        p['topic'],
                        p['partition'],
                        p['start'],
                        p['end'],
                        p['count'],
                        p['digest'],
                        tuple((m[0], m[1], m[2]) for m in p['marks']),
                        (p['last'][0], p['last'][1]) if p.get('last') else None,
                    )
                    for p in raw['partitions']
                ),
                runs={run_id: RunHead(*head) for run_id, head in raw['runs'].items()},
                signing_key=raw['signing_key'],
                signature=raw['signature'],
                answers=None
                if raw['stepstream_checkpoint'] == 1
                else {
                    run_id: tuple(SawAnswer(*answer) for answer in answers)
                    for run_id, answers in raw['answers'].items()
                },
            )
        except OSError as exc:
            raise ValueError(f'{path}: {exc.strerror}') from None
        except (KeyError, TypeError, IndexError, json.JSONDecodeError) as exc:
            raise ValueError(f'{path} is not a readable checkpoint ({exc!r})') from None
        valid = keys.verify(
            checkpoint.signing_key, checkpoint.signature, _DOMAIN + _canonical(_body(checkpoint))
        )
        if valid is None:
            raise ValueError(
                f'{path} is signed by {checkpoint.signing_key}, which is not among the trusted keys'
            )
        if not valid:
            raise ValueError(f'{path}: its signature is not valid (the file was changed after it was signed)')
        return checkpoint


def _body(checkpoint: Checkpoint) -> dict[str, Any]:
    """What is signed: a format 1 checkpoint's body exactly as format 1 wrote it."""
    body: dict[str, Any] = {
        'stepstream_checkpoint': checkpoint.format,
        'taken_at': checkpoint.taken_at,
        'partitions': [
            {
                'topic': p.topic,
                'partition': p.partition,
                'start': p.start,
                'end': p.end,
                'count': p.count,
                'digest': p.digest,
                'marks': [list(m) for m in p.marks],
                **({} if checkpoint.answers is None else {'last': list(p.last) if p.last else None}),
            }
            for p in checkpoint.partitions
        ],
        'runs': {
            run_id: [h.seq, h.digest, h.topic, h.partition, h.offset]
            for run_id, h in sorted(checkpoint.runs.items())
        },
    }
    if checkpoint.answers is not None:
        body['answers'] = {
            run_id: [answer.as_list() for answer in answers]
            for run_id, answers in sorted(checkpoint.answers.items())
        }
    return body


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(',', ':'), ensure_ascii=True).encode()


async def take_checkpoint(settings: Settings, signer: Signer) -> Checkpoint:
    """Read the whole log now and sign what it holds."""
    partitions: list[PartitionState] = []
    runs: dict[str, RunHead] = {}
    answers: dict[str, tuple[SawAnswer, ...]] = {}
    async for read in read_partitions(settings):
        for topic, digest in sorted(read.digests.items()):
            start = digest.start if digest.start is not None else digest.end
            partitions.append(
                PartitionState(
                    topic,
                    read.partition,
                    start,
                    digest.end,
                    digest.count,
                    digest.value.hex(),
                    tuple(digest.marks),
                    digest.last_record() if digest.count else None,
                )
            )
        for run_id, seen in read.runs.items():
            trail = [
                s
                for s in seen
                if s.placed and not s.answers and s.kind not in (*NOT_THE_TRAIL, 'chain_signed')
            ]
            if trail:
                top = max(trail, key=lambda s: (s.seq, s.offset))
                runs[run_id] = RunHead(top.seq, top.digest, TOPIC_NAMES[top.topic], top.partition, top.offset)
            held = answers_of(seen)
            if held:
                answers[run_id] = tuple(SawAnswer.of(s) for s in held)
    unsigned = Checkpoint(datetime.now(UTC).isoformat(), tuple(partitions), runs, signer.key_id, '', answers)
    return unsigned.signed(signer)


async def put_checkpoint_s3(settings: Settings, checkpoint: Checkpoint) -> str:
    """Put the checkpoint in the media bucket under `S3_PREFIX`, never over an existing object; its key.

    Object lock is the bucket's: with a default retention set on the bucket (S3, MinIO, Ceph), the
    object cannot be deleted or overwritten until it expires, whoever asks (docs/audit.md).
    """
    import obstore

    from stepstream.media import S3MediaStore

    name = f'{S3_PREFIX}{checkpoint.taken_at.replace(":", "").replace("+00:00", "Z")}.json'
    store = S3MediaStore.from_settings(settings.media)
    await obstore.put_async(store.object_store, name, checkpoint.to_json().encode(), mode='create')
    return name
