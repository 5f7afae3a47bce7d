"""Damage a block where it lives: in a store node's arena file, as a faulty disk or a hostile
process on the node would, so every reader path meets the bad bytes."""

from __future__ import annotations

import os

from kvstore.node.block_pool import BlockPool


def corrupt_in_arena(pool: BlockPool, key: bytes) -> None:
    """Flip the block's last payload byte in the node's arena file (the tag no longer fits)."""
    lease = pool.lease([key], 5)
    loc = lease.locations[0]
    fd = os.open(pool.path, os.O_RDWR)
    try:
        last = loc.offset + loc.nbytes - 1
        os.pwrite(fd, bytes([os.pread(fd, 1, last)[0] ^ 0xFF]), last)
    finally:
        os.close(fd)
    pool.release(lease.lease_id)
