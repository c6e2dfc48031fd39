"""What a secret looks like, for `Redaction` (`_redaction.py`): names, formats, shapes, and their RE2.

`SECRET_KEYS` are the key endings that name a secret; `PATTERNS` the well-known secret formats found
in any text (RE2 syntax, in the order they are applied). What a keyword leads (`Bearer`, `Basic`,
`token`, `password=`) must also have a credential's shape (`SHAPES`), so prose about
authentication is kept. `quick_test` makes the one expression a message's JSON bytes are searched
with first (the hot path's), reading each pattern as it appears in JSON (`in_json`); every pattern
is compiled by RE2 (`compile_re2`), in time linear in the text whatever the pattern.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import re2

SECRET_KEYS: Final = (
    'password',
    'passwd',
    'passphrase',
    'pwd',
    'secret',
    'token',
    'apikey',
    'accesskey',
    'secretkey',
    'privatekey',
    'authorization',
    'auth',
    'credential',
    'credentials',
    'cookie',
    'sessionid',
)
"""A key names a secret when, lowercased and stripped of everything but letters and digits, it
ends with one of these."""

# The pieces of the patterns. The quick test reads a message's JSON bytes, where a tab, a newline
# or a quote is an escape (`\t`, `\n`, `\"`): each pattern must find there what it finds in the text.
_WS = r'(?:\s|\\+[fnrt])'  # a blank, or its escape (in JSON text, or in JSON text in JSON)
_GAP = r'(?:\\t|[ \t"\'\\])*'  # blanks and quotes around a name's `=` or `:`
_B64 = '[A-Za-z0-9+/]'


def _credential(least: int) -> str:
    """A group of `least` or more token68 characters (RFC 7235), `=` padding after, not ending on `.`.

    A full stop after a token ends the sentence, not the token.
    """
    return rf'([A-Za-z0-9\-._~+/]{{{least - 1},}}[A-Za-z0-9\-_~+/]=*)'


_PEM = (
    r'-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----'
    rf'(?:{_WS}+[A-Za-z][A-Za-z0-9-]*: [^\r\n\\]*)*'  # an encrypted key's headers (Proc-Type, DEK-Info)
    rf'{_WS}+{_B64}{{48}}'  # a body (lines of 64): prose that names the armour line has none
    r'(?s:.)*?(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----|\z)'
)
_URL = r'\b[a-z][a-z0-9+.\-]*://[^\s:/@"]+:([^\s@/"]+)@'
_HEADER = rf'(?i:\bauthorization){_GAP}[:=]{_GAP}(?i:bearer|basic|token){_WS}+{_credential(8)}'
_SCHEME = rf'(?i:\b(?:bearer|token)){_WS}+{_credential(16)}'
_BASIC = rf'(?i:\bbasic){_WS}+((?:{_B64}{{4}}){{2,}}(?:{_B64}{{2}}==|{_B64}{{3}}=)?)(?:[^A-Za-z0-9+/=]|\z)'
_NAME = r'(?:password|passwd|secret|token|api[_\-]?key|access[_\-]?key)'
_ASSIGNED = rf'(?i:\b{_NAME}\b){_GAP}[=:]{_GAP}([^\s\'"`,;&]{{7,}}[^\s\'"`,;&.)\]}}>])'

PATTERNS: Final = (
    _PEM,  # a private key block, PEM (RSA, EC, OPENSSH, ENCRYPTED, ...): the whole block
    r'\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b',  # AWS access key ids
    r'\bAIza[0-9A-Za-z_\-]{35}',  # Google API keys
    r'\bgh[pousr]_[A-Za-z0-9]{36,}|\bgithub_pat_[A-Za-z0-9_]{22,}',  # GitHub tokens
    r'\bxox[abposr]-[A-Za-z0-9\-]{10,}',  # Slack tokens
    r'\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}',  # OpenAI, Anthropic keys
    r'\b[rs]k_(?:live|test)_[A-Za-z0-9]{16,}',  # Stripe keys
    r'\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}',  # JSON web tokens
    # Led by a keyword or a place: only the group, and only when it has a credential's shape
    # (`SHAPES`). After the formats above, which know their secrets better.
    _URL,  # the password of a URL
    _HEADER,  # `Authorization: Bearer|Basic|Token <credentials>`
    _SCHEME,  # `Bearer <token>`, `token <token>` anywhere else
    _BASIC,  # `Basic <base64 of user:password>` anywhere else
    _ASSIGNED,  # `password=...`, `api_key: ...`, `token = "..."` (8 characters or more, one line)
)
"""The well-known secret formats found in any text (RE2 syntax), in the order they are applied;
where a pattern has a group, only the group is replaced."""

_RUNS = re.compile('[A-Za-z0-9]+')
_PLACEHOLDER = re.compile(r'\{[^{}]*\}|<[^<>]*>|\$\{?\w+\}?|%(?:\(\w+\))?s|\*+|\.\.\.')
_SYMBOLS = frozenset('!#%?@^|~')
_NAMED = re.compile(rf'(?i){_NAME}[=:]')


def _word(value: str) -> bool:
    """Letters in one case, or a capital and then lower case: a word of prose, never a credential."""
    return value.isalpha() and (value.islower() or value.isupper() or value[1:].islower())


_NAME_PARTS = re.compile(r'[\-._~+/]')


def _header_credentials(value: str) -> bool:
    """After `Authorization: <scheme>`: anything but a word or a name (`YOUR_TOKEN`, `your-token`).

    It holds a digit, or lower case and a capital past its first letter, and is not words joined
    by punctuation (`Proxy-Authorization`, a header's name, in prose about the header).
    """
    body = value.rstrip('=')
    if all(_word(part) for part in _NAME_PARTS.split(body) if part):
        return False
    return any(c.isdigit() for c in body) or (
        any(c.islower() for c in body) and any(c.isupper() for c in body[1:])
    )


def _opaque_token(value: str) -> bool:
    """After `Bearer` or `token` in free text: what a random token looks like.

    16 characters or more, letters and digits both, and 12 letters and digits in a row: a version,
    a path or a model name (`gpt-4o-mini-2024-07-18`) is made of short parts; a word has no digit.
    """
    body = value.rstrip('=')
    return (
        len(body) >= 16
        and any(c.isdigit() for c in body)
        and any(c.isalpha() for c in body)
        and max((len(run) for run in _RUNS.findall(body)), default=0) >= 12
    )


def _basic_credentials(value: str) -> bool:
    """After `Basic` in free text: base64 of `user:password` (RFC 7617), printable text with a colon."""
    try:
        text = base64.b64decode(value, validate=True).decode()
    except ValueError:  # not base64, or not UTF-8 (binascii.Error, UnicodeDecodeError)
        return False
    return ':' in text and text.isprintable() and not _word(value)


def _url_password(value: str) -> bool:
    """The password of a URL, unless it is a placeholder (`{password}`, `<pw>`, `$PW`, `%s`, `***`)."""
    return _PLACEHOLDER.fullmatch(value) is None


def _assigned_secret(value: str) -> bool:
    """A value given to a secret's name (`password=...`): a secret, not prose or code.

    It holds a digit or a symbol (`!#%?@^|~`), and is not a call, an index, a placeholder
    (`get_token()`, `os.environ[`, `${DB_PASSWORD}`, `<password>`) or a URL.
    """
    if '://' in value or any(c in '([{<$' for c in value) or _NAMED.match(value):
        return False  # a value that is an assignment itself (`secret: token=...`) is read on its own
    return any(c.isdigit() or c in _SYMBOLS for c in value)


_QUICK: Final[Mapping[str, str]] = {
    _PEM: r'-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----',
    _HEADER: rf'(?i:\bauthorization){_GAP}[:=]{_GAP}(?i:bearer|basic|token){_WS}',
    _SCHEME: rf'(?i:\b(?:bearer|token)){_WS}+[A-Za-z0-9\-._~+/]{{16}}',
    _ASSIGNED: rf'(?i:\b{_NAME}\b){_GAP}[=:]{_GAP}[^\s\'"`,;&]{{8}}',
}
"""What the quick test looks for instead of a pattern: what leads its secret (a superset of its
matches, with fewer states for RE2 to build as it reads a message's bytes)."""

SHAPES: Final[Mapping[str, Callable[[str], bool]]] = {
    _URL: _url_password,
    _HEADER: _header_credentials,
    _SCHEME: _opaque_token,
    _BASIC: _basic_credentials,
    _ASSIGNED: _assigned_secret,
}
"""The shape a keyword-led pattern's group must have to be replaced; a match without it is kept."""


def compile_re2(pattern: str | bytes) -> Any:
    """A pattern compiled by RE2, or `ValueError` naming the pattern when RE2 cannot take it.

    RE2 runs in time linear in the text whatever the pattern: no catastrophic backtracking on text
    an agent controls.
    """
    try:
        return re2.compile(pattern)
    except re2.error as exc:
        raise ValueError(f'redaction pattern {pattern!r} is not RE2 syntax: {exc}') from None


def compile_any(patterns: tuple[str, ...]) -> Any:
    """The patterns as one alternation (None without any); `ValueError` names one RE2 cannot take."""
    if not patterns:
        return None
    alternation = '|'.join(f'(?:{p})' for p in patterns)
    try:
        return re2.compile(alternation)
    except re2.error as exc:
        for pattern in patterns:
            compile_re2(pattern)
        raise ValueError(f'redaction patterns {alternation!r} are not RE2 syntax together: {exc}') from None


_OUTSIDE_CLASSES = re.compile(r'\[\^?\]?(?:\\.|[^\]\\])*\]|\\.')
_ESCAPED_BLANK = {r'\b': r'(?:\b|\\[fnrt])', r'\s': r'(?:\s|\\+[fnrt])'}


def in_json(pattern: str) -> str:
    r"""`pattern` as the quick test reads a message's JSON bytes, where a newline or tab is an escape.

    There, a secret at the start of a line follows `\n`: `\b` sees no word boundary before it,
    and `\s` matches neither character. Outside character classes, both also take an escape.
    """
    return _OUTSIDE_CLASSES.sub(lambda found: _ESCAPED_BLANK.get(found.group(0), found.group(0)), pattern)


def key_suffixes(keys: Iterable[str]) -> tuple[str, ...]:
    """Key names as the secret-key rule compares them: normalized, unique, sorted."""
    return tuple(sorted({normalized(k) for k in keys if normalized(k)}))


def normalized(key: str) -> str:
    return ''.join(c for c in key.lower() if c.isalnum())


def quick_test(suffixes: tuple[str, ...], patterns: tuple[str, ...]) -> Any:
    """The quick test of a message's JSON, in one linear pass (RE2); None when there is nothing to find.

    It finds a key that could name a secret (any separators between its letters, JSON-escaped or
    not), or any pattern (or what leads its secret, `_QUICK`), read as in JSON bytes (`in_json`).
    """
    gap = '[^A-Za-z0-9"]*'
    keyed = '|'.join(gap.join(re.escape(c) for c in k) for k in suffixes)
    parts = [f'(?i:(?:{keyed})\\\\?"\\s*:)'] if suffixes else []
    parts += [f'(?:{in_json(_QUICK.get(p, p))})' for p in patterns]
    return compile_re2('|'.join(parts).encode()) if parts else None
