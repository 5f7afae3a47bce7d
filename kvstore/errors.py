"""The typed errors of kvstore.

Every failure a caller can act on has its own class, so callers branch on types, never on
integer codes or message text. gRPC status codes are mapped from these only at the server
boundary (``kvstore.node.store_server``) and back into these in the client.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""


class ConfigError(KVStoreError, ValueError):
    """A setting is invalid; the message names the setting and what to change."""


class BlockNotFound(KVStoreError, KeyError):
    """The key is not held where it was looked for (evicted, never published, node gone)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "block not found"


class BlockCorrupted(KVStoreError):
    """The bytes of a block do not match their checksum or cannot be parsed."""


class BlockMismatch(KVStoreError):
    """A well-formed block is not the one asked for (key, tokens, layout or namespace differ)."""


class NamespaceMismatch(BlockMismatch):
    """The block belongs to another model, dtype, layout or tenant."""


class PoolFull(KVStoreError):
    """The node's pool has no room for the block, even after evicting what it may evict."""


class InvalidRequest(KVStoreError, ValueError):
    """A store node rejected a malformed request; the message says which field is wrong."""


class RequestTooLarge(KVStoreError):
    """A request or block is larger than the configured limits allow."""


class LeaseExpired(KVStoreError):
    """A lease ended before its holder released it; the bytes may have been reused."""


class Unauthenticated(KVStoreError):
    """The caller's auth token is missing or wrong."""


class PermissionDenied(KVStoreError):
    """The caller is authenticated but its credential does not grant this tenant or call
    (another tenant's blocks, a write with a read-only credential, an admin call)."""


class Overloaded(KVStoreError):
    """A store node is at one of its configured limits (Put streams in flight, open leases,
    bytes of unfinished Puts); nothing was done: retry shortly (the client does, with backoff)."""


class NodeUnavailable(KVStoreError):
    """A store node or the coordinator could not be reached before the deadline."""


class RequestCancelled(KVStoreError):
    """The request was cancelled or timed out; its leases were released."""


class ClusterUnavailable(NodeUnavailable):
    """No Ray cluster to act on, or kvstore is not running on it; the message says what to run."""


class ClusterConflict(KVStoreError):
    """kvstore already runs on this Ray cluster with other settings than the ones asked for."""


class IndexBackendError(KVStoreError):
    """The external index (Redis) failed; the message names it by its password-masked URL."""


class IndexUnavailable(IndexBackendError, NodeUnavailable):
    """The Redis index cannot be reached (wrong host or port, down, or a timeout)."""


class IndexAuthError(IndexBackendError, Unauthenticated):
    """Redis refused the credentials, or a password was given to a Redis that has none."""
