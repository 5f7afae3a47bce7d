"""Which blocks a caller may see: tenants enforced by the node (docs/security.md §Tenants).

Every read names the reader's namespace (``KeysRequest.namespace``, ``LeaseRequest.namespace``,
the bulk request's): the credential must grant its tenant (the cache salt), and the node
serves only blocks whose stored namespace root equals that namespace's root, computed with
the node's copy of the cluster's data secret. Any other block reads as absent: neither its
bytes nor the token ids in its header reach the caller, and whether it is held is not told
either. Only an admin credential (the cluster token: replication, operators) may read without
a namespace, and only its reads name the reader's node (a tenant could otherwise make the
coordinator replicate blocks to any node it names).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvstore.errors import PermissionDenied
from kvstore.keys import Namespace
from kvstore.node.proto_forms import namespace_from_spec
from kvstore.protos import kvstore_pb2 as pb
from kvstore.security.grants import Grant

_MAX_ROOTS = 1024  # namespace roots remembered by spec (a dict, cleared when full)


@dataclass(frozen=True, slots=True)
class ReadScope:
    """What one read may see: blocks of ``root`` (None: every block, admin only), counted as
    read from ``reader_node_id``; ``namespace``: the reader's, rebuilt under the node's data
    key (its MAC key included), so a disk block promoted for it is checked as the reader
    will check it."""

    grant: Grant
    root: bytes | None
    reader_node_id: str
    namespace: Namespace | None = None


class RootCache:
    """A namespace spec's namespace (and root) under the node's data key, computed once per
    distinct spec."""

    def __init__(self, data_key: bytes | None) -> None:
        self.data_key = data_key
        self._namespaces: dict[bytes, Namespace] = {}
        self._lock = threading.Lock()

    def namespace(self, spec: pb.NamespaceSpec) -> Namespace:
        """``spec``'s namespace (ConfigError on nonsense fields)."""
        wire = spec.SerializeToString(deterministic=True)
        with self._lock:
            ns = self._namespaces.get(wire)
        if ns is None:
            ns = namespace_from_spec(spec, data_key=self.data_key)
            with self._lock:
                if len(self._namespaces) >= _MAX_ROOTS:
                    self._namespaces.clear()
                self._namespaces[wire] = ns
        return ns

    def root(self, spec: pb.NamespaceSpec) -> bytes:
        """The root of ``spec``'s namespace (ConfigError on nonsense fields)."""
        return self.namespace(spec).root


def read_scope(grant: Grant, spec: pb.NamespaceSpec | None, roots: RootCache,
               reader_node_id: str = "") -> ReadScope:
    """The scope of a read by ``grant`` in namespace ``spec`` (None: not named); raises
    PermissionDenied when the credential does not grant the tenant, or is a tenant credential
    that named no namespace."""
    if spec is None:
        if not grant.admin:
            raise PermissionDenied(
                f"credential {grant.subject!r} is a tenant credential: a read must name its "
                "namespace (upgrade the client: this node enforces tenants)")
        return ReadScope(grant, None, reader_node_id)
    grant.check_read(spec.cache_salt)
    ns = roots.namespace(spec)
    return ReadScope(grant, ns.root, reader_node_id if grant.admin else "", ns)


def spec_of(request: pb.KeysRequest | pb.LeaseRequest) -> pb.NamespaceSpec | None:
    """The namespace a read request names, or None."""
    return request.namespace if request.HasField("namespace") else None
