"""Reads whose payloads go to a device (``batch_get(..., device=...)``): verify, then expose.

Which way a block travels::

    same node, blocks > SMALL_BLOCK_BYTES, arena page-locked (or a CPU target): direct
        CUDA: each run of adjacent leased blocks arena -> device rows in one async copy on
              the copy stream, all issued first; for an early reader (a prefill that
              computes as blocks land) one 2-D copy per layer of each run instead, layer
              after layer, with a mark after each layer
        meanwhile on the host: each header checked against the request (unkeyed namespaces,
              Triton at hand: kvstore.client.device_checksum then hashes the payloads on the
              device, behind the copies, in one kernel); else verify_block over the same
              leased arena bytes on the verify pool
        CPU:  per block on the verify pool: verify_block, then copy the block to its row
        wait for the copies; zero the rows of rejected blocks; the caller re-checks the lease
    same node, small blocks, or an arena the driver would not (or not yet) page-lock: staged
        gather into host staging rows, verify there, one copy per part to the device
    other node (bulk channel, gRPC): staged
        land in host staging rows (pinned for CUDA, reused), verified request by request
        while the next one streams, one copy per part to the device, the next part landing
        in a second buffer meanwhile

Verifying the leased arena bytes instead of a copy is sound because of the lease: a block is
immutable, and its extent is not reused while a lease holds it. The copies land before the
caller's lease check, so a block counts as fetched only if the bytes the device got were
leased, unchanged, the whole time they were verified and copied. A rejected block's row is
zeroed (a DMA may already have written it); on the CPU it is never written at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore import metrics
from kvstore.block import _template, block_nbytes, payload_offset, verify_block
from kvstore.block_batch import canonical_headers
from kvstore.client import device_checksum
from kvstore.client.device_copy import DeviceRows, StagingPool
from kvstore.client.shm_reader import (
    ShmReader,
    copy_verified_batch,
    detached,
    gather_verified,
    is_small_batch,
)
from kvstore.client.verify_pool import parallel_map
from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import Namespace
from kvstore.node.block_pool import BlockLocation

#: The most host staging one batch holds at once (per client, pinned for CUDA): a larger batch
#: is staged and copied in parts of this size.
STAGING_BYTES = 256 << 20

#: Threads that verify a read whose rows were offered early (``DeviceRows.early``): the
#: model's forward then runs beside the verification and needs the GIL for its kernel
#: launches, so a few threads (still hashing faster than the forward computes) contend with it
#: less than the whole pool would.
EARLY_VERIFY_THREADS = 4

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
    once the arena is page-locked. The registration runs in the background (it can take
    seconds for a large arena); reads stage until it is done, and where the driver refuses
    (tests force the staged way by replacing this)."""
    if not sink.is_cuda:
        return True
    direct = reader.pin_for_dma(sink.device, wait=False)
    metrics.record_device_read("direct" if direct else "staged")
    return direct


def _runs(locs: list[BlockLocation | None], rows: Sequence[int], nbytes: int, stride: int
          ) -> list[tuple[int, int]]:
    """Maximal runs ``(first, count)`` of blocks whose arena extents lie ``stride`` apart and
    whose rows follow each other: each is one copy. A block of the wrong size is left out
    (verification rejects it)."""
    out: list[tuple[int, int]] = []
    for j, loc in enumerate(locs):
        if loc is None or loc.nbytes != nbytes:
            continue
        if out:
            first, count = out[-1]
            prev = locs[first + count - 1]
            if first + count == j and prev is not None and \
                    loc.offset == prev.offset + stride and rows[j] == rows[j - 1] + 1:
                out[-1] = (first, count + 1)
                continue
        out.append((j, 1))
    return out


def _direct(reader: ShmReader, locs: list[BlockLocation | None], keys: list[bytes],
            tokens: Sequence[Any], namespace: Namespace, sink: DeviceRows, rows: Sequence[int],
            keep_alive: Callable[[], None]) -> list[Any]:
    """Copy the leased blocks straight from the arena to their rows while verifying the arena
    bytes (CUDA: one copy per run of adjacent blocks, or per layer of each run for a caller
    that computes as layers land, all issued up front, verification overlapping the DMA)."""
    nbytes = block_nbytes(namespace)
    early = sink.is_cuda  # a DMA runs beside the host; a CPU copy would only take a thread
    # Rows of whole blocks take runs of adjacent blocks in one copy; rows of payloads only
    # (payload_offset 0) take each block's payload.
    skip = 0 if sink.payload_offset else payload_offset(namespace)
    on_device = early and _checks_on_device(namespace, sink)
    by_layer = sink.early is not None and namespace.payload_nbytes % namespace.num_layers == 0

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
            sink.copy(rows[j], reader.tensor(loc.offset + skip, nbytes - skip))
        return loc.nbytes

    try:
        if early:
            runs = _runs(locs, rows, nbytes, sink.row_stride) if not skip else \
                [(j, 1) for j, loc in enumerate(locs) if loc is not None and loc.nbytes == nbytes]
            layer_marks = _issue_copies(reader, locs, runs, rows, sink, namespace, skip,
                                        by_layer)
            sink.issued([rows[j] for first, count in runs for j in range(first, first + count)],
                        layer_marks)
            if sink.early is not None:
                sink.early.wait_taken()  # the caller starts computing before we check
        verdicts: list[Any] | None = None
        if on_device:
            keep_alive()
            verdicts, digests = check_headers(reader, locs, keys, tokens, namespace)
            if digests and not _device_verdicts(sink, rows, keys, digests, namespace, verdicts):
                verdicts = None  # the kernel failed (said once in the log): check here
        if verdicts is None:
            verdicts = parallel_map(one, len(keys),
                                    nbytes=sum(loc.nbytes for loc in locs if loc is not None),
                                    max_threads=EARLY_VERIFY_THREADS if sink.early else None)
        if early:
            sink.zero([rows[j] for j, v in enumerate(verdicts) if isinstance(v, Exception)])
    finally:
        sink.wait()  # nothing reads the arena once the caller may release the lease
    return verdicts


def _issue_copies(reader: ShmReader, locs: list[BlockLocation | None],
                  runs: list[tuple[int, int]], rows: Sequence[int], sink: DeviceRows,
                  namespace: Namespace, skip: int, by_layer: bool) -> list[Any] | None:
    """Issue the copies of ``runs`` (``(first, count)`` blocks) to their rows; a mark per layer
    where they went layer after layer. The arena views live only in this frame: a rejection
    raised later keeps ``_direct``'s frame, and no view may keep the arena's mapping open."""
    nbytes = block_nbytes(namespace)
    sources = [(rows[first], reader.tensor(
        locs[first].offset + skip,  # type: ignore[union-attr]
        (count - 1) * sink.row_stride + nbytes - skip), count) for first, count in runs]
    # Whole-block rows go layer after layer where they can, so the forward's first layers need
    # not wait for the last block (``DeviceRows.copy_runs_by_layer``).
    layer_marks = None if skip or not by_layer else sink.copy_runs_by_layer(
        sources, sink.payload_offset, namespace.payload_nbytes // namespace.num_layers,
        namespace.num_layers)
    if layer_marks is None:
        for row, src, _ in sources:
            sink.copy_run(row, src)
    return layer_marks


def _checks_on_device(namespace: Namespace, sink: DeviceRows) -> bool:
    """Whether the payload checksums of a direct read are checked on its device: unkeyed
    blocks (a MAC needs the tenant's key, on the host), rows of whole blocks, payloads the
    kernel takes."""
    size = namespace.payload_nbytes
    return (not namespace.keyed and sink.payload_offset % 8 == 0 and sink.row_stride % 8 == 0
            and size >= device_checksum.MIN_BYTES and size % 8 == 0
            and device_checksum.usable(sink.device))


def check_headers(reader: ShmReader, locs: list[BlockLocation | None], keys: list[bytes],
                   tokens: Sequence[Any], namespace: Namespace
                   ) -> tuple[list[Any], dict[int, bytes]]:
    """Every leased block's header checked against the request on the host, all at once
    (``canonical_headers``; one by one only where that is unsure), payloads left to the
    device: per block its size (pending its payload's check), its rejection, or None; and the
    payload checksums the good headers carry, by block."""
    verdicts: list[Any] = [None] * len(keys)
    nbytes = block_nbytes(namespace)
    held = [j for j, loc in enumerate(locs) if loc is not None]
    sizes_ok = [j for j in held if locs[j].nbytes == nbytes]  # type: ignore[union-attr]
    for j in set(held) - set(sizes_ok):  # not copied (``_runs``): never offered as good
        verdicts[j] = BlockCorrupted(f"block {keys[j].hex()[:16]} is "
                                     f"{locs[j].nbytes} bytes, not {nbytes}")  # type: ignore
    width = payload_offset(namespace)
    heads = reader.heads([locs[j] for j in sizes_ok], width)  # type: ignore[misc]
    asked = [tokens[j] for j in sizes_ok]
    ok = canonical_headers(heads, namespace, [keys[j] for j in sizes_ok],
                           None if all(t is None for t in asked) else asked)
    tag = _template(namespace).checksum
    digests: dict[int, bytes] = {}
    for i, j in enumerate(sizes_ok):
        if ok[i]:
            digests[j] = heads[i, tag].tobytes()
            verdicts[j] = locs[j].nbytes  # type: ignore[union-attr]
    for j in sizes_ok:
        if j in digests:
            continue
        loc = locs[j]
        assert loc is not None
        try:
            header = verify_block(reader.view(loc.offset, loc.nbytes), namespace, keys[j],
                                  tokens[j], verify_checksum=False)
        except (BlockCorrupted, BlockMismatch) as exc:
            verdicts[j] = detached(exc)
            continue
        digests[j] = header.checksum
        verdicts[j] = loc.nbytes
    return verdicts, digests


def _device_verdicts(sink: DeviceRows, rows: Sequence[int], keys: list[bytes],
                     digests: dict[int, bytes], namespace: Namespace, verdicts: list[Any]) -> bool:
    """Check the payloads of blocks ``digests`` names (their headers passed) on the device
    against the checksums their headers carry; a mismatch becomes the block's rejection in
    ``verdicts``. False if the kernel could not run (nothing was decided)."""
    order = sorted(digests)
    try:
        sums = sink.checksums([rows[j] for j in order], sink.payload_offset,
                              namespace.payload_nbytes)
    except Exception as exc:  # a Triton or driver that cannot run the kernel
        device_checksum.disable(exc)
        return False
    for j, got in zip(order, sums.tolist(), strict=True):
        if got.to_bytes(8, "big") != digests[j]:
            verdicts[j] = BlockCorrupted(f"block {keys[j].hex()[:16]} payload checksum mismatch")
    return True


def staged_into_device(land: Land, num_blocks: int, namespace: Namespace, sink: DeviceRows,
                       rows: Sequence[int], staging: StagingPool) -> list[Any]:
    """Blocks landed and verified in host staging rows by ``land``, then the good ones copied
    to their device rows (block ``i`` -> ``rows[i]``) in one copy per part of at most
    ``STAGING_BYTES``, double-buffered: a part lands while the one before it is copied. Per
    block the verdict ``land`` gave."""
    nbytes = block_nbytes(namespace)
    # Rows of whole blocks take every byte; rows of payloads (payload_offset 0) the payload.
    start = payload_offset(namespace) if sink.payload_offset == 0 else 0
    cols = slice(start, nbytes)
    per = max(1, STAGING_BYTES // nbytes)
    parts = [(lo, min(num_blocks, lo + per)) for lo in range(0, num_blocks, per)]
    out: list[Any] = []
    with contextlib.ExitStack() as stack:
        buffers = [stack.enter_context(staging.rows(min(per, num_blocks), nbytes,
                                                    pinned=sink.is_cuda))
                   for _ in range(min(2, len(parts)))]
        marks: list[Any] = [None] * len(buffers)
        try:
            for p, (lo, hi) in enumerate(parts):
                b = p % len(buffers)
                sink.wait_for(marks[b])  # the copy out of this buffer has read it
                stage = buffers[b][:hi - lo]
                verdicts, row_blocks = land(lo, hi, stage)
                good = [(r, j) for r, j in enumerate(row_blocks) if _fetched(verdicts[j])]
                sink.copy_rows(stage, [r for r, _ in good], [rows[lo + j] for _, j in good],
                               cols)
                marks[b] = sink.mark()
                out += verdicts
        finally:
            sink.wait()  # every copy has read its staging rows before they go back
    return out


def _fetched(verdict: Any) -> bool:
    """A verdict that is a block's size (not a rejection, not absent)."""
    return isinstance(verdict, int) and not isinstance(verdict, bool)
