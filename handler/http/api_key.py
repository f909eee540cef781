"""The bearer API key both front doors check: `snapfn serve` (Flask) and the activator (aiohttp).

    key = api_key_bytes(config.api_key)          None: no key configured, nothing is checked
    body = refusal(key, path, authorization)     the 401 body to send, or None to let it in

/health and /openapi.json stay open (probes, discovery). The comparison takes constant time and
is of bytes: a key with non-ASCII characters matches a header that carries its UTF-8 bytes.
"""

from __future__ import annotations

import hmac
from typing import Any

from snapfn.handler.http.openai.shapes import error_body

OPEN_PATHS = frozenset({"/health", "/openapi.json"})
UNAUTHORIZED_HEADERS = {"WWW-Authenticate": "Bearer"}


def api_key_bytes(api_key: str | None) -> bytes | None:
    return api_key.encode() if api_key else None


def refusal(key: bytes | None, path: str, authorization: str) -> dict[str, Any] | None:
    """The 401 body for a request to `path` with this Authorization header, or None."""
    if key is None or path in OPEN_PATHS:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and _matches(token.strip(), key):
        return None
    message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
    return error_body(message, "invalid_request_error", code="invalid_api_key")


def _matches(token: str, key: bytes) -> bool:
    """Whether the header's token is the key's UTF-8 bytes, in constant time. A WSGI server
    hands a header over decoded as latin-1, aiohttp as UTF-8 (surrogateescape), and this
    function is not told which: the raw bytes are taken back both ways and both compared."""
    try:
        as_wsgi = token.encode("latin-1")
    except UnicodeEncodeError:
        as_wsgi = b""  # outside latin-1: not a WSGI header's text
    as_aiohttp = token.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(as_wsgi, key) | hmac.compare_digest(as_aiohttp, key)
