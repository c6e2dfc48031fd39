"""The bearer token: how a request proves it may read the projection."""

from __future__ import annotations

import hmac

from starlette.requests import Request

TOKEN_COOKIE = 'stepstream_token'
"""The explorer's copy of the bearer token, set by `/login` (a browser cannot send a header on a link)."""


def token_matches(given: str, token: str) -> bool:
    """Whether `given` is the token, compared in constant time."""
    return hmac.compare_digest(given.strip().encode(), token.encode())


def authorized(request: Request, token: str) -> bool:
    """Whether the request carries the token: `Authorization: Bearer <token>`, or the login cookie."""
    scheme, _, given = request.headers.get('authorization', '').partition(' ')
    if scheme.lower() != 'bearer':
        given = request.cookies.get(TOKEN_COOKIE, '')
    return token_matches(given, token)
