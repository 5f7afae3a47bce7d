"""Same-node reads: map a pool's arena file read-only and copy leased blocks out of it.

The protocol (wired by the server and client): ask the node for a ``Lease`` over the keys,
``copy_verified_into`` each ``BlockLocation`` into memory the reader owns (a batch's blocks
spread over the verify pool's threads: ``copy_verified_batch``), then release the lease. The
lease is what keeps the bytes from being reused while they are copied; the tag (checksum or
MAC) is computed over the copy, so what enters the model is exactly what was verified. (A
device read verifies the leased bytes themselves while they are copied to the device, and
checks the lease after: ``kvstore.client.device_reads``.)
"""

from __future__ import annotations

import hmac
import mmap
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvstore.block import BlockHeader, block_nbytes, payload_offset, tag_hasher, verify_block
from kvstore.block_batch import verify_blocks
from kvstore.client import device_checksum, device_copy
from kvstore.client.arena_populate import Populator
from kvstore.client.verify_pool import parallel_map
from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import Namespace
from kvstore.node.block_pool import BlockLocation

# Copy, then hash the copy, in pieces that stay in the last-level cache, so the hash reads
# cache-hot bytes. Not under 1 MiB: below glibc's rep_movsb_stop_threshold (1 MiB) memcpy uses
# `rep movsb`, which is slow out of the arena mapping (4 KiB tmpfs pages); above it, vector
# loads. A 2 MiB block is one piece.
_CHUNK = 4 << 20


Buffer = memoryview | bytearray | torch.Tensor | np.ndarray


def byte_view(buf: Buffer) -> memoryview:
    """A writable flat byte view of a bytearray, memoryview, numpy array or CPU tensor."""
    if isinstance(buf, torch.Tensor):
        buf = buf.view(torch.uint8).reshape(-1).numpy()
    view = memoryview(buf)  # type: ignore[arg-type]  # numpy arrays export the protocol
    if view.readonly:
        raise ValueError("destination buffer must be writable")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def as_uint8_array(dst: Buffer) -> np.ndarray:
    """A writable flat uint8 numpy view of a caller's buffer (no copy)."""
    if isinstance(dst, torch.Tensor):
        if dst.device.type != "cpu" or not dst.is_contiguous():
            raise ValueError("destination tensor must be a contiguous CPU tensor")
        return dst.reshape(-1).view(torch.uint8).numpy()
    if isinstance(dst, np.ndarray):
        if not dst.flags.c_contiguous or not dst.flags.writeable:
            raise ValueError("destination array must be C-contiguous and writable")
        return dst.reshape(-1).view(np.uint8)
    view = memoryview(dst)
    if view.readonly:
        raise ValueError("destination buffer must be writable (a bytearray or writable view)")
    if not view.c_contiguous:
        raise ValueError("destination buffer must be contiguous")
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view,
                         dtype=np.uint8)


class ShmReader:
    """A read-only mapping of another process's pool arena."""

    def __init__(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise FileNotFoundError(
                f"cannot open pool arena {path!r}: {exc}; is the store node on this host running?"
            ) from exc
        try:
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise ValueError(f"pool arena {path!r} is empty; not a kvstore arena file")
            self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.path = path
        self._arr = np.frombuffer(self._mm, dtype=np.uint8)
        self._tensor: torch.Tensor | None = None
        self._pinned: bool | None = None  # page-locked for DMA: unknown until a CUDA read
        self._pin_thread: threading.Thread | None = None
        self._populator: Populator | None = None
        self._pin_device: torch.device | None = None
        self._lock = threading.Lock()

    def _src(self, location: BlockLocation) -> np.ndarray:
        if location.offset < 0 or location.nbytes <= 0 or (
            location.offset + location.nbytes > self.size
        ):
            raise ValueError(
                f"block location [{location.offset}, +{location.nbytes}) lies outside the "
                f"{self.size}-byte arena {self.path}: a stale lease or another node's file"
            )
        return self._arr[location.offset : location.offset + location.nbytes]

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A read-only view of ``[offset, offset + nbytes)``: valid only under a lease on every
        block in it (a device read verifies the leased bytes through it, without a copy)."""
        return memoryview(self._src(BlockLocation(b"", offset, nbytes)))  # type: ignore[arg-type]

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """``[offset, offset + nbytes)`` as a uint8 CPU tensor view (never written: the pages
        are read-only), for copies to a device; valid only under a lease on its blocks."""
        self._src(BlockLocation(b"", offset, nbytes))  # bounds
        with self._lock:
            if self._tensor is None:
                with warnings.catch_warnings():  # "not writable": torch has no read-only flag
                    warnings.simplefilter("ignore", UserWarning)
                    self._tensor = torch.from_numpy(self._arr)
            return self._tensor[offset : offset + nbytes]

    def populate(self, cores: set[int] | None = None) -> Populator:
        """Start mapping every page of the arena into this process, in the background (on
        ``cores`` when given), so later reads take no page faults (``arena_populate``); once
        per reader."""
        with self._lock:
            if self._populator is None:
                self._populator = Populator(self._arr.ctypes.data, self.size, cores)
            return self._populator

    def pin_for_dma(self, device: torch.device | None = None, *, wait: bool = True) -> bool:
        """Whether the whole mapping is page-locked (``cudaHostRegister``, read-only) so CUDA
        copies read blocks straight out of it; False if the driver refused (reads stage).

        The first call starts the registration on a thread of its own (seconds for a large
        arena: far too long to run inside a lease); ``wait=False`` answers at once (False
        until it is done), so reads take the staged path meanwhile instead of waiting."""
        with self._lock:
            if self._pin_thread is None and self._pinned is None:
                self._pin_thread = threading.Thread(target=self._pin, args=(device,),
                                                    daemon=True, name="kvstore-arena-pin")
                self._pin_thread.start()
            thread = self._pin_thread
        if wait and thread is not None:
            thread.join()
        with self._lock:
            return bool(self._pinned)

    def _pin(self, device: torch.device | None) -> None:
        # Only a MAP_SHARED mapping is registered (this class maps nothing else): page-locking a
        # private mapping would pin copy-on-write pages that never see the node's writes.
        pinned = device_copy.register_host(self._arr.ctypes.data, self.size,
                                           f"pool arena {self.path}", device)
        if pinned and device is not None:  # direct reads check payloads there: compile it now
            device_checksum.warm_up(device)
        with self._lock:
            self._pinned, self._pin_device = pinned, device

    def copy_into(self, location: BlockLocation, dst: Buffer) -> int:
        """Copy one block's bytes to the start of ``dst``; returns the bytes copied."""
        src = self._src(location)
        out = as_uint8_array(dst)
        if out.size < src.size:
            raise ValueError(f"destination of {out.size} bytes is too small for a "
                             f"{src.size}-byte block")
        np.copyto(out[: src.size], src)
        return int(src.size)

    def gather_into(self, locations: Sequence[BlockLocation], out: np.ndarray) -> None:
        """Copy blocks of one size into the rows of ``out`` (``[len(locations), size]``
        uint8), bounds checked for the whole batch first: one slice copy per block, none of
        ``copy_into``'s per-call conversions."""
        if out.dtype != np.uint8 or out.ndim != 2 or out.shape[0] != len(locations):
            raise ValueError(f"out must be a uint8 [{len(locations)}, size] array")
        width = out.shape[1]
        for loc in locations:
            if loc.nbytes != width or loc.offset < 0 or loc.offset + width > self.size:
                self._src(loc)  # raises the out-of-arena error
                raise ValueError(f"block of {loc.nbytes} bytes in a row of {width}")
        arr = self._arr
        for row, loc in zip(out, locations, strict=True):
            row[:] = arr[loc.offset : loc.offset + width]

    def heads(self, locations: Sequence[BlockLocation], width: int) -> np.ndarray:
        """The first ``width`` bytes of each block, as one ``[len(locations), width]`` uint8
        copy (one gather: the headers of a batch, checked together)."""
        return self.columns(locations, np.arange(width, dtype=np.int64))

    def columns(self, locations: Sequence[BlockLocation], columns: np.ndarray) -> np.ndarray:
        """Bytes ``columns`` (sorted int64 offsets into a block) of each block, as one
        ``[len(locations), len(columns)]`` uint8 copy: a few header fields of a batch in one
        gather, without the rest of their headers."""
        width = int(columns[-1]) + 1 if len(columns) else 0
        offsets = np.fromiter((loc.offset for loc in locations), dtype=np.int64,
                              count=len(locations))
        if len(offsets) and (offsets.min() < 0 or offsets.max() + width > self.size or any(
                loc.nbytes < width for loc in locations)):
            raise ValueError(f"a block's first {width} bytes lie outside the arena or the block")
        return self._arr[offsets[:, None] + columns]

    def read(self, location: BlockLocation) -> bytearray:
        """A copy of one block's bytes in a new buffer."""
        buf = bytearray(location.nbytes)
        self.copy_into(location, buf)
        return buf

    def copy_verified_into(
        self,
        location: BlockLocation,
        dst: Buffer,
        namespace: Namespace,
        token_ids: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    ) -> BlockHeader:
        """Copy a block into ``dst`` and verify the copy (header, tokens, tag) in one pass: the
        tag (xxh3, or the tenant's MAC in a keyed namespace) is fed each chunk as it is copied.

        Raises BlockCorrupted / BlockMismatch / NamespaceMismatch like ``verify_block``.
        """
        src = self._src(location)
        out = as_uint8_array(dst)
        if out.size < src.size:
            raise ValueError(f"destination of {out.size} bytes is too small for a "
                             f"{src.size}-byte block")
        start = payload_offset(namespace)
        end = start + namespace.payload_nbytes
        if src.size < end:
            raise BlockCorrupted(f"block is truncated: {src.size} bytes, expected {end}")
        np.copyto(out[:start], src[:start])
        hasher = tag_hasher(namespace, location.key)
        for lo in range(start, end, _CHUNK):
            hi = min(lo + _CHUNK, end)
            np.copyto(out[lo:hi], src[lo:hi])
            hasher.update(out[lo:hi].data)
        if src.size > end:
            np.copyto(out[end : src.size], src[end:])
        header = verify_block(out[: src.size], namespace, location.key, token_ids,
                              verify_checksum=False)
        if not hmac.compare_digest(hasher.digest(), header.checksum):
            raise BlockCorrupted(f"block {location.key.hex()[:16]} payload "
                                 + ("MAC" if namespace.keyed else "checksum") + " mismatch")
        return header

    def close(self) -> None:
        """Unmap the arena (arrays handed out by ``copy_into`` are the caller's own memory)."""
        if self._mm.closed:
            return
        if self._pin_thread is not None:
            self._pin_thread.join()  # never unmap memory the driver is still registering
        if self._populator is not None:
            self._populator.stop()  # nor memory the kernel is mapping
        if self._pinned:
            device_copy.unregister_host(self._arr.ctypes.data, self._pin_device)
            self._pinned = False
        self._tensor = None
        self._arr = np.empty(0, dtype=np.uint8)  # drop our export so the map can close
        self._mm.close()

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Blocks up to this size are fetched from a same-node arena a batch at a time: copied out,
#: then verified in array passes (``verify_blocks``). The one-pass copy-and-hash pays a fixed
#: Python cost per block that outweighs a small block's bytes; past this size the bytes
#: dominate and copying while hashing keeps each piece cache-hot.
SMALL_BLOCK_BYTES = 256 << 10
#: Bytes gathered between two looks at the lease's age.
GATHER_BYTES = 4 << 20


def is_small_batch(where: dict[bytes, BlockLocation], namespace: Namespace) -> bool:
    """Whether a lease's blocks are all one small size (then ``copy_then_verify`` reads them)."""
    nbytes = block_nbytes(namespace)
    return nbytes <= SMALL_BLOCK_BYTES and len(where) > 1 \
        and all(loc.nbytes == nbytes for loc in where.values())


def gather_verified(reader: Any, where: dict[bytes, BlockLocation], keys: list[bytes],
                    stage: np.ndarray, namespace: Namespace, token_ids: Sequence[Any] | None,
                    keep_alive: Callable[[], None]) -> tuple[list[int], list[Any]]:
    """Small blocks of one lease gathered into the rows of ``stage`` (a slice copy each) and
    verified as a batch (``verify_blocks``): returns the indices of the keys held, in order (row
    ``j`` of ``stage`` is key ``held[j]``), and per held key its parent key (verified) or a
    detached BlockCorrupted / BlockMismatch. ``keep_alive`` runs between gathers."""
    held = [i for i, k in enumerate(keys) if k in where]
    nbytes = block_nbytes(namespace)
    if stage.shape[0] < len(held) or stage.shape[1] != nbytes:
        raise ValueError(f"stage must be a [>= {len(held)}, {nbytes}] uint8 array")
    step = max(1, GATHER_BYTES // nbytes)
    for lo in range(0, len(held), step):
        keep_alive()  # the lease outlives the copy (renewed once a third of it is gone)
        reader.gather_into([where[keys[i]] for i in held[lo : lo + step]],
                           stage[lo : min(lo + step, len(held))])
    verdicts: list[Any] = verify_blocks(
        stage[: len(held)], namespace, [keys[i] for i in held],
        None if token_ids is None else [token_ids[i] for i in held])
    for j, verdict in enumerate(verdicts):
        if isinstance(verdict, (BlockCorrupted, BlockMismatch)):
            verdicts[j] = detached(verdict)
        elif isinstance(verdict, Exception):
            raise verdict
    return held, verdicts


def copy_then_verify(reader: Any, where: dict[bytes, BlockLocation], keys: list[bytes],
                     buffers: Sequence[Buffer], namespace: Namespace,
                     token_ids: Sequence[Any] | None, keep_alive: Callable[[], None]
                     ) -> list[Any]:
    """A same-node read's verdicts for a batch of small blocks (``where``: their leased
    locations): gathered into one staging array and verified at once (``gather_verified``),
    the good ones copied to their buffers; per key its size, a detached BlockCorrupted /
    BlockMismatch, or None (not held)."""
    nbytes = block_nbytes(namespace)
    stage = np.empty((sum(k in where for k in keys), nbytes), dtype=np.uint8)
    held, verdicts = gather_verified(reader, where, keys, stage, namespace, token_ids,
                                     keep_alive)
    out: list[Any] = [None] * len(keys)
    for row, i, verdict in zip(stage, held, verdicts, strict=True):
        if isinstance(verdict, Exception):
            out[i] = verdict
            continue
        dst = as_uint8_array(buffers[i])
        if dst.size < nbytes:
            raise ValueError(f"destination of {dst.size} bytes is too small for a "
                             f"{nbytes}-byte block")
        dst[:nbytes] = row
        out[i] = nbytes
    return out


def copy_verified_batch(reader: ShmReader, where: dict[bytes, BlockLocation], keys: list[bytes],
                        buffers: Sequence[Buffer], namespace: Namespace | None,
                        token_ids: Sequence[Any] | None, keep_alive: Callable[[], None]
                        ) -> list[Any]:
    """A same-node read's verdicts for blocks copied one by one (``copy_verified_into``; with
    no ``namespace``, ``copy_into`` unverified), the blocks spread over the verify pool's
    threads: per key its size, a detached BlockCorrupted / BlockMismatch, or None (not held).
    ``keep_alive`` runs before each block, on whichever thread copies it."""

    def one(i: int) -> Any:
        keep_alive()
        loc = where.get(keys[i])
        if loc is None:
            return None
        if namespace is None:
            return reader.copy_into(loc, buffers[i])
        try:
            reader.copy_verified_into(loc, buffers[i], namespace,
                                      None if token_ids is None else token_ids[i])
        except (BlockCorrupted, BlockMismatch) as exc:
            return detached(exc)
        return loc.nbytes

    return parallel_map(one, len(keys), nbytes=sum(loc.nbytes for loc in where.values()))


def detached(exc: BaseException) -> BaseException:
    """``exc`` without its traceback, cause or context: their frames (and, through
    ``f_back``, their callers') hold views of the mapped arena, which would keep the mapping
    from ever closing while the caller keeps the verdict."""
    exc.__cause__ = exc.__context__ = None
    return exc.with_traceback(None)
