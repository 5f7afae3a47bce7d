"""Whether a store node's pool fits in its shared-memory directory, asked before anything starts.

A store node reserves its whole pool in ``pool.shm_dir`` (tmpfs: RAM) when it starts
(``kvstore.node.arena``), and a pool that does not fit fails there, after a Ray head, the
coordinator and the node's actor have been brought up for nothing. Where the node will run on
this machine, the command asks the filesystem first and refuses at once, saying how much room
there is.
"""

from __future__ import annotations

import os

from kvstore.config import PoolConfig
from kvstore.errors import ConfigError


def free_bytes(shm_dir: str) -> int:
    """Bytes an unprivileged process may still allocate in ``shm_dir``'s filesystem."""
    stats = os.statvfs(shm_dir)
    return stats.f_bavail * stats.f_frsize


def size_text(num_bytes: float) -> str:
    """A size for a message, in binary units: ``1.0 TiB``, ``23.4 GiB``, ``512 B``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def check_pool_fits(pool: PoolConfig) -> None:
    """Raise ConfigError when ``pool.capacity_bytes`` exceeds the free room in ``pool.shm_dir``.

    A check, not a reservation: another process may take the room before the node does, and
    then the node's own allocation fails with its own message, as before.
    """
    room = free_bytes(pool.shm_dir)
    if pool.capacity_bytes > room:
        raise ConfigError(
            f"pool capacity {size_text(pool.capacity_bytes)} does not fit in {pool.shm_dir}, "
            f"which has {size_text(room)} free: give a smaller --capacity (or "
            f"pool.capacity_bytes), or free room in {pool.shm_dir}")
