"""The store directory as a client is given it: one node's address at a time, or every node's.

``ClusterStore`` takes either ``node_id -> NodeAddress`` (tests, a fixed table) or a
zero-argument call returning every node by id (the coordinator's directory). Only the second
can say which nodes there are (``kvstore.client.sole_node``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

from kvstore.records import NodeAddress

Directory = Callable[[str], NodeAddress] | Callable[[], Mapping[str, NodeAddress]]


def _takes_id(directory: Directory) -> bool:
    try:
        params = inspect.signature(directory).parameters
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               for p in params.values())


def lister(directory: Directory) -> Callable[[], Mapping[str, NodeAddress]] | None:
    """The zero-argument directory (every node by id), or None for a per-id resolver."""
    return None if _takes_id(directory) else directory  # type: ignore[return-value]


def resolver(directory: Directory) -> Callable[[str], NodeAddress]:
    """Accept ``node_id -> NodeAddress`` or a zero-argument ``() -> {node_id: NodeAddress}``."""
    if _takes_id(directory):
        return directory  # type: ignore[return-value]

    def resolve(node: str) -> NodeAddress:
        return directory()[node]  # type: ignore[call-arg,index]

    return resolve
