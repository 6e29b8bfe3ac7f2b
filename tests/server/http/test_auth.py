"""API-key matching and the tenant salt (unit level; the live 401s are in test_api_errors)."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from server.http.auth import match_api_key, tenant_salt
from server.settings import ServerSettings, collect_api_keys

KEYS = ("sk-alpha-0001", "sk-beta-0002")


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("sk-alpha-0001", "sk-alpha-0001"),
        ("sk-beta-0002", "sk-beta-0002"),
        (None, None),
        ("", None),
        ("sk-alpha-000", None),  # a prefix
        ("sk-alpha-00011", None),  # an extension
        ("SK-ALPHA-0001", None),
    ],
)
def test_match_api_key(token: str | None, expected: str | None) -> None:
    assert match_api_key(token, KEYS) == expected


def test_match_api_key_non_ascii_token() -> None:
    assert match_api_key("sk-alpha-000\u00e9", KEYS) is None


def test_tenant_salt_separates_every_key_and_user() -> None:
    tenants = list(itertools.product([None, "k1", "k2", "ab"], [None, "u1", "c", "bc"]))
    salts = [tenant_salt(k, u) for k, u in tenants]
    assert len(set(salts)) == len(salts)  # all distinct
    assert tenant_salt(None, None) == b""
    assert tenant_salt("k1", "u1") == tenant_salt("k1", "u1")  # stable
    # The same text as a key or as a user is a different tenant.
    assert tenant_salt("x", None) != tenant_salt(None, "x")
    # Field boundaries are part of the hash: ("ab", "c") != ("a", "bc").
    assert tenant_salt("ab", "c") != tenant_salt("a", "bc")


def test_tenant_salt_value() -> None:
    """Hand-built from the documented layout: tag + 8-byte little-endian length + value."""
    h = hashlib.blake2b(b"flashserve-tenant-v1", digest_size=16)
    h.update(b"key" + (2).to_bytes(8, "little") + b"k1")
    h.update(b"user" + (1).to_bytes(8, "little") + b"u")
    assert tenant_salt("k1", "u") == h.digest()


def test_collect_api_keys_order_and_blanks() -> None:
    env = {"FLASHSERVE_API_KEYS": " b ,, c,a "}
    assert collect_api_keys(["a", "b"], env) == ("a", "b", "c")
    assert collect_api_keys(None, {}) == ()


@pytest.mark.parametrize(
    "bad",
    [
        {"max_body_bytes": 0},
        {"keep_alive_s": 0},
        {"max_concurrent_requests": 0},
        {"default_max_tokens": 0},
        {"api_keys": ("",)},
    ],
)
def test_settings_reject_nonsense(bad: dict) -> None:
    with pytest.raises(ValueError):
        ServerSettings(**bad)
