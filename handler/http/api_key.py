"""The bearer API key both front doors check: `snapfn serve` (Flask) and the activator (aiohttp).

    key = api_key_bytes(config.api_key)          None: no key configured, nothing is checked
    body = refusal(key, path, authorization)     the 401 body to send, or None to let it in

/health and /openapi.json stay open (probes, discovery). The comparison takes constant time.
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
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
        return None
    message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
    return error_body(message, "invalid_request_error", code="invalid_api_key")
