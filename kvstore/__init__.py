"""kvstore: a distributed KV-cache store for LLM inference with disaggregated prefill.

The public API, importable from the package top::

    from kvstore import connect, start, stop, LocalStore, KVStore, Namespace, BlockHasher

``start``/``stop`` bring the coordinator and one store node per Ray node up and down,
``connect`` returns a ``KVStore`` over the running cluster, ``LocalStore`` is the embedded
in-process store, and ``Namespace``/``BlockHasher`` make the chained block keys. The names are
loaded on first use (PEP 562), so ``import kvstore.errors`` does not start importing Ray.
The layers below, lowest first: the package top's modules with ``kvstore.security`` and
``kvstore.ops``, then ``index``, ``node``, ``coordinator``, ``client``, ``cluster``, ``workers``,
``frontend``, ``integrations`` and ``cli``; each imports only downwards (tests/test_layout.py)
and docs/design.md §2 draws the map.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "connect": "kvstore.cluster.lifecycle",
    "start": "kvstore.cluster.lifecycle",
    "stop": "kvstore.cluster.lifecycle",
    "LocalStore": "kvstore.client.local_store",
    "ClusterStore": "kvstore.client.cluster_store",
    "KVStore": "kvstore.api",
    "Namespace": "kvstore.keys",
    "BlockHasher": "kvstore.keys",
    "KVStoreConfig": "kvstore.config",
    "load_config": "kvstore.config_loader",
}

__all__ = ["BlockHasher", "ClusterStore", "KVStore", "KVStoreConfig", "LocalStore", "Namespace",
           "connect", "load_config", "start", "stop"]

if TYPE_CHECKING:
    from kvstore.api import KVStore
    from kvstore.client.cluster_store import ClusterStore
    from kvstore.client.local_store import LocalStore
    from kvstore.cluster.lifecycle import connect, start, stop
    from kvstore.config import KVStoreConfig
    from kvstore.config_loader import load_config
    from kvstore.keys import BlockHasher, Namespace


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
