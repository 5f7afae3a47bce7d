"""Putting verified payloads on a device: the destination rows, pinned staging, page-locking.

``batch_get(..., device=...)`` hands back payloads as views into one tensor of rows on that
device (``DeviceRows``). Bytes reach it two ways (``kvstore.client.device_reads``):

- *directly* from host memory that is already page-locked (a same-node arena registered with
  ``register_host``), one copy per run of blocks the arena holds back to back, while the host
  verifies the same leased bytes;
- *staged*: blocks land in a host buffer (``StagingPool``, pinned when the target is CUDA) and
  are verified there, then each part of the batch moves in one copy while the next part lands
  (remote blocks, small blocks, an arena the driver would not register, or not yet).

On CUDA every copy is asynchronous on a side stream and ``wait`` synchronizes it; on the CPU a
"copy to the device" is a numpy copy into the destination, so CI runs the same code with
``device="cpu"``. The CUDA-only lines are the ``self._stream`` branches and the registration.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch

from kvstore.client import device_checksum, strided_copy
from kvstore.constants import align_up
from kvstore.keys import Namespace

log = logging.getLogger(__name__)
T = TypeVar("T")

#: cudaHostRegisterPortable (usable from every CUDA context) | cudaHostRegisterReadOnly (the
#: arena is mapped PROT_READ; needs CUDA >= 11.1 and a device that supports it).
_REGISTER_FLAGS = 0x01 | 0x08
#: CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: whether the driver page-locks
#: memory mapped read-only (the arena is mapped PROT_READ in readers).
_READ_ONLY_REGISTER_ATTRIBUTE = 113


def target_device(device: torch.device | str | None) -> torch.device | None:
    """The device payloads go to (None: CPU rows, as ``batch_get`` returns without a device); a bare
    ``"cuda"`` means the current CUDA device, so every row lands on one device."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: torch sees no CUDA device here")
        return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cpu":
        raise ValueError(f"device {str(device)!r}: payloads go to a CPU or CUDA device")
    return dev


class DeviceRows:
    """The ``[num_rows, row_stride]`` uint8 destination of a batch on one device.

    Row ``i`` receives block ``i``'s bytes at its start: its payload (``payload_offset`` 0)
    or its whole encoded block (header first, payload at ``payload_offset``). The row stride
    is ``row_nbytes`` rounded up to the arena's 64-byte extent alignment, so a run of blocks
    an arena holds back to back lands in consecutive rows with one copy (``copy_run``).

    CUDA: copies run on the device's copy stream (``copy_stream``, one per device, shared by
    every read) and may still be running until ``wait()`` returns. ``dst`` is allocated on
    that stream, so the caching allocator hands it memory no other stream's queued work still
    reads, and the copies never wait for the caller's stream (another request's forward);
    ``payloads`` marks the rows as used by the caller's stream. One stream for every read,
    not one per read, lets the allocator give a read the rows a finished read freed instead
    of fresh device memory each time.
    """

    def __init__(self, device: torch.device, num_rows: int, row_nbytes: int, *,
                 payload_offset: int = 0) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.row_nbytes = row_nbytes
        # A store node's arena starts every extent on an ALIGN boundary: blocks it stored
        # back to back are this far apart there too.
        self.row_stride = align_up(row_nbytes) if payload_offset else row_nbytes
        self.payload_offset = payload_offset
        #: Set by a caller that uses rows before they are verified (``EarlyRows``).
        self.early: EarlyRows | None = None
        self._stream: Any = None
        self._np: np.ndarray | None = None
        if self.is_cuda:
            self._stream = copy_stream(device)
            with torch.cuda.stream(self._stream):
                self.dst = torch.empty((num_rows, self.row_stride), dtype=torch.uint8,
                                       device=device)
        else:  # numpy asks for huge pages on large arrays (block_buffers.new_rows)
            self._np = np.empty((num_rows, self.row_stride), dtype=np.uint8)
            self.dst = torch.from_numpy(self._np)

    def copy(self, row: int, src: torch.Tensor) -> None:
        """Copy one block's bytes (a 1-D uint8 CPU tensor, page-locked when the target is
        CUDA) to the start of row ``row``."""
        self.copy_run(row, src)

    def copy_run(self, row: int, src: torch.Tensor) -> None:
        """Copy ``src`` (1-D uint8, CPU; page-locked for CUDA) to the flat destination from
        the start of row ``row``: a run of blocks laid out at ``row_stride`` from each other,
        as a same-node arena holds blocks it stored back to back, in one copy."""
        start = row * self.row_stride
        if start + src.numel() > self.dst.numel():
            raise ValueError(f"{src.numel()} bytes from row {row} overrun the destination")
        if self._np is not None:
            np.copyto(self._np.reshape(-1)[start:start + src.numel()], src.numpy())
            return
        with torch.cuda.stream(self._stream):
            self.dst.view(-1)[start:start + src.numel()].copy_(src, non_blocking=True)

    def copy_runs_by_layer(self, runs: Sequence[tuple[int, torch.Tensor, int]], first: int,
                           layer_nbytes: int, num_layers: int) -> list[Any] | None:
        """Copy runs of blocks (``(row, src, count)``: ``count`` blocks laid out ``row_stride``
        apart from ``src``'s start, as ``copy_run`` takes them) layer after layer: layer ``l``
        (bytes ``first + l * layer_nbytes`` onwards of each block, ``layer_nbytes`` long) of
        every run before layer ``l + 1`` of any. Returns a mark after each layer (CUDA), so a
        forward can start on the first layers while the rest are in flight; None where 2-D
        copies cannot be issued here (nothing was copied: copy block after block instead).
        The CPU copies the same bytes in the same order (marks None)."""
        width, pitch = layer_nbytes, self.row_stride
        for row, src, count in runs:
            end = row * pitch + (count - 1) * pitch + first + num_layers * width
            if end > self.dst.numel() or src.numel() < (count - 1) * pitch + first + \
                    num_layers * width:
                raise ValueError(f"a run of {count} blocks from row {row} does not fit")
        if self._np is not None:
            flat = self._np.reshape(-1)
            for layer in range(num_layers):
                lo = first + layer * width
                for row, src, count in runs:
                    src_np = src.numpy()
                    for b in range(count):
                        at = (row + b) * pitch + lo
                        flat[at:at + width] = src_np[b * pitch + lo:b * pitch + lo + width]
            return [None] * num_layers
        if not strided_copy.available():
            return None
        marks: list[Any] = []
        base = self.dst.data_ptr()
        try:
            with torch.cuda.device(self.device):  # the runtime's current device: the stream's
                for layer in range(num_layers):
                    lo = first + layer * width
                    for row, src, count in runs:
                        strided_copy.copy_2d(base + row * pitch + lo, pitch,
                                             src.data_ptr() + lo, pitch, width, count,
                                             self._stream)
                    marks.append(self.mark())
        except RuntimeError as exc:  # logged as text: the exception would keep the arena views
            log.warning("%s", str(exc))
            return None
        return marks

    def copy_rows(self, stage: torch.Tensor, src_rows: Sequence[int], dst_rows: Sequence[int],
                  cols: slice) -> None:
        """Copy ``stage[src_rows[j], cols]`` to the start of row ``dst_rows[j]``: one copy for
        a batch of staged blocks (CUDA: the staged rows move in one DMA, then are placed on
        the device)."""
        if not src_rows:
            return
        k = max(src_rows) + 1
        run = list(src_rows) == list(range(k)) and list(dst_rows) == list(
            range(dst_rows[0], dst_rows[0] + k))
        width = len(range(*cols.indices(stage.shape[1])))
        if self._np is not None:
            src_np = stage.numpy()
            if run:
                np.copyto(self._np[dst_rows[0]:dst_rows[0] + k, :width], src_np[:k, cols])
            else:
                self._np[np.asarray(dst_rows), :width] = src_np[np.asarray(src_rows), cols]
            return
        with torch.cuda.stream(self._stream):
            scratch = stage[:k].to(self.device, non_blocking=True)
            if run:
                self.dst[dst_rows[0]:dst_rows[0] + k, :width].copy_(scratch[:, cols])
            else:
                to = torch.as_tensor(list(dst_rows), device=self.device)
                self.dst[to, :width] = scratch[torch.as_tensor(list(src_rows),
                                                               device=self.device), cols]

    def issued(self, rows: Sequence[int], layer_marks: list[Any] | None = None) -> None:
        """The copies of ``rows`` are issued, their verification still running: tell an
        ``early`` listener (with a mark after the copies, and ``layer_marks`` where the copies
        went layer after layer) that it may start using them."""
        if self.early is not None:
            self.early.offer(rows, self.mark(), layer_marks)

    def checksums(self, rows: Sequence[int], offset: int, nbytes: int) -> np.ndarray:
        """XXH3-64 of ``nbytes`` at ``offset`` in each of ``rows``, computed where the rows are,
        behind every copy issued so far (``kvstore.client.device_checksum``), on the host."""
        if self._stream is None:
            return device_checksum.checksums(self.dst, rows, offset, nbytes)
        with torch.cuda.stream(self._stream):
            return device_checksum.checksums(self.dst, rows, offset, nbytes)

    def zero(self, rows: Sequence[int]) -> None:
        """Zero rows whose block was not fetched: bytes that failed verification (a DMA may
        have written them before the verdict) are never left where a caller could read them."""
        if not rows:
            return
        if self._np is not None:
            self._np[np.asarray(rows)] = 0
            return
        with torch.cuda.stream(self._stream):
            self.dst[torch.as_tensor(list(rows), device=self.device)] = 0

    def mark(self) -> Any:
        """A point after every copy issued so far (CUDA: an event on the side stream; None on
        the CPU, where copies are done when issued), for ``wait_for``."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def wait_for(self, mark: Any) -> None:
        """Block until the copies issued before ``mark`` have landed (None: nothing to wait)."""
        if mark is not None:
            mark.synchronize()

    def wait(self) -> None:
        """Block until every copy issued so far has landed."""
        if self._stream is not None:
            self._stream.synchronize()

    def blocks(self, namespace: Namespace, num_rows: int) -> torch.Tensor:
        """Rows ``0..num_rows-1`` as one block-major ``[n, L, 2, bs, H, D]`` view (strided by
        the row stride; no copy); on CUDA the rows are then in use by the caller's stream."""
        if self._stream is not None:
            self.dst.record_stream(torch.cuda.current_stream(self.device))
        start = self.payload_offset
        return self.dst[:num_rows, start:start + namespace.payload_nbytes] \
            .view(namespace.torch_dtype).unflatten(1, namespace.payload_shape)

    def payloads(self, namespace: Namespace) -> tuple[torch.Tensor, ...]:
        """Each row's payload as a ``[L, 2, bs, H, D]`` tensor of the namespace's dtype
        (views); on CUDA the rows are then in use by the caller's current stream."""
        if not len(self.dst):
            return ()
        if self._stream is not None:
            self.dst.record_stream(torch.cuda.current_stream(self.device))
        start = self.payload_offset
        return self.dst[:, start:start + namespace.payload_nbytes].view(namespace.torch_dtype) \
            .unflatten(1, namespace.payload_shape).unbind(0)


class EarlyRows:
    """Which rows of a device fetch were copied before their verification finished.

    The same-node DMA path issues every copy first and verifies the leased arena bytes while
    the copies run (``kvstore.client.device_reads``). A caller that can compute on the rows
    speculatively, and throw the result away if a row is then rejected, waits here instead of
    for the verdicts: ``wait`` returns the rows offered (once, by the first group of copies)
    and a mark to order its device work after them, or nothing once the fetch is over.
    """

    #: How long a read waits, after offering rows, for the caller to take them before it goes
    #: on checking headers: the caller needs the GIL for a moment to take them, and a reader
    #: busy in Python would keep it for a whole switch interval.
    TAKE_WAIT_S = 0.05

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._taken = threading.Event()
        self._lock = threading.Lock()
        self.rows: frozenset[int] = frozenset()
        self.mark: Any = None
        #: Where the copies went layer after layer: a mark after each layer.
        self.layer_marks: list[Any] | None = None

    def offer(self, rows: Sequence[int], mark: Any, layer_marks: list[Any] | None = None
              ) -> None:
        """The first offer counts: later groups (other nodes) arrive verified anyway."""
        with self._lock:
            if not self._ready.is_set():
                self.rows, self.mark = frozenset(rows), mark
                self.layer_marks = layer_marks
                self._ready.set()

    def close(self) -> None:
        """The fetch is over: a waiter stops waiting for an offer."""
        self._ready.set()

    def took(self) -> None:
        """The caller has taken the offered rows (``EarlyFetch.leading``)."""
        self._taken.set()

    def wait_taken(self) -> None:
        """Give the caller a moment to take the offered rows (bounded by ``TAKE_WAIT_S``)."""
        self._taken.wait(self.TAKE_WAIT_S)

    def wait(self, timeout: float | None = None
             ) -> tuple[frozenset[int], Any, list[Any] | None]:
        self._ready.wait(timeout)
        with self._lock:
            return self.rows, self.mark, self.layer_marks


class StagingPool:
    """Host buffers that blocks land in before one copy per batch to the device, reused across
    requests: page-locking memory costs far more than copying into it, so a client keeps a few
    (at most ``max_idle`` between requests) instead of pinning a buffer per request."""

    def __init__(self, max_idle: int = 2) -> None:
        self.max_idle = max_idle
        self._idle: list[tuple[bool, torch.Tensor]] = []
        self._lock = threading.Lock()

    @contextmanager
    def rows(self, num_rows: int, row_nbytes: int, *, pinned: bool) -> Iterator[torch.Tensor]:
        """A ``[num_rows, row_nbytes]`` uint8 CPU tensor (page-locked if ``pinned``), back to
        the pool on exit: the caller must have waited for copies out of it by then."""
        need = num_rows * row_nbytes
        with self._lock:
            fits = [b for b in self._idle if b[0] == pinned and b[1].numel() >= need]
            buf = min(fits, key=lambda b: b[1].numel()) if fits else None
            if buf is not None:
                self._idle.remove(buf)
        if buf is None:
            size = -(-max(need, 1) // (2 << 20)) * (2 << 20)  # whole 2 MiB: more reuse
            flat = torch.empty(size, dtype=torch.uint8, pin_memory=True) if pinned \
                else torch.from_numpy(np.empty(size, dtype=np.uint8))
            buf = (pinned, flat)
        try:
            yield buf[1][:need].view(num_rows, row_nbytes)
        finally:
            with self._lock:
                self._idle.append(buf)
                if len(self._idle) > self.max_idle:
                    self._idle.remove(min(self._idle, key=lambda b: b[1].numel()))

    def close(self) -> None:
        """Drop the idle buffers (pinned ones go back to torch's host allocator)."""
        with self._lock:
            self._idle = []


@functools.cache
def copy_stream(device: torch.device) -> Any:
    """The side stream every read into ``device`` copies on (one per device, for the life of
    the process)."""
    return torch.cuda.Stream(device=device)


@functools.cache
def read_only_register_supported(device_index: int) -> bool | None:
    """Whether the driver page-locks read-only memory for ``device_index`` (asked once per
    device, from the driver API); None where it cannot be asked (no ``libcuda`` here)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    value = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetAttribute(
            ctypes.byref(value), _READ_ONLY_REGISTER_ATTRIBUTE, device_index) != 0:
        return None
    return bool(value.value)


def dma_path(device: torch.device | str | None) -> str:
    """How same-node reads reach ``device``: ``direct`` (DMA from the page-locked arena),
    ``staged`` (through pinned staging copies: the driver will not page-lock read-only
    memory), or ``host`` (not a CUDA device), for logs and ``kvstore status --wide``."""
    dev = None if device is None else torch.device(device)
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        return "host"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return "staged" if read_only_register_supported(index) is False else "direct"


def register_host(ptr: int, nbytes: int, what: str, device: torch.device | None = None
                  ) -> bool:
    """Page-lock ``[ptr, ptr + nbytes)`` (read-only, shared memory) so CUDA copies read it
    directly; False, logged, where the driver refuses (old CUDA, no read-only support,
    limits). Runs on a thread of its own whose current device is ``device`` (default: the
    caller's), so it never creates a context on another GPU. It takes time in proportion to
    ``nbytes`` (seconds for a large arena): callers start it in the background, ahead of the
    reads."""
    nbytes = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # the mapping is whole pages
    index = None
    if device is not None and device.type == "cuda":
        index = device.index
    if index is None and torch.cuda.is_available():
        index = torch.cuda.current_device()
    if index is not None and read_only_register_supported(index) is False:
        log.warning("cannot page-lock %s for DMA: cuda:%d does not support registering "
                    "read-only memory (cudaDevAttrHostRegisterReadOnlySupported is 0); same-"
                    "node reads go through pinned staging copies", what, index)
        return False

    def call() -> int:
        if index is not None:
            torch.cuda.set_device(index)
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS))

    try:
        rc = _on_own_thread(call)
    except Exception as exc:  # no CUDA runtime in this process after all
        rc, detail = -1, f"{type(exc).__name__}: {exc}"
    else:
        detail = f"cudaError {rc}"
    if rc != 0:
        log.warning("cannot page-lock %s for DMA (%s); reading it through pinned staging "
                    "copies instead", what, detail)
        return False
    log.info("page-locked %s (%d MiB) for DMA straight from the arena", what, nbytes >> 20)
    return True


def unregister_host(ptr: int, device: torch.device | None = None) -> None:
    """Undo ``register_host`` (before the memory is unmapped)."""

    def call() -> int:
        if device is not None and device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device.index)
        return int(torch.cuda.cudart().cudaHostUnregister(ptr))

    rc = _on_own_thread(call)
    if rc != 0:
        log.warning("cudaHostUnregister failed (cudaError %d)", rc)


def _on_own_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a short-lived thread: a failing CUDA runtime call leaves its error as the
    calling thread's "last error", which torch's next kernel-launch check on that thread would
    raise as if the kernel had failed. Kept off the caller's thread, it goes with this one."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:
            out.append((False, exc))

    thread = threading.Thread(target=run, name="kvstore-cuda-register")
    thread.start()
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
