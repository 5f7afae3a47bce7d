"""Reads whose payloads go to a device (``batch_get(..., device=...)``): verify, then expose.

Which way a block travels::

    same node, blocks > SMALL_BLOCK_BYTES, arena page-locked (or a CPU target): direct
        CUDA: every leased payload arena -> device row, async on the side stream, issued first
        meanwhile on the verify pool: verify_block over the same leased arena bytes
        CPU:  per block on the verify pool: verify_block, then copy the payload to its row
        wait for the copies; zero the rows of rejected blocks; the caller re-checks the lease
    same node, small blocks, or an arena the driver would not page-lock: staged
        gather into host staging rows, verify there, one copy of the batch to the device
    other node (bulk channel, gRPC): staged
        land in host staging rows (pinned for CUDA, reused), verified request by request
        while the next one streams, one copy of the batch to the device

Verifying the leased arena bytes instead of a copy is sound because of the lease: a block is
immutable, and its extent is not reused while a lease holds it. The copies land before the
caller's lease check, so a block counts as fetched only if the bytes the device got were
leased, unchanged, the whole time they were verified and copied. A rejected block's row is
zeroed (a DMA may already have written it); on the CPU it is never written at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore.block import block_nbytes, payload_offset, verify_block
from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import Namespace
from kvstore.node.device_copy import DeviceRows, StagingPool
from kvstore.node.pool import BlockLocation
from kvstore.node.shm_reader import (
    ShmReader,
    copy_verified_batch,
    detached,
    gather_verified,
    is_small_batch,
)
from kvstore.node.verify_pool import parallel_map

#: The most host staging one batch holds at once (per client, pinned for CUDA): a larger batch
#: is staged and copied in parts of this size.
STAGING_BYTES = 256 << 20

#: ``land(lo, hi, stage)``: put blocks ``lo..hi-1`` into ``stage`` rows, return their verdicts
#: (size, rejection, or None) and, per stage row in use, which block (counted from ``lo``).
Land = Callable[[int, int, torch.Tensor], tuple[list[Any], Sequence[int]]]


def shm_into_device(reader: ShmReader, where: dict[bytes, BlockLocation], keys: list[bytes],
                    token_ids: Sequence[Any] | None, namespace: Namespace, sink: DeviceRows,
                    rows: Sequence[int], keep_alive: Callable[[], None], staging: StagingPool
                    ) -> list[Any]:
    """A same-node read into device rows (block ``i`` -> ``rows[i]``), under a lease whose
    locations are ``where``; per key its size, a detached rejection, or None (not held).
    Every copy out of the arena has landed when this returns."""
    nbytes = block_nbytes(namespace)

    def tokens(lo: int, hi: int) -> Sequence[Any] | None:
        return None if token_ids is None else token_ids[lo:hi]

    if is_small_batch(where, namespace):
        def land_small(lo: int, hi: int, stage: torch.Tensor) -> tuple[list[Any], list[int]]:
            held, verdicts = gather_verified(reader, where, keys[lo:hi], stage.numpy(),
                                             namespace, tokens(lo, hi), keep_alive)
            out: list[Any] = [None] * (hi - lo)
            for j, verdict in zip(held, verdicts, strict=True):
                out[j] = verdict if isinstance(verdict, Exception) else nbytes
            return out, held

        return staged_into_device(land_small, len(keys), namespace, sink, rows, staging)
    if not reads_directly(sink, reader):
        def land_large(lo: int, hi: int, stage: torch.Tensor) -> tuple[list[Any], range]:
            verdicts = copy_verified_batch(reader, where, keys[lo:hi], list(stage.numpy()),
                                           namespace, tokens(lo, hi), keep_alive)
            return verdicts, range(hi - lo)

        return staged_into_device(land_large, len(keys), namespace, sink, rows, staging)
    return _direct(reader, [where.get(k) for k in keys], keys,
                   [None] * len(keys) if token_ids is None else token_ids, namespace, sink, rows,
                   keep_alive)


def reads_directly(sink: DeviceRows, reader: ShmReader) -> bool:
    """Whether large blocks go straight from the arena to ``sink``: always to the CPU, to CUDA
    once the arena is page-locked (tests force the staged way by replacing this)."""
    return not sink.is_cuda or reader.pin_for_dma()


def _direct(reader: ShmReader, locs: list[BlockLocation | None], keys: list[bytes],
            tokens: Sequence[Any], namespace: Namespace, sink: DeviceRows, rows: Sequence[int],
            keep_alive: Callable[[], None]) -> list[Any]:
    """Copy each leased payload straight from the arena to its row while verifying the arena
    bytes (CUDA: all copies issued up front, verification overlapping the DMA)."""
    off, size = payload_offset(namespace), namespace.payload_nbytes
    early = sink.is_cuda  # a DMA runs beside the host; a CPU copy would only take a thread

    def one(j: int) -> Any:
        keep_alive()
        loc = locs[j]
        if loc is None:
            return None
        try:
            verify_block(reader.view(loc.offset, loc.nbytes), namespace, keys[j], tokens[j])
        except (BlockCorrupted, BlockMismatch) as exc:
            return detached(exc)
        if not early:
            sink.copy(rows[j], reader.tensor(loc.offset + off, size))
        return loc.nbytes

    try:
        if early:
            for j, loc in enumerate(locs):
                if loc is not None and loc.nbytes >= off + size:  # shorter: rejected below
                    sink.copy(rows[j], reader.tensor(loc.offset + off, size))
        verdicts = parallel_map(one, len(keys),
                                nbytes=sum(loc.nbytes for loc in locs if loc is not None))
        if early:
            sink.zero([rows[j] for j, v in enumerate(verdicts) if isinstance(v, Exception)])
    finally:
        sink.wait()  # nothing reads the arena once the caller may release the lease
    return verdicts


def staged_into_device(land: Land, num_blocks: int, namespace: Namespace, sink: DeviceRows,
                       rows: Sequence[int], staging: StagingPool) -> list[Any]:
    """Blocks landed and verified in host staging rows by ``land``, then the good ones copied
    to their device rows (block ``i`` -> ``rows[i]``) in one copy per part of at most
    ``STAGING_BYTES``; per block the verdict ``land`` gave."""
    nbytes = block_nbytes(namespace)
    off = payload_offset(namespace)
    cols = slice(off, off + namespace.payload_nbytes)
    per = max(1, STAGING_BYTES // nbytes)
    out: list[Any] = []
    for lo in range(0, num_blocks, per):
        hi = min(num_blocks, lo + per)
        with staging.rows(hi - lo, nbytes, pinned=sink.is_cuda) as stage:
            try:
                verdicts, row_blocks = land(lo, hi, stage)
                good = [(r, j) for r, j in enumerate(row_blocks) if _fetched(verdicts[j])]
                sink.copy_rows(stage, [r for r, _ in good], [rows[lo + j] for _, j in good],
                               cols)
            finally:
                sink.wait()  # the copy has read the staging rows before they go back
        out += verdicts
    return out


def _fetched(verdict: Any) -> bool:
    """A verdict that is a block's size (not a rejection, not absent)."""
    return isinstance(verdict, int) and not isinstance(verdict, bool)
