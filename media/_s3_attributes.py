"""A `MediaContext` as the attributes of an S3 object, and back.

`S3MediaStore` stores `ctx.media_type` as the Content-Type, `ctx.filename` as the
Content-Disposition and `ctx.metadata` as the object's user metadata, and reads them back from a
HEAD. S3 and HTTP put limits on both: user-metadata keys come back lowercased, and values travel
as headers, so anything but printable ASCII is encoded (RFC 2047 for values, RFC 6266 for names).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from email.message import EmailMessage
from urllib.parse import quote

from stepstream.media._types import MediaContext

__all__ = ['context_from_attributes', 'object_attributes']

# S3 returns user-metadata keys lowercased and obstore treats these names as object attributes,
# so only keys that come back unchanged as user metadata are accepted.
_META_KEY = re.compile(r'[a-z0-9][a-z0-9._-]*')
_RESERVED_KEYS = frozenset(
    {'content-type', 'content-disposition', 'content-encoding', 'content-language', 'cache-control'}
    | {'storage-class'}
)
_STANDARD_ATTRIBUTES = frozenset(
    {'Content-Type', 'Content-Disposition', 'Content-Encoding', 'Content-Language', 'Cache-Control'}
    | {'Storage-Class'}
)
# Metadata values travel as HTTP headers: anything but printable ASCII is sent as an RFC 2047
# encoded word (as the AWS SDKs do), and so is a value that already looks like one.
_ENCODED_WORD = re.compile(r'=\?utf-8\?b\?([A-Za-z0-9+/=]*)\?=')
_PLAIN_VALUE = re.compile(r'[\x20-\x7e]*')


def object_attributes(ctx: MediaContext) -> dict[str, str]:
    """The object attributes a put stores for `ctx` (`ValueError` for a key S3 cannot keep)."""
    attributes: dict[str, str] = {}
    if ctx.media_type is not None:
        attributes['Content-Type'] = ctx.media_type
    if ctx.filename is not None:
        attributes['Content-Disposition'] = _content_disposition(ctx.filename)
    for name, value in ctx.metadata.items():
        if not _META_KEY.fullmatch(name) or name in _RESERVED_KEYS:
            raise ValueError(
                f'metadata key {name!r} cannot be S3 object metadata: use lowercase letters, digits, '
                f'".", "_" and "-" (S3 lowercases keys), and none of {sorted(_RESERVED_KEYS)}'
            )
        attributes[name] = _encode_value(value)
    return attributes


def _content_disposition(filename: str) -> str:
    # Header values must be ASCII: other names go in RFC 6266's `filename*` form.
    if _PLAIN_VALUE.fullmatch(filename) and '"' not in filename and '\\' not in filename:
        return f'inline; filename="{filename}"'
    return "inline; filename*=UTF-8''" + quote(filename, safe='')


def context_from_attributes(attributes: Mapping[str, str]) -> MediaContext:
    """The `MediaContext` a stored object's attributes describe (what `object_attributes` wrote)."""
    filename = None
    disposition = attributes.get('Content-Disposition')
    if disposition is not None:
        header = EmailMessage()
        header['Content-Disposition'] = disposition
        filename = header.get_filename()
    metadata = {
        name.lower(): _decode_value(value)
        for name, value in attributes.items()
        if name not in _STANDARD_ATTRIBUTES
    }
    return MediaContext(media_type=attributes.get('Content-Type'), filename=filename, metadata=metadata)


def _encode_value(value: str) -> str:
    if _PLAIN_VALUE.fullmatch(value) and not value.startswith('=?'):
        return value
    return '=?utf-8?b?' + base64.b64encode(value.encode()).decode('ascii') + '?='


def _decode_value(value: str) -> str:
    match = _ENCODED_WORD.fullmatch(value)
    if match is None:
        return value
    try:
        return base64.b64decode(match.group(1), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return value
