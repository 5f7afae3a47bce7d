"""The store-node actor as Ray sees it: a thin class whose module imports nothing heavy.

Whoever creates the actor (``kvstore start``) or looks it up by name (``kvstore stop``,
``status``, the watcher) makes Ray load this class, and Ray imports its module to do so. The
node itself (``kvstore.cluster.store_node``) needs the block codec, the server and so torch:
seconds of imports that an operator command would pay for nothing. So the node is built
inside the actor process, in ``__init__``, and the actor's methods hand each call to it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from kvstore.config import KVStoreConfig
    from kvstore.records import NodeAddress, PoolStats

log = logging.getLogger(__name__)


class StoreNodeHost:
    """The actor: one ``StoreNode`` per Ray node (see ``kvstore.cluster.store_node``)."""

    def __init__(self, config: KVStoreConfig) -> None:
        from kvstore.cluster.store_node import StoreNode

        serve_at_normal_priority()
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


def serve_at_normal_priority() -> bool:
    """Undo Ray's worker niceness (15 unless ``RAY_worker_niceness`` says otherwise) for this
    process, whose threads then start at normal priority too; whether it runs at 0 or better.

    Ray lowers its workers' priority so a busy task never starves its own control plane. A
    store node is a server on its readers' path, though: at nice 15, any process of normal
    priority on the same core (a vLLM engine polling for its worker, say) gets nearly all of
    that core while a lease or a fetch waits for the node. Raising a priority needs the right
    to (root, or CAP_SYS_NICE); without it the node stays as Ray started it, and says how to
    start it at normal priority."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) <= 0:
            return True
        # Linux: each thread has a niceness of its own; elsewhere the process has one
        tasks = "/proc/self/task"
        for tid in os.listdir(tasks) if os.path.isdir(tasks) else ["0"]:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
            except ProcessLookupError:  # a thread that has ended since
                continue
    except (OSError, AttributeError) as exc:  # no right to (or no priorities here)
        log.warning("the store node runs at Ray's worker niceness, behind every process of "
                    "normal priority on its cores (%s): start Ray with RAY_worker_niceness=0 "
                    "or give the node CAP_SYS_NICE", exc)
        return False
    return True
