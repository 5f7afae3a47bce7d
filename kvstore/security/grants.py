"""Credentials and what they grant: the cluster token (admin, every tenant) and tenant
credentials signed with a key derived from it (docs/security.md §Credentials).

A tenant credential is ``kvs1.<payload>.<signature>``: the payload (msgpack, base64url) names
the tenants (cache salts) it may read and write, whether it is admin, and when it expires; the
signature is HMAC-SHA256 under a key derived from the cluster token. A store node holding the
cluster token verifies any credential without a table of issued ones, the way a JWT is checked;
rotating the cluster token (``kvstore rotate-credentials``) voids every credential signed
under the old one once the old token is no longer accepted.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack

from kvstore.errors import ConfigError, PermissionDenied, Unauthenticated
from kvstore.security.data_keys import tenant_of

PREFIX = "kvs1."
#: Grants every tenant.
ANY = "*"
_SIGNING_LABEL = b"kvstore credential signing v1"
_MAX_CREDENTIAL_CHARS = 4096  # a presented credential longer than this is refused unparsed


@dataclass(frozen=True, slots=True)
class Grant:
    """What an authenticated caller may do. Tenants are cache salts (``""`` is the default,
    salt-less tenant); ``*`` means every tenant."""

    subject: str
    read: frozenset[str]
    write: frozenset[str]
    admin: bool = False
    expires_at: float | None = None

    def may_read(self, tenant: str) -> bool:
        """Writers read what they write: a tenant in ``write`` is readable too."""
        return self.admin or _grants(self.read, tenant) or _grants(self.write, tenant)

    def may_write(self, tenant: str) -> bool:
        return self.admin or _grants(self.write, tenant)

    def check_read(self, tenant: str) -> None:
        if not self.may_read(tenant):
            readable = _shown(self.read | self.write)
            raise PermissionDenied(f"credential {self.subject!r} may not read tenant "
                                   f"{tenant!r} (cache salt); it reads {readable}")

    def check_write(self, tenant: str) -> None:
        if not self.may_write(tenant):
            raise PermissionDenied(f"credential {self.subject!r} may not write tenant "
                                   f"{tenant!r} (cache salt); it writes {_shown(self.write)}")

    def check_admin(self, call: str) -> None:
        if not self.admin:
            raise PermissionDenied(f"{call} is an admin call; credential {self.subject!r} is "
                                   "a tenant credential (use the cluster token)")


#: The grant of the cluster token, and of everyone when a node runs without auth.
ADMIN = Grant("cluster", frozenset({ANY}), frozenset({ANY}), admin=True)


def _grants(tenants: frozenset[str], salt: str) -> bool:
    """Whether ``tenants`` covers the tenant ``salt`` belongs to (the engine's
    ``salt + "\\x00reuse=block"`` namespaces belong to ``salt``'s tenant)."""
    return ANY in tenants or tenant_of(salt) in tenants


def _shown(tenants: frozenset[str]) -> str:
    return ", ".join(repr(t) for t in sorted(tenants)) or "no tenant"


def _signing_key(cluster_token: str) -> bytes:
    return hmac.new(cluster_token.encode(), _SIGNING_LABEL, hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_cluster_token() -> str:
    """A fresh cluster token: 256 random bits."""
    return secrets.token_urlsafe(32)


def issue_credential(cluster_token: str, subject: str, *, read: Iterable[str] = (),
                     write: Iterable[str] = (), admin: bool = False,
                     ttl_s: float | None = None) -> str:
    """A tenant credential signed under ``cluster_token`` (``kvstore credentials issue``)."""
    if not cluster_token:
        raise ConfigError("issuing a credential needs the cluster token (server.auth_token)")
    read, write = sorted(set(read)), sorted(set(write))
    if not (read or write or admin):
        raise ConfigError("a credential must grant something: --read TENANT, --write TENANT "
                          "or --admin")
    if ttl_s is not None and ttl_s <= 0:
        raise ConfigError("a credential's ttl must be > 0 seconds")
    payload = msgpack.packb({
        "s": subject, "r": read, "w": write, "a": bool(admin),
        "e": 0.0 if ttl_s is None else time.time() + ttl_s,
        "i": secrets.token_hex(8),
    })
    body = PREFIX + _b64(payload)
    sig = hmac.new(_signing_key(cluster_token), body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(sig)}"


def _decode(credential: str) -> Grant:
    """The grant a (signature-checked) credential's payload names."""
    fields = msgpack.unpackb(_unb64(credential[len(PREFIX):].split(".", 1)[0]))
    if not isinstance(fields, dict):
        raise ValueError("payload is not a mapping")
    subject, read, write = fields["s"], fields["r"], fields["w"]
    admin, expires = fields["a"], fields["e"]
    if not (isinstance(subject, str) and isinstance(read, list) and isinstance(write, list)
            and all(isinstance(t, str) for t in read + write) and isinstance(admin, bool)
            and isinstance(expires, (int, float))):
        raise ValueError("payload fields have the wrong types")
    return Grant(subject, frozenset(read), frozenset(write), admin, float(expires) or None)


def inspect_credential(credential: str) -> Grant:
    """What a credential claims, unverified (``kvstore credentials show``)."""
    try:
        return _decode(credential)
    except Exception as exc:
        raise ConfigError(f"not a kvstore credential: {exc}") from None


class Authenticator:
    """A server's check of presented credentials against the cluster token(s) it accepts.

    With no token at all, auth is off and every caller gets ``ADMIN`` (the embedded default on
    loopback). Verified credentials are cached (bounded), so a bulk request that repeats its
    token costs a dict lookup, not an HMAC.
    """

    def __init__(self, tokens: Sequence[str | None]) -> None:
        self._tokens = [t.encode() for t in tokens if t]
        self._keys = [_signing_key(t) for t in tokens if t]
        self._cache: OrderedDict[bytes, Grant] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def authenticate(self, presented: str | bytes | None) -> Grant:
        """The grant of ``presented``; Unauthenticated if it is missing, wrong or expired."""
        if not self._tokens:
            return ADMIN
        raw = presented.encode() if isinstance(presented, str) else (presented or b"")
        if raw.startswith(b"Bearer "):
            raw = raw[len(b"Bearer "):]
        if not raw:
            raise Unauthenticated("no credential presented (set client.auth_token to the "
                                  "cluster token or a credential from `kvstore credentials "
                                  "issue`)")
        if len(raw) > _MAX_CREDENTIAL_CHARS:
            raise Unauthenticated("credential too long")
        with self._lock:
            grant = self._cache.get(raw)
            if grant is not None:
                self._cache.move_to_end(raw)
        if grant is None:
            grant = self._verify(raw)
            with self._lock:
                self._cache[raw] = grant
                while len(self._cache) > 1024:
                    self._cache.popitem(last=False)
        if grant.expires_at is not None and grant.expires_at < time.time():
            raise Unauthenticated(f"credential {grant.subject!r} expired; issue a new one")
        return grant

    def _verify(self, raw: bytes) -> Grant:
        for token in self._tokens:
            if hmac.compare_digest(raw, token):
                return ADMIN
        if raw.startswith(PREFIX.encode()) and raw.count(b".") == 2:
            body, _, sig = raw.rpartition(b".")
            try:
                got = _unb64(sig.decode())
            except (ValueError, UnicodeDecodeError):
                got = b""
            for key in self._keys:
                want = hmac.new(key, body, hashlib.sha256).digest()
                if hmac.compare_digest(got, want):
                    try:
                        return _decode(raw.decode())
                    except Exception as exc:
                        raise Unauthenticated(f"credential payload is malformed: {exc}") from None
        raise Unauthenticated("wrong credential: neither the cluster token nor a credential "
                              "signed under it (was it rotated?)")
