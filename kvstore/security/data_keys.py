"""Per-tenant data secrets: keyed namespace roots and the block MAC (docs/design.md §3.1, §3.2).

Without a secret a root is ``sha256`` of public fields and a block's tag an xxh3 checksum
anyone can compute, so anybody who can Put could plant KV under a public prompt's keys. With
the cluster's data key (``security.data_key``) both are keyed::

    data_key (cluster secret, >= 16 bytes)
      -> tenant_key = HMAC-SHA256(data_key, "kvstore tenant key v1" 0x00 tenant)
                      tenant = cache_salt up to its first NUL (tenant_of)
           -> root_key  = HMAC-SHA256(tenant_key, "kvstore namespace root v1")
           |    root    = HMAC-SHA256(root_key, namespace.encode())
           -> mac_key   = HMAC-SHA256(tenant_key, "kvstore block mac v1")
                block_key = HMAC-SHA256(mac_key, root || key)       (one key per block)
                tag       = AES-256-GMAC(block_key, nonce = 12 zero bytes, payload)  16 bytes

Guarantees: HMAC-SHA256 is a PRF, so one tenant's key reveals nothing about another's or the
data key. The tag (the header's checksum field, 16 bytes instead of xxh3's 8) binds the block
key and, through the root, the namespace; parent key and tokens chain to the key and layout
fields are compared by the reader, so the whole block is covered. A GMAC key is never reused
across block keys, so the fixed nonce is safe: two tags under one key need two payloads for
one block key, which only a writer of that tenant can make. AES-GMAC is the fastest real MAC
``cryptography`` offers; the per-block key derivation dominates on small blocks.

Trust: the data key's holders (the operator, store nodes, coordinator, cluster-started workers)
serve every tenant; a tenant's clients get only their tenant key (``kvstore credentials
issue``). The MAC is symmetric, so it tells "written by a holder of this tenant's key" from
"anyone else"; which holder may write is the node's grant check on Put (docs/security.md).
Without a data key roots are public sha256 and the tag xxh3: integrity against faults only.
"""

from __future__ import annotations

import hmac

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore.errors import ConfigError

#: Bytes of a tenant key, and of every key derived from it.
KEY_BYTES = 32
#: The fewest bytes a cluster data key may have (``security.data_key`` checks the same).
MIN_DATA_KEY_BYTES = 16
#: Bytes of a block MAC (the header's checksum field in a keyed namespace).
TAG_NBYTES = 16
#: Bytes of the xxh3-64 checksum of an unkeyed namespace.
CHECKSUM_NBYTES = 8

_TENANT_LABEL = b"kvstore tenant key v1\x00"
_ROOT_LABEL = b"kvstore namespace root v1"
_MAC_LABEL = b"kvstore block mac v1"
_NONCE = bytes(12)  # one key per block, so a fixed nonce never repeats under a key


def _prf(key: bytes, msg: bytes) -> bytes:
    return hmac.digest(key, msg, "sha256")


def parse_data_key(text: str | None) -> bytes | None:
    """The cluster data key from its hex form (``security.data_key``); None stays None."""
    if text is None:
        return None
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) < MIN_DATA_KEY_BYTES:
        raise ConfigError(f"security.data_key must be at least {2 * MIN_DATA_KEY_BYTES} hex "
                          "digits; `kvstore start` generates one")
    return raw


def check_data_key(data_key: object) -> bytes:
    """``data_key`` if it is a usable cluster data key (bytes of 16 or more), else ConfigError."""
    if not isinstance(data_key, bytes) or len(data_key) < MIN_DATA_KEY_BYTES:
        raise ConfigError(f"a data key must be bytes of at least {MIN_DATA_KEY_BYTES}; got "
                          f"{type(data_key).__name__} of length {_len(data_key)}")
    return data_key


def check_tenant_key(key: object) -> bytes:
    """``key`` if it is a tenant key (32 bytes, as ``tenant_key`` makes), else ConfigError."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ConfigError(f"a tenant key must be {KEY_BYTES} bytes (as `kvstore credentials "
                          f"issue` prints it, hex); got {type(key).__name__} of length "
                          f"{_len(key)}")
    return key


def _len(obj: object) -> object:
    return len(obj) if isinstance(obj, (bytes, bytearray, str)) else "n/a"


def tenant_of(cache_salt: str) -> str:
    """The tenant a namespace's salt belongs to: the salt up to its first NUL. The engine keeps
    approximate-reuse KV apart as ``salt + "\\x00reuse=block"`` (another root, so no block is
    shared), and that namespace is still the tenant's: its own clients hold one key for both."""
    return cache_salt.split("\x00", 1)[0]


def tenant_key(data_key: bytes, cache_salt: str) -> bytes:
    """The secret of one tenant (``tenant_of(cache_salt)``) under the cluster's data key: what
    its own clients hold to build its namespaces (``Namespace(..., tenant_key=...)``) and check
    its blocks."""
    check_data_key(data_key)
    if not isinstance(cache_salt, str):
        raise ConfigError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
    return _prf(data_key, _TENANT_LABEL + tenant_of(cache_salt).encode("utf-8"))


def root_key(tenant: bytes) -> bytes:
    """The key a tenant's namespace roots are hashed under."""
    return _prf(tenant, _ROOT_LABEL)


def mac_key(tenant: bytes) -> bytes:
    """The key a tenant's block tags derive from."""
    return _prf(tenant, _MAC_LABEL)


def keyed_root(tenant: bytes, encoding: bytes) -> bytes:
    """A namespace root nobody without the tenant key can compute (``encoding``: the
    namespace's canonical bytes)."""
    return _prf(root_key(tenant), encoding)


def block_key(mac: bytes, root: bytes, key: bytes) -> bytes:
    """The one-block GMAC key: binds the tag to this namespace root and block key."""
    return _prf(mac, root + key)


def block_tag(mac: bytes, root: bytes, key: bytes, payload: object) -> bytes:
    """The 16-byte MAC of one block's payload (any contiguous buffer, read in place)."""
    return AESGCM(block_key(mac, root, key)).encrypt(_NONCE, b"", payload)  # type: ignore[arg-type]


class TagHasher:
    """``block_tag`` fed in pieces (a same-node read tags each chunk as it copies it)."""

    def __init__(self, mac: bytes, root: bytes, key: bytes) -> None:
        cipher = Cipher(algorithms.AES(block_key(mac, root, key)), modes.GCM(_NONCE))
        self._enc = cipher.encryptor()

    def update(self, chunk: object) -> None:
        self._enc.authenticate_additional_data(chunk)  # type: ignore[arg-type]

    def digest(self) -> bytes:
        self._enc.finalize()
        return self._enc.tag


def tags_equal(a: bytes | memoryview, b: bytes | memoryview) -> bool:
    """Constant-time compare: a node answering Puts must not time-leak a tag byte by byte."""
    return hmac.compare_digest(bytes(a), bytes(b))
