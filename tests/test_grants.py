"""Tenant credentials (kvstore.security.grants) against an HMAC computed here by hand: a node
believes a credential only if it was signed under a cluster token it accepts, and grants
exactly the tenants it names."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import msgpack
import pytest

from kvstore.errors import ConfigError, PermissionDenied, Unauthenticated
from kvstore.security.grants import (
    ADMIN,
    Authenticator,
    inspect_credential,
    issue_credential,
    new_cluster_token,
)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _signed(token: str, fields: dict) -> str:
    """A credential built by hand from the documented format, signed under ``token``."""
    body = "kvs1." + _b64(msgpack.packb(fields))
    key = hmac.new(token.encode(), b"kvstore credential signing v1", hashlib.sha256).digest()
    return f"{body}.{_b64(hmac.new(key, body.encode(), hashlib.sha256).digest())}"


def test_the_format_is_the_documented_hmac() -> None:
    token = new_cluster_token()
    by_hand = _signed(token, {"s": "a", "r": ["A"], "w": [], "a": False, "e": 0.0, "i": "x"})
    grant = Authenticator([token]).authenticate(by_hand)
    assert (grant.subject, grant.read, grant.write, grant.admin) == ("a", {"A"}, set(), False)


def test_cluster_token_is_admin_and_tenant_credentials_grant_only_their_tenants() -> None:
    token = new_cluster_token()
    auth = Authenticator([token])
    assert auth.authenticate(f"Bearer {token}") == ADMIN
    writer = auth.authenticate(issue_credential(token, "team-a", write=["A"]))
    assert writer.may_write("A") and writer.may_read("A")  # a writer reads what it writes
    assert writer.may_read("A\x00reuse=block")  # the engine's approximate namespaces of A
    assert not writer.may_read("B") and not writer.may_read("AB") and not writer.admin
    reader = auth.authenticate(issue_credential(token, "dash", read=["A", "B"]))
    assert reader.may_read("B") and not reader.may_write("A")
    with pytest.raises(PermissionDenied, match="may not write tenant 'A'"):
        reader.check_write("A")
    with pytest.raises(PermissionDenied, match="admin call"):
        reader.check_admin("Evict")


def test_forged_tampered_foreign_and_expired_credentials_are_refused() -> None:
    token, other = new_cluster_token(), new_cluster_token()
    auth = Authenticator([token])
    good = issue_credential(token, "a", read=["A"])
    body, _, sig = good.rpartition(".")
    payload = msgpack.packb({"s": "a", "r": ["*"], "w": ["*"], "a": True, "e": 0.0, "i": "x"})
    widened = "kvs1." + _b64(payload) + "." + sig  # the payload changed, the signature kept
    for bad in (None, "", "nope", token + "x", issue_credential(other, "a", read=["A"]),
                widened, body + "." + _b64(b"\0" * 32), "kvs1." + "A" * 5000):
        with pytest.raises(Unauthenticated):
            auth.authenticate(bad)
    expired = _signed(token, {"s": "old", "r": ["A"], "w": [], "a": False,
                              "e": time.time() - 1, "i": "y"})
    with pytest.raises(Unauthenticated, match="expired"):
        auth.authenticate(expired)


def test_previous_token_is_accepted_until_dropped() -> None:
    old, new = new_cluster_token(), new_cluster_token()
    cred = issue_credential(old, "a", read=["A"])
    assert Authenticator([new, old]).authenticate(cred).may_read("A")
    with pytest.raises(Unauthenticated):
        Authenticator([new]).authenticate(cred)


def test_no_token_means_auth_off_and_issue_checks_its_arguments() -> None:
    assert Authenticator([None]).authenticate(None) == ADMIN
    with pytest.raises(ConfigError):
        issue_credential("", "a", read=["A"])
    with pytest.raises(ConfigError, match="must grant something"):
        issue_credential(new_cluster_token(), "a")
    assert inspect_credential(issue_credential(new_cluster_token(), "s", write=["W"])).write \
        == {"W"}
    with pytest.raises(ConfigError):
        inspect_credential("garbage")
