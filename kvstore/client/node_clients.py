"""One ``StoreNodeClient`` per store node, made on first use at the directory's address.

A store node that dies is replaced on the same host by a new process on new ports (Ray's
watcher, ``kvstore start`` again, a restart that kept its disk tier). Its node id stays; only
the directory's address says which process answers. So a client is dropped after it fails
(the next use resolves again), and whenever a listing of the directory names its node at
another address: without that a client that failed quietly (a lookup's bulk question, which
falls back to the index rather than raising) would keep asking the dead process.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from kvstore.client.directory import Directory, resolver
from kvstore.client.node_client import StoreNodeClient
from kvstore.client.unreachable import UnreachableNodes
from kvstore.config import ClientConfig
from kvstore.errors import KVStoreError, NodeUnavailable
from kvstore.records import NodeAddress


class NodeClients:
    """The clients of one ``ClusterStore`` by node id (thread-safe)."""

    def __init__(self, directory: Directory, config: ClientConfig, *, local_node_id: str,
                 lease_ttl_s: float, unreachable: UnreachableNodes) -> None:
        """``unreachable``: told every address resolved, so that a replaced node is trusted
        at once rather than after its predecessor's cooldown."""
        self._resolve = resolver(directory)
        self.config = config
        self.local_node_id = local_node_id
        self.lease_ttl_s = lease_ttl_s
        self.unreachable = unreachable
        self._clients: dict[str, StoreNodeClient] = {}
        self._lock = threading.Lock()

    def get(self, node: str) -> StoreNodeClient:
        """``node``'s client; raises ``NodeUnavailable`` when the directory does not list it."""
        with self._lock:
            client = self._clients.get(node)
        if client is not None:
            return client
        try:
            addr = self._resolve(node)
        except Exception as exc:
            raise NodeUnavailable(f"node {node[:12]} is not in the directory: {exc}") from exc
        self.unreachable.resolved(node, addr.grpc_address)
        client = StoreNodeClient(
            addr.grpc_address, bulk_address=addr.bulk_address, shm_path=addr.shm_path,
            same_node=node == self.local_node_id, config=self.config,
            lease_ttl_s=self.lease_ttl_s, reader_node_id=self.local_node_id,
        )
        with self._lock:
            existing = self._clients.setdefault(node, client)
        if existing is not client:
            client.close()
        return existing

    def get_or_none(self, node: str) -> StoreNodeClient | None:
        try:
            return self.get(node)
        except KVStoreError:
            return None

    def cached(self, node: str) -> StoreNodeClient | None:
        """``node``'s client if one is made already (never asks the directory)."""
        with self._lock:
            return self._clients.get(node)

    def drop(self, node: str) -> None:
        """Close ``node``'s client: the next use reconnects, at the address resolved then."""
        with self._lock:
            client = self._clients.pop(node, None)
        if client is not None:
            client.close()

    def saw_directory(self, listing: Mapping[str, NodeAddress]) -> None:
        """A listing of every node: drop the clients of nodes that moved, and forgive them."""
        for node, addr in listing.items():
            self.unreachable.resolved(node, addr.grpc_address)
            with self._lock:
                client = self._clients.get(node)
                if client is None or client.address == addr.grpc_address:
                    continue
                del self._clients[node]
            client.close()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
