"""API keys (``Authorization: Bearer KEY``, or ``x-api-key: KEY`` on the Messages API) and
the prefix-cache tenant they imply.

Keys are compared with ``hmac.compare_digest`` against every configured key,
so the time taken says nothing about how much of a key matched or which key
it was. ``/health`` and ``/metrics`` do not use this dependency.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated

from fastapi import Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from server.http.errors import authentication_failed

# auto_error=False: a missing header reaches us, so the 401 has the API's error shape.
bearer_scheme = HTTPBearer(auto_error=False, description="An API key of the server")
# Anthropic's header; its SDKs send it, Claude Code sends Bearer (ANTHROPIC_AUTH_TOKEN).
x_api_key_scheme = APIKeyHeader(
    name="x-api-key", auto_error=False, description="An API key of the server (Messages API)"
)

# Salt fields: a tag and a length before each value, so ("ab", "c") != ("a", "bc").
_SALT_VERSION = b"flashserve-tenant-v1"


def match_api_key(token: str | None, keys: Sequence[str]) -> str | None:
    """The configured key equal to ``token``, or None; every key is compared."""
    if token is None:
        return None
    given = token.encode()
    found = None
    for key in keys:
        if hmac.compare_digest(given, key.encode()):
            found = key
    return found


def api_key_dependency(keys: Sequence[str]) -> Callable[..., Awaitable[str | None]]:
    """A FastAPI dependency: the caller's key (None when the server has no keys), else 401."""
    keys = tuple(keys)

    async def authenticate(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)],
    ) -> str | None:
        if not keys:
            return None
        token = credentials.credentials if credentials is not None else None
        key = match_api_key(token, keys)
        if key is None:
            raise authentication_failed(token)
        return key

    return authenticate


def x_api_key_dependency(keys: Sequence[str]) -> Callable[..., Awaitable[str | None]]:
    """As ``api_key_dependency``, the key read from ``x-api-key`` or else from
    ``Authorization: Bearer`` (either header authenticates; a wrong one is a 401)."""
    keys = tuple(keys)

    async def authenticate(
        header_key: Annotated[str | None, Security(x_api_key_scheme)],
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)],
    ) -> str | None:
        if not keys:
            return None
        token = header_key
        if token is None and credentials is not None:
            token = credentials.credentials
        key = match_api_key(token, keys)
        if key is None:
            raise authentication_failed(token)
        return key

    return authenticate


def tenant_salt(api_key: str | None, user: str | None) -> bytes:
    """The prefix-cache salt of a caller: a hash of its API key and ``user_id``/``user``.

    Requests with different salts never share KV pages, so one tenant cannot
    learn from cache timing what another sent. With neither a key nor a user
    the cache is shared (``b""``).
    """
    if api_key is None and user is None:
        return b""
    h = hashlib.blake2b(_SALT_VERSION, digest_size=16)
    for tag, value in ((b"key", api_key), (b"user", user)):
        if value is None:
            continue
        data = value.encode()
        h.update(tag + len(data).to_bytes(8, "little") + data)
    return h.digest()
