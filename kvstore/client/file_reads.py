"""Same-node reads of disk-tier blocks straight from their files.

A node with a disk tier leases a block it holds only on disk, and has not served lately, as
its file (``BlockLocation.path``; ``TieredPool.lease(files=True)``) when the reader is on the
same node. The reader then reads the file into its own buffer and verifies it there: one read
and one verification, where a promotion costs a read and a verification into the node's arena
and a second copy and verification out of it. The reads go through ``disk_reads``' pipelined
reader (``O_DIRECT`` where the filesystem allows it), the next file read while this thread
verifies the last one, as the node's own promotions do.

The lease does not hold a file: the disk tier may drop it (its LRU, a damaged file) before the
reader opens it. A block whose file is gone, cannot be opened, or fails verification here is
returned for the caller to ask for again without files: the node then promotes it, its own
verification is the judge (a damaged file is dropped there, counted, and the key is a miss, so
the next reader does not meet it again), and the copy out of the arena is verified as ever.
Nothing read from a file reaches the caller unverified when a namespace is given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.block import verify_block
from kvstore.client.shm_reader import (
    Buffer,
    as_uint8_array,
    copy_then_verify,
    copy_verified_batch,
    is_small_batch,
)
from kvstore.errors import BlockCorrupted, BlockMismatch, BlockNotFound
from kvstore.keys import Namespace
from kvstore.node.disk_reads import BlockFileReader
from kvstore.node.pool_contract import BlockLocation


@functools.cache
def file_reader() -> BlockFileReader:
    """The process's block-file reader (its threads are started on first use)."""
    return BlockFileReader("direct", num_threads=2)


def read_leased(reader: Any, where: dict[bytes, BlockLocation], keys: list[bytes],
                buffers: Sequence[Buffer], namespace: Namespace | None,
                token_ids: Sequence[Any] | None, keep_alive: Callable[[], None],
                again: list[int]) -> list[Any]:
    """A same-node lease's blocks (``where``) into ``buffers``, verified when ``namespace``
    is given: arena blocks copied out of the mapped arena (``shm_reader``), file blocks read
    (``read_files_into``, whose indices to ask for again are appended to ``again``). Per key
    its size, a detached BlockCorrupted / BlockMismatch, or None (not held)."""
    files = {k: loc for k, loc in where.items() if loc.path}
    if files:
        where = {k: loc for k, loc in where.items() if not loc.path}
    if namespace is not None and is_small_batch(where, namespace):
        out = copy_then_verify(reader, where, keys, buffers, namespace, token_ids, keep_alive)
    else:
        out = copy_verified_batch(reader, where, keys, buffers, namespace, token_ids,
                                  keep_alive)
    if files:
        again.extend(read_files_into(files, keys, buffers, namespace, token_ids, out))
    return out


def read_files_into(files: dict[bytes, BlockLocation], keys: list[bytes],
                    buffers: Sequence[Buffer], namespace: Namespace | None,
                    token_ids: Sequence[Any] | None, out: list[Any]) -> list[int]:
    """Read the file blocks among ``keys`` into their buffers, verified when ``namespace`` is
    given (header, key, tokens, checksum or MAC), and set each one read whole and verified to
    its size in ``out``. Returns the indices of the others (gone, unreadable, truncated or
    rejected), to be asked for again without files."""
    picked = [i for i, k in enumerate(keys) if k in files]
    jobs = []
    for i in picked:
        nbytes = files[keys[i]].nbytes
        dst = as_uint8_array(buffers[i])
        if dst.size < nbytes:
            raise ValueError(f"destination of {dst.size} bytes is too small for a "
                             f"{nbytes}-byte block")
        jobs.append((files[keys[i]].path, memoryview(dst[:nbytes].data).cast("B")))
    again: list[int] = []
    results = file_reader().read_many(jobs)
    try:
        for i, (_, dest), got in zip(picked, jobs, results, strict=True):
            if isinstance(got, (BlockNotFound, BlockCorrupted, OSError)):
                again.append(i)
            elif isinstance(got, Exception):
                raise got
            elif namespace is None or _verifies(dest, namespace, keys[i],
                                                None if token_ids is None else token_ids[i]):
                out[i] = got
            else:
                again.append(i)
    finally:
        results.close()  # no reader thread writes into a buffer once this returns
    return again


def _verifies(dest: memoryview, namespace: Namespace, key: bytes, tokens: Any) -> bool:
    try:
        verify_block(dest, namespace, key, tokens)
    except (BlockCorrupted, BlockMismatch):
        return False
    return True
