"""What an S3 failure means and what to do about it, read from the errors obstore raises.

`S3MediaStore` turns every failure to reach or use its bucket into a `MediaUnavailable` that says
what went wrong (the bucket is missing, access was denied, S3 could not be reached, TLS failed)
and which setting to check; `diagnose` is that judgement, kept apart from the store's requests.
"""

from __future__ import annotations

import re

from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

__all__ = ['diagnose', 'first_line']

# How obstore (reqwest) words a request that never got an answer.
_UNREACHABLE_MARKERS = ('error sending request', 'timed out', 'timeout', 'connect', 'dns error')


def diagnose(exc: BaseException, *, missing_bucket: bool) -> tuple[str, str]:
    """What went wrong and what to do, for an error of the S3 client."""
    tls = _tls_failure(str(exc))
    if tls is not None:
        what, advice = tls
    elif missing_bucket or 'NoSuchBucket' in str(exc):
        what, advice = (
            'the bucket does not exist',
            'create it, or set STEPSTREAM_S3_BUCKET to an existing bucket',
        )
    elif isinstance(exc, PermissionDeniedError | UnauthenticatedError | PermissionError) or any(
        m in str(exc) for m in _DENIED_MARKERS
    ):
        what, advice = (
            'access was denied',
            'check STEPSTREAM_S3_ACCESS_KEY_ID / STEPSTREAM_S3_SECRET_ACCESS_KEY and that they may '
            'read and write this bucket',
        )
    elif isinstance(exc, OSError) or any(m in str(exc).lower() for m in _UNREACHABLE_MARKERS):
        what, advice = (
            'S3 could not be reached',
            'check STEPSTREAM_S3_ENDPOINT and that the S3 service is running and reachable from here',
        )
    else:
        what, advice = (
            'S3 failed the request',
            'check that STEPSTREAM_S3_ENDPOINT is an S3-compatible service, and its logs',
        )
    return what, advice


def _tls_failure(text: str) -> tuple[str, str] | None:
    """What went wrong and what to do when TLS is the cause, from the text of an obstore error.

    obstore (reqwest with rustls) puts the reason deep in its debug text, not its first line:
    `InvalidCertificate(UnknownIssuer)`, `InvalidCertificate(NotValidForName)`, ...
    """
    reason = _INVALID_CERTIFICATE.search(text)
    if reason is not None and reason.group(1) == 'NotValidForName':
        return (
            'the TLS certificate of the endpoint does not name the host in its URL',
            'set STEPSTREAM_S3_ENDPOINT to a host name the certificate holds',
        )
    if reason is not None:
        return (
            f'the TLS certificate of the endpoint is not trusted ({reason.group(1)})',
            'set STEPSTREAM_S3_CAFILE to the PEM file of the CA that signed it',
        )
    if 'HTTP request to an HTTPS server' in text:
        return (
            'the endpoint speaks HTTPS, not plain HTTP',
            'use https:// in STEPSTREAM_S3_ENDPOINT (and STEPSTREAM_S3_CAFILE for a private CA)',
        )
    if any(marker in text for marker in _PLAINTEXT_ANSWER_MARKERS):
        return (
            'the endpoint answered a TLS handshake with plain HTTP',
            'use http:// in STEPSTREAM_S3_ENDPOINT, or enable TLS on the S3 service',
        )
    return None


_INVALID_CERTIFICATE = re.compile(r'InvalidCertificate\(\s*([A-Za-z]+)')
# How rustls words a TLS handshake answered by a plain-HTTP server.
_PLAINTEXT_ANSWER_MARKERS = ('InvalidContentType', 'CorruptMessage', 'received corrupt message')

# A LIST answered 403 reaches us as a generic error: its status and S3 error codes say what it is.
_DENIED_MARKERS = ('403 Forbidden', 'AccessDenied', 'SignatureDoesNotMatch', 'InvalidAccessKeyId')


def first_line(exc: BaseException) -> str:
    """The first line of an error's text, at most 300 characters (obstore's run to many lines)."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + '...'
