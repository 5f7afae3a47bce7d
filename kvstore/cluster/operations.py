"""What an operator does to a running cluster: look at it, pin, unpin, drain, invalidate.

Every verb goes through the coordinator, which keeps the one LRU view of the cluster and sends
the resulting orders to the store nodes in their heartbeats. The caller connects to Ray first
(``kvstore.cluster.lifecycle.ensure_ray``); each function raises ``NodeUnavailable`` when no
coordinator is running.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

from kvstore.cluster.names import coordinator_handle
from kvstore.errors import ConfigError

if TYPE_CHECKING:  # kvstore.keys imports torch; an operator command must not
    from kvstore.keys import Namespace


def status() -> dict[str, Any]:
    """The coordinator's json-able view of the cluster: nodes, totals, drift, top prefixes."""
    return ray.get(coordinator_handle().status.remote())


def security() -> dict[str, Any]:
    """Whether auth, TLS, tenant checks and keyed namespaces are on, as the running config
    says (``credentials.summary``: on/off and dates, never a secret)."""
    from kvstore.cluster.credentials import summary
    from kvstore.cluster.lifecycle import running_config

    running = running_config()
    return summary(running) if running is not None else {}


def ray_reach() -> dict[str, Any]:
    """Who can reach Ray itself: its GCS address, its nodes' addresses, whether all of them
    are loopback (then nothing of Ray answers from the network: ``kvstore.cluster.head``), and
    the Ray auth mode this process runs with. Anyone who reaches a Ray that has auth disabled
    can run code as its user, so ``kvstore status`` shows this beside kvstore's own security."""
    from kvstore.cluster.credentials import is_loopback

    gcs = str(ray.get_runtime_context().gcs_address)
    ips = sorted({str(n.get("NodeManagerAddress", "")) for n in ray.nodes() if n.get("Alive")})
    return {"gcs_address": gcs, "node_ips": ips, "auth_mode": _ray_auth_mode(),
            "loopback": is_loopback(gcs.rpartition(":")[0]) and all(map(is_loopback, ips))}


def _ray_auth_mode() -> str:
    try:
        from ray._private.authentication.authentication_utils import (
            get_authentication_mode_name,
        )
        from ray._raylet import get_authentication_mode  # type: ignore[attr-defined]

        return str(get_authentication_mode_name(get_authentication_mode()))
    except ImportError:  # a Ray without token auth
        return "disabled"


def pin(keys: Sequence[bytes], *, hard: bool = True, ttl_s: float | None = None,
        ahead: bool = False) -> tuple[int, int]:
    """Pin blocks (hard: never evicted; soft: evicted last, after ``ttl_s``).

    Returns ``(pinned, cached)``; without ``ahead`` only cached keys are pinned.
    """
    pinned, cached = ray.get(coordinator_handle().pin.remote(
        list(keys), hard=hard, ttl_s=ttl_s, ahead=ahead))
    return int(pinned), int(cached)


def unpin(keys: Sequence[bytes]) -> tuple[int, int]:
    """Remove pins; returns ``(keys that were pinned, keys that are cached)``."""
    unpinned, cached = ray.get(coordinator_handle().unpin.remote(list(keys)))
    return int(unpinned), int(cached)


def ls(limit: int = 20) -> dict[str, Any]:
    """Namespaces and the ``limit`` most recently used cached prefixes, full keys in hex."""
    return ray.get(coordinator_handle().ls.remote(limit))


def resolve_node_id(given: str, node_ids: Sequence[str]) -> str:
    """The node id ``given`` names: itself, or the one id it is a unique prefix of.

    ``kvstore status`` shortens ids to fit 80 columns; what it prints must still work here.
    """
    if given in node_ids:
        return given
    matches = [n for n in node_ids if n.startswith(given)]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(sorted(node_ids)) or "none"
    if matches:
        raise ConfigError(f"node id prefix {given!r} matches {len(matches)} nodes; "
                          f"give more digits (nodes: {known})")
    raise ConfigError(f"no node id starts with {given!r} (nodes: {known})")


def drain(node_id: str) -> tuple[str, int]:
    """Move a node's blocks elsewhere (or evict them) so it can leave.

    ``node_id`` may be a unique prefix; returns the full id and the block count.
    """
    full = resolve_node_id(node_id, [n["node_id"] for n in status().get("nodes", [])
                                     if n.get("alive", True)])
    return full, int(ray.get(coordinator_handle().drain.remote(full)))


def salt_label(cache_salt: str) -> str:
    """How ``kvstore ls`` shows a tenant salt: ``default`` for none, else a short hash (the salt
    may be a secret). A worker's own suffix (after a NUL: ``reuse=block``) stays readable."""
    base, _, extra = cache_salt.partition("\x00")
    label = "default" if not base else "#" + hashlib.sha256(base.encode()).hexdigest()[:8]
    return f"{label}+{extra}" if extra else label


def describe_namespace(namespace: Namespace, model: str) -> dict[str, Any]:
    """A namespace as a worker reports it: the root, its fields, the salt as a label only."""
    return {"root": namespace.root.hex(), "model": model,
            "model_fingerprint": namespace.model_fingerprint, "dtype": namespace.dtype,
            "block_size": namespace.block_size, "num_layers": namespace.num_layers,
            "num_kv_heads": namespace.num_kv_heads, "head_dim": namespace.head_dim,
            "salt": salt_label(namespace.cache_salt), "numerics": namespace.numerics}


def report_worker(worker_id: str, info: dict[str, Any]) -> None:
    """Tell the coordinator what a prefill or decode worker runs (shown by ``kvstore status``)."""
    ray.get(coordinator_handle().report_worker.remote(worker_id, info))


def forget_worker(worker_id: str) -> None:
    """Tell the coordinator a worker closed."""
    ray.get(coordinator_handle().forget_worker.remote(worker_id))


def invalidate(namespace_root: bytes) -> int:
    """Evict every block of one namespace on every node; returns how many were ordered out."""
    return int(ray.get(coordinator_handle().invalidate.remote(namespace_root)))


def invalidate_keys(keys: Sequence[bytes]) -> int:
    """Evict exactly ``keys`` on every node; returns how many were cached."""
    return int(ray.get(coordinator_handle().invalidate_keys.remote(list(keys))))
