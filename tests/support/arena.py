"""Damage a block where it lives: in a store node's arena file, as a faulty disk or a hostile
process on the node would, so every reader path meets the bad bytes."""

from __future__ import annotations

import os

from kvstore.node.block_pool import BlockPool


def corrupt_in_arena(pool: BlockPool, key: bytes) -> None:
    """Flip the block's last payload byte in the node's arena file (the tag no longer fits)."""
    lease = pool.lease([key], 5)
    loc = lease.locations[0]
    flip_last_byte(pool.path, loc.offset, loc.nbytes)
    pool.release(lease.lease_id)


def flip_last_byte(arena_path: str, offset: int, nbytes: int) -> None:
    """Flip the last byte of the block at ``offset`` (``nbytes`` long) in an arena file."""
    fd = os.open(arena_path, os.O_RDWR)
    try:
        last = offset + nbytes - 1
        os.pwrite(fd, bytes([os.pread(fd, 1, last)[0] ^ 0xFF]), last)
    finally:
        os.close(fd)
