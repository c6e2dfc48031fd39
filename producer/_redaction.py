"""Redaction: secrets an agent hands a tool never reach the log (docs/decisions/0047-redaction.md).

A `Redaction` policy is applied by the capability before anything is encoded or offloaded: to
every message of a snapshot (tool-call arguments, tool returns, user prompts, instructions,
responses: all of a message's JSON), to the stamped fields of a snapshot's patch, and to the
free text of its records (errors, effect summaries, idempotency keys, metadata). Two rules, on by
default:

- **Secret-named keys, at any depth.** A value whose key names a secret is replaced whole,
  whatever it is (a string, a number, a nested object). A key names a secret when, lowercased and
  without its separators, it ends with one of `SECRET_KEYS` (`api_key`, `X-Api-Key`,
  `github_token`, `DB_PASSWORD`, `client_secret`, `Authorization`, ...; not `max_tokens`). Tool
  arguments given as a JSON string are read as JSON.
- **Well-known secret formats, in any text**: `PATTERNS` (private key blocks, cloud and SaaS
  access keys, JSON web tokens, a password in a URL, bearer and basic credentials, `password=...`
  assignments). Only the secret itself is replaced; the rest of the text is kept. What a keyword
  leads (`Bearer`, `Basic`, `token`, `password=`) must also have a credential's shape (`SHAPES`:
  a random token, base64 of `user:password`, a value with a digit or a symbol), so prose about
  authentication ("basic authentication of token refreshes") comes back byte for byte.

A replaced value becomes a marker that says so: `[redacted]`, or `[redacted hmac-sha256:<16 hex>]`
with a hash key (`STEPSTREAM_REDACTION_HASH_KEY`), so two redacted values can be compared without
being revealed. Binary content (images, audio, documents) is never read. A message's JSON is
searched for a secret-named key or a pattern first: one regular expression over its bytes, and
nothing else when neither is there (the common case, and the hot path's).

What a secret looks like (`SECRET_KEYS`, `PATTERNS`, `SHAPES` and the expressions made of them) is
`_secrets.py`'s; this module holds the policy (`Redaction`), its markers, and the walk over values.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

from stepstream.producer._secrets import (
    PATTERNS,
    SECRET_KEYS,
    SHAPES,
    compile_any,
    compile_re2,
    key_suffixes,
    normalized,
    quick_test,
)

REDACTED: Final = '[redacted]'
"""The marker of a redacted value (without a hash key); also what a custom redactor returns to redact."""

REDACTION_KEY: Final = 'stepstream.redaction'
"""The `run_started` metadata key naming the policy that wrote the run (`Redaction.label`)."""

Redactor = Callable[[str, object], object]
"""A custom rule, like pydantic-ai-harness's `AuditLog` redactor: `(key, value) -> value`.

Called for every keyed value at any depth of a message's JSON (after the secret-key rule) and for
each metadata entry: return `value` itself to keep it, `REDACTED` to replace it with the marker,
or anything else (JSON-compatible) to write that instead.
"""

_JSON_TEXT = re.compile(r'\s*[\[{]')


def _is_marker(value: object) -> bool:
    """Whether `value` is a marker already.

    Redacting twice changes nothing: a continued run's history holds its parent's markers.
    """
    return isinstance(value, str) and value.startswith('[redacted')


@functools.lru_cache(maxsize=16)
def _from_settings(mode: str, keys: str | None, hash_key: str | None) -> Redaction:
    """`Redaction.from_settings`, made once per distinct settings (its patterns compile once)."""
    if mode == 'off':
        return Redaction.off()
    extra = [k.strip() for k in (keys or '').split(',') if k.strip()]
    policy = Redaction(hash_key=hash_key.encode() if hash_key is not None else None)
    return policy.extend(keys=extra) if extra else policy


@dataclass(frozen=True)
class Redaction:
    r"""What the capability redacts before it writes (docs/decisions/0047-redaction.md).

    ```python
    StepPersistence(log=log)                                            # the default policy
    StepPersistence(log=log, redaction=Redaction().extend(keys=['pin'], patterns=[r'\bACME-\d{8}\b']))
    StepPersistence(log=log, redaction=Redaction(redactor=my_rule))     # the defaults, then my rule
    StepPersistence(log=log, redaction=Redaction.off())                # nothing redacted (see the docs)
    ```
    """

    keys: tuple[str, ...] = SECRET_KEYS
    """Key endings that name a secret (compared lowercased, letters and digits only)."""
    patterns: tuple[str, ...] = PATTERNS
    """Regular expressions of secrets in text; where one has a group, only the group is replaced."""
    redactor: Redactor | None = None
    """A custom rule for keyed values, after the secret-key rule (`Redactor`)."""
    hash_key: bytes | None = field(default=None, repr=False)
    """With a key, a marker carries the value's HMAC-SHA256 (16 hex digits): equal values compare equal."""
    enabled: bool = True
    """False: nothing is redacted (`Redaction.off()`)."""

    def __post_init__(self) -> None:
        suffixes = key_suffixes(self.keys)
        object.__setattr__(self, 'keys', suffixes)
        if not self.enabled:  # nothing to match: nothing compiled
            for name in ('_texts', '_any_text', '_quick'):
                object.__setattr__(self, name, None)
            return
        # Each pattern alone is needed only once a text matches one of them: compiled then (`_each`).
        object.__setattr__(self, '_texts', None)
        object.__setattr__(self, '_any_text', compile_any(self.patterns))
        object.__setattr__(self, '_quick', quick_test(suffixes, self.patterns))  # the JSON's first search

    @classmethod
    def off(cls) -> Redaction:
        """A policy that redacts nothing: every secret an agent handles is written as it is."""
        return cls(enabled=False)

    @classmethod
    def from_settings(cls, settings: Any) -> Redaction:
        """The policy of `STEPSTREAM_REDACTION` (`default` or `off`), `_KEYS` and `_HASH_KEY`."""
        hash_key = settings.security.redaction_hash_key
        secret = hash_key.get_secret_value() if hash_key is not None else None
        return _from_settings(settings.security.redaction, settings.security.redaction_keys, secret)

    def extend(
        self, *, keys: Iterable[str] = (), patterns: Iterable[str] = (), redactor: Redactor | None = None
    ) -> Redaction:
        """A copy with more secret key names, more patterns, and (replacing any) a custom rule."""
        return replace(
            self,
            keys=(*self.keys, *keys),
            patterns=(*self.patterns, *patterns),
            redactor=redactor if redactor is not None else self.redactor,
        )

    @property
    def label(self) -> str:
        """What the run's `run_started` says of the policy (`REDACTION_KEY`)."""
        if not self.enabled:
            return 'off'
        default = self.keys == key_suffixes(SECRET_KEYS) and self.patterns == PATTERNS
        name = 'default' if default else 'extended'
        return f'{name}{"+redactor" if self.redactor is not None else ""}{"+hmac" if self.hash_key else ""}/2'

    # -- applying it ---------------------------------------------------------------------------

    def message_json(self, raw: bytes) -> bytes | None:
        """A message's JSON with its secrets replaced, or None when it holds none (left as it is)."""
        if not self.enabled:
            return None
        quick = self._quick  # type: ignore[attr-defined]
        if self.redactor is None and (quick is None or quick.search(raw) is None):
            return None
        value, changed = self._walk(json.loads(raw))
        return json.dumps(value, ensure_ascii=False, separators=(',', ':')).encode() if changed else None

    def value(self, value: Any) -> Any:
        """A JSON-like value (dicts, lists, strings, ...) with its secrets replaced."""
        return self._walk(value)[0] if self.enabled else value

    def text(self, text: str | None) -> str | None:
        """Free text (an error, a summary) with the secrets of known formats replaced."""
        if text is None or not self.enabled:
            return text
        return self._text(text)[0]

    def metadata(self, entries: Mapping[str, str]) -> dict[str, str]:
        """Metadata with secret-named entries replaced, and the rest's text redacted."""
        if not self.enabled:
            return dict(entries)
        return {k: str(v) for k, v in self._walk(dict(entries))[0].items()}

    def marker(self, value: object) -> str:
        """What replaces `value`: `[redacted]`, with its keyed hash when the policy has a key."""
        if self.hash_key is None:
            return REDACTED
        canonical = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        digest = hmac.new(self.hash_key, canonical.encode('utf-8', 'surrogatepass'), hashlib.sha256)
        return f'[redacted hmac-sha256:{digest.hexdigest()[:16]}]'

    def _secret_key(self, key: str) -> bool:
        return normalized(key).endswith(self.keys) if self.keys else False

    def _walk(self, value: Any) -> tuple[Any, bool]:
        """`value` with its secrets replaced, and whether anything was."""
        if isinstance(value, str):
            return self._string(value)
        if isinstance(value, list):
            changed = False
            items = []
            for item in value:
                new, hit = self._walk(item)
                items.append(new)
                changed = changed or hit
            return (items, True) if changed else (value, False)
        if not isinstance(value, dict):
            return value, False
        binary = value.get('kind') == 'binary'  # a BinaryContent: its base64 `data` is never read
        changed = False
        out: dict[str, Any] = {}
        for key, item in value.items():
            if binary and key == 'data':
                out[key] = item
                continue
            if self._secret_key(key) and item not in (None, '') and not _is_marker(item):
                out[key], changed = self.marker(item), True
                continue
            if self.redactor is not None:
                ruled = self.redactor(key, item)
                if ruled is not item:
                    out[key], changed = (self.marker(item) if ruled == REDACTED else ruled), True
                    continue
            new, hit = self._walk(item)
            out[key] = new
            changed = changed or hit
        return (out, True) if changed else (value, False)

    def _string(self, text: str) -> tuple[str, bool]:
        """A string value: read as JSON when it is a JSON object or list (tool arguments often are)."""
        if _JSON_TEXT.match(text):
            try:
                parsed = json.loads(text)
            except ValueError:
                pass
            else:
                if isinstance(parsed, dict | list):
                    new, changed = self._walk(parsed)
                    return (json.dumps(new, ensure_ascii=False), True) if changed else (text, False)
        return self._text(text)

    def _text(self, text: str) -> tuple[str, bool]:
        any_text = self._any_text  # type: ignore[attr-defined]
        if any_text is None or any_text.search(text) is None:  # one pass for every pattern
            return text, False
        original = text
        for pattern, shape in self._each():
            if pattern.search(text) is not None:
                text = self._substitute(pattern, shape, text)
        return text, text != original

    def _each(self) -> list[tuple[Any, Callable[[str], bool] | None]]:
        """Each pattern compiled alone, with the shape its group must have (`SHAPES`)."""
        texts = self._texts  # type: ignore[attr-defined]
        if texts is None:
            texts = [(compile_re2(p), SHAPES.get(p)) for p in self.patterns]
            object.__setattr__(self, '_texts', texts)
        return texts

    def _substitute(self, pattern: Any, shape: Callable[[str], bool] | None, text: str) -> str:
        """`text` with the secret of each match of `pattern` replaced by a marker.

        After a match that holds none, the search goes on from its group: a keyword there may
        lead a secret (`token = API_KEY="..."`).
        """
        pieces, kept, pos = [], 0, 0
        while pos <= len(text) and (found := pattern.search(text, pos)) is not None:
            start, end = found.span()
            new = self._replace(found, shape)
            if new is None:
                pos = max(found.start(1) if found.re.groups else end, start + 1)
                continue
            pieces += [text[kept:start], new]
            kept, pos = end, max(end, start + 1)
        return ''.join([*pieces, text[kept:]])

    def _replace(self, found: Any, shape: Callable[[str], bool] | None) -> str | None:
        """The match with its secret (its first group, or all of it) replaced by a marker.

        None when it holds no secret: its group lacks the `shape` its pattern asks for, or it is a
        marker already (redacting twice changes nothing).
        """
        whole = found.group(0)
        if found.re.groups and found.group(1) is not None:
            start, end = found.start(1) - found.start(0), found.end(1) - found.start(0)
            secret = whole[start:end]
            if _is_marker(secret) or (shape is not None and not shape(secret)):
                return None
            return whole[:start] + self.marker(secret) + whole[end:]
        return None if _is_marker(whole) else self.marker(whole)
