"""Where kvstore's pieces are found on a Ray cluster: the namespace, actor and arena names.

Everything is a named actor in the Ray namespace ``kvstore``, so any process on the cluster finds
it by name: the coordinator (``kvstore-coordinator``), the store nodes
(``kvstore-store-<ray node id>``) and the watcher (``kvstore-watcher``). Arena files carry the
Ray node id and their owner process (``kvstore.node.arena_files``), so a restarted store node
never maps its dead predecessor's file, ``kvstore stop`` can sweep exactly this cluster's files,
and any kvstore command can remove the files of owners that are gone.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvstore.errors import ClusterUnavailable
from kvstore.node import arena_files

RAY_NAMESPACE = "kvstore"
COORDINATOR_NAME = "kvstore-coordinator"
WATCHER_NAME = "kvstore-watcher"
STORE_PREFIX = "kvstore-store-"
ARENA_PREFIX = arena_files.ARENA_PREFIX


def store_actor_name(node_id: str) -> str:
    """The name of the store-node actor on the Ray node ``node_id``."""
    return STORE_PREFIX + node_id


def arena_name(node_id: str) -> str:
    """The arena file name of this process's store node: the owner recorded in it keeps a
    restarted node off its predecessor's file and lets a later sweep judge the file."""
    return arena_files.owned_name(node_id[:16])


def arena_stem(node_id: str) -> str:
    """What every arena file of the store nodes of Ray node ``node_id`` starts with."""
    return f"{ARENA_PREFIX}{node_id[:16]}"


def arena_glob(shm_dir: str, node_id: str) -> str:
    """A glob matching every arena file (live or dead) of Ray node ``node_id`` in ``shm_dir``."""
    return os.path.join(shm_dir, f"{arena_stem(node_id)}-*")


def coordinator_handle() -> Any:
    """The running coordinator actor; raises ClusterUnavailable when kvstore is not started."""
    import ray

    # A busy GCS can fail a name lookup transiently: retry briefly before saying "not running".
    for attempt in range(3):
        try:
            return ray.get_actor(COORDINATOR_NAME, namespace=RAY_NAMESPACE)
        except ValueError:
            if attempt < 2:
                time.sleep(1.0)
    raise ClusterUnavailable(
        "kvstore is not running on this Ray cluster (no coordinator): run `kvstore start`"
    )
