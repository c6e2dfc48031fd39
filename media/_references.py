"""Which media objects a snapshot record needs: one answer for the media index, `forget` and the sweep.

Since step_event v4 a snapshot record lists them itself (`SnapshotDelta.media`): the walk that
moved each payload to the store is the one that lists it (`offload_media`), so the list holds
plain and sealed payloads of every part type and nesting, and the references inside a JSON
payload, which nobody can see in the record. Nothing here reads text for them.

A record from an earlier writer lists nothing, so its references are read from its content
(`legacy_media`): in a sealed tail, the URIs its writer put in clear beside the ciphertext; in a
plain one, the references its messages hold, binaries' included (their `data` is base64 in
Pydantic AI's JSON). Neither can see inside a JSON payload, and an early sealed writer left out
its binaries; the media sweep's last check (`media_read`) is what keeps those safe
(docs/decisions/0041-media-known-by-construction.md).

Pydantic AI is not imported here: the projector and the CLI's views call this.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from typing import Any

from stepstream.erasure import SEALED_TEXT_MARK, is_sealed_text
from stepstream.media._types import JSON_REFERENCE, REFERENCE_PREFIX, is_media_uri

__all__ = ['legacy_media', 'snapshot_media']

_PREFIX_BYTES = REFERENCE_PREFIX.encode()
_JSON_MARK = json.dumps(REFERENCE_PREFIX)[1:-1]
"""How a reference starts inside Pydantic AI's JSON (the NUL escaped as `\\u0000`)."""
_BINARY_MARK = base64.b64encode(_PREFIX_BYTES).decode()
"""How a binary's reference starts inside that JSON: the base64 of the prefix opens its `data`,
whatever follows (the prefix's 12 bytes are 16 base64 characters, with no padding)."""


def snapshot_media(messages: str, media: Sequence[str] | None) -> frozenset[str]:
    """The media URIs a snapshot record needs, from its `messages` and `media` fields.

    `media` is the record's own list (schema v4 on; only URIs are kept); None, from an earlier
    writer, reads them from `messages` (`legacy_media`).

    ```python
    snapshot_media(event.snapshot.messages, event.snapshot.media)  # {'media+sha256://9f86...', ...}
    ```
    """
    if media is not None:
        return frozenset(uri for uri in media if isinstance(uri, str) and is_media_uri(uri))
    return legacy_media(messages)


def legacy_media(messages: str) -> frozenset[str]:
    """The references a snapshot tail written before schema v4 holds where a reader can see them.

    Sealed: the URIs listed in clear beside the ciphertext. Plain: every reference in the
    messages' JSON, text and JSON payloads' as strings, binaries' inside their base64 `data`
    (escaped values are not references). Anything that does not parse names nothing.
    """
    if is_sealed_text(messages):
        try:
            mark, _key, _body, *refs = json.loads(messages)
        except (ValueError, TypeError, RecursionError):
            return frozenset()
        if mark != SEALED_TEXT_MARK:
            return frozenset()
        return frozenset(r for r in refs if isinstance(r, str) and is_media_uri(r))
    if _JSON_MARK not in messages and _BINARY_MARK not in messages:
        return frozenset()  # the common case, at memchr speed
    try:
        value = json.loads(messages)
    except (ValueError, RecursionError):
        return frozenset()
    found: set[str] = set()
    stack: list[Any] = [value]
    while stack:  # iterative: a hostile record may nest as deep as the JSON parser allows
        item = stack.pop()
        if isinstance(item, str):
            uri = _text_reference(item)
            if uri is not None:
                found.add(uri)
        elif isinstance(item, dict):
            if item.get('kind') == 'binary' and isinstance(item.get('data'), str):
                uri = _binary_reference(item['data'])
                if uri is not None:
                    found.add(uri)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return frozenset(found)


def _text_reference(value: str) -> str | None:
    if not value.startswith(REFERENCE_PREFIX):
        return None
    rest = value[len(REFERENCE_PREFIX) :]
    if rest.startswith(JSON_REFERENCE):
        rest = rest[len(JSON_REFERENCE) :]
    return rest if is_media_uri(rest) else None


def _binary_reference(data: str) -> str | None:
    if not data.startswith(_BINARY_MARK):
        return None
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return None
    uri = raw[len(_PREFIX_BYTES) :].decode('ascii', 'replace')  # the mark decodes to the prefix
    return uri if is_media_uri(uri) else None
