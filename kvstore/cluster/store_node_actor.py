"""The store-node actor as Ray sees it: a thin class whose module imports nothing heavy.

Whoever creates the actor (``kvstore start``) or looks it up by name (``kvstore stop``,
``status``, the watcher) makes Ray load this class, and Ray imports its module to do so. The
node itself (``kvstore.cluster.store_node``) needs the block codec, the server and so torch:
seconds of imports that an operator command would pay for nothing. So the node is built
inside the actor process, in ``__init__``, and the actor's methods hand each call to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ray

from kvstore.process_priority import serve_at_normal_priority

if TYPE_CHECKING:
    from kvstore.config import KVStoreConfig
    from kvstore.records import NodeAddress, PoolStats


class StoreNodeHost:
    """The actor: one ``StoreNode`` per Ray node (see ``kvstore.cluster.store_node``)."""

    def __init__(self, config: KVStoreConfig) -> None:
        from kvstore.cluster.store_node import StoreNode

        serve_at_normal_priority("the store node")
        self.node = StoreNode(config)

    def ping(self) -> NodeAddress:
        """Where this node listens (returns once the node has registered)."""
        return self.node.ping()

    def stats(self) -> PoolStats:
        return self.node.stats()

    def keys(self) -> list[bytes]:
        return self.node.keys()

    def pin(self, keys: list[bytes]) -> int:
        return self.node.pin(keys)

    def reload_credentials(self, auth_token: str | None, previous_auth_token: str | None,
                           client_auth_token: str | None = None,
                           tls_cert_pem: str | None = None, tls_key_pem: str | None = None
                           ) -> bool:
        return self.node.reload_credentials(auth_token, previous_auth_token,
                                            client_auth_token, tls_cert_pem, tls_key_pem)

    def heartbeat_now(self) -> int:
        return self.node.heartbeat_now()

    def shutdown(self, purge: bool = False) -> None:
        self.node.shutdown(purge)


StoreNodeActor = ray.remote(num_cpus=0)(StoreNodeHost)
