"""The key-encryption key of erasure (`STEPSTREAM_ERASURE_KEY`), parsed: a ground module.

It imports nothing of stepstream, so that `Settings` checks the key when it is loaded (a clear error
at start, not at the first sealed write) without importing `stepstream.erasure`, which takes
settings; `stepstream.erasure` re-exports `parse_kek` beside `new_kek`.
"""

from __future__ import annotations

import base64
import binascii


def parse_kek(text: str) -> bytes:
    """The key-encryption key from its setting: base64 (standard or URL-safe) of 32 random bytes.

    ```python
    parse_kek(new_kek())   # 32 bytes
    ```
    """
    try:
        raw = base64.urlsafe_b64decode(text.strip().replace('+', '-').replace('/', '_') + '==')
    except (binascii.Error, ValueError):
        raw = b''
    if len(raw) != 32:  # AES-256
        raise ValueError(
            'STEPSTREAM_ERASURE_KEY must be the base64 of 32 random bytes; make one with '
            '`python -c "import stepstream.erasure as e; print(e.new_kek())"`'
        )
    return raw
