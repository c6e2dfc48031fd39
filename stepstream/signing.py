"""Signed chain heads: what a writer signs, how, and how a verifier checks it (Ed25519).

A writer with a signing key (`STEPSTREAM_SIGNING_KEY` or its `_FILE`: a PEM Ed25519 private
key) appends a `chain_signed` step event at each durability point where its run's chain moved:
the event's `prev_hash` is the head it signs, its `seq` the number of records that head covers,
and its metadata carries the signature (`SIGNATURE`) and the key's id (`SIGNING_KEY`). Ed25519
signatures are deterministic, so a durable-execution engine that writes the event again writes
the same bytes. The statement signed is `statement(run_id, seq, head)`; the head fixes every
record before it, so one signature covers the run's trail up to it (docs/decisions/0049).

`cryptography` is imported on first use: a writer without a key never pays for it.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    from stepstream.secret import SecretStr

SIGNED_KIND = 'chain_signed'
"""The step event kind of a signed chain head: not part of the run's trail (it takes no `seq`)."""
SIGNATURE = 'stepstream.signature'
"""Metadata key of a `chain_signed` event: the Ed25519 signature, base64."""
SIGNING_KEY = 'stepstream.signing_key'
"""Metadata key of a `chain_signed` event: the id of the key that signed (`key_id`)."""
_DOMAIN = b'stepstream chain head v1\x00'


def statement(run_id: str, seq: int, head: str) -> bytes:
    """The bytes a writer signs: run `run_id`'s first `seq` records end with the record hashed `head`."""
    return b'%s%s\x00%d\x00%s' % (_DOMAIN, run_id.encode(), seq, head.encode())


def key_id(public_key: Ed25519PublicKey) -> str:
    """A public key's id as the log names it: `ed25519:`, then SHA-256 of its raw bytes (16 bytes, hex)."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    raw = public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return 'ed25519:' + hashlib.sha256(raw).hexdigest()[:32]


@dataclass(frozen=True)
class Signer:
    """A writer's signing key and its id."""

    private_key: Ed25519PrivateKey
    key_id: str

    def sign(self, run_id: str, seq: int, head: str) -> str:
        """The signature (base64) of `statement(run_id, seq, head)`."""
        return base64.b64encode(self.private_key.sign(statement(run_id, seq, head))).decode()

    @staticmethod
    def from_pem(pem: bytes) -> Signer:
        """A signer of a PEM (PKCS#8) Ed25519 private key; `ValueError` for anything else."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        try:
            key = load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f'not an unencrypted PEM private key ({exc})') from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(
                f'a {type(key).__name__.removesuffix("PrivateKey") or "non-Ed25519"} key, not Ed25519'
            )
        return Signer(key, key_id(key.public_key()))

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def from_secret(secret: SecretStr) -> Signer:
        """The signer of a `signing_key` setting (PEM text), parsed once per key."""
        return Signer.from_pem(secret.get_secret_value().encode())


@dataclass(frozen=True)
class TrustedKeys:
    """The public keys a verifier trusts, by id."""

    keys: dict[str, Ed25519PublicKey]

    def verify(self, signing_key: str, signature: str, message: bytes) -> bool | None:
        """True for a valid signature by a trusted key, False for an invalid one, None for an unknown key."""
        from cryptography.exceptions import InvalidSignature

        key = self.keys.get(signing_key)
        if key is None:
            return None
        try:
            key.verify(base64.b64decode(signature, validate=True), message)
        except (InvalidSignature, ValueError):
            return False
        return True

    @staticmethod
    def load(path: str | Path) -> TrustedKeys:
        """The Ed25519 public keys in a PEM file (one or more keys), or in the `*.pem` files of a directory.

        `ValueError` names a file that holds something else, and a path with no key at all.
        """
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        from cryptography.hazmat.primitives.serialization import load_pem_public_key

        root = Path(path)
        files = sorted(root.glob('*.pem')) if root.is_dir() else [root]
        keys: dict[str, Ed25519PublicKey] = {}
        for file in files:
            try:
                text = file.read_bytes()
            except OSError as exc:
                raise ValueError(f'{file}: {exc.strerror}') from None
            if b'PRIVATE KEY-----' in text:
                raise ValueError(f'{file} holds a private key: give verifiers public keys only')
            blocks = [
                b for b in text.split(b'-----END PUBLIC KEY-----') if b'-----BEGIN PUBLIC KEY-----' in b
            ]
            if not blocks:
                raise ValueError(f'{file} holds no PEM public key (BEGIN PUBLIC KEY)')
            for block in blocks:
                try:
                    key = load_pem_public_key(block.strip() + b'\n-----END PUBLIC KEY-----\n')
                except ValueError as exc:
                    raise ValueError(f'{file}: not a PEM public key ({exc})') from None
                if not isinstance(key, Ed25519PublicKey):
                    raise ValueError(f'{file}: a {type(key).__name__} key, not Ed25519')
                keys[key_id(key)] = key
        if not keys:
            raise ValueError(f'{root} holds no .pem file')
        return TrustedKeys(keys)


def public_pem(signer: Signer) -> bytes:
    """The PEM public key of a signer: what its operator hands auditors (`stepstream audit key`)."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return signer.private_key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
