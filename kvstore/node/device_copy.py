"""Putting verified payloads on a device: the destination rows, pinned staging, page-locking.

``batch_get(..., device=...)`` hands back payloads as views into one ``[n, payload_nbytes]``
tensor on that device (``DeviceRows``). Bytes reach it two ways (``kvstore.node.device_reads``):

- *directly*, one copy per block from host memory that is already page-locked (a same-node
  arena registered with ``register_host``), while the host verifies the same leased bytes;
- *staged*: blocks land in a host buffer (``StagingPool``, pinned when the target is CUDA) and
  are verified there, then the whole batch moves in one copy (remote blocks, small blocks, an
  arena the driver would not register).

On CUDA every copy is asynchronous on a side stream and ``wait`` synchronizes it; on the CPU a
"copy to the device" is a numpy copy into the destination, so CI runs the same code with
``device="cpu"``. The CUDA-only lines are the ``self._stream`` branches and the registration.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch

from kvstore.keys import Namespace

log = logging.getLogger(__name__)
T = TypeVar("T")

#: cudaHostRegisterPortable (usable from every CUDA context) | cudaHostRegisterReadOnly (the
#: arena is mapped PROT_READ; needs CUDA >= 11.1 and a device that supports it).
_REGISTER_FLAGS = 0x01 | 0x08


def target_device(device: torch.device | str | None) -> torch.device | None:
    """The device payloads go to (None: the CPU rows of today's ``batch_get``); a bare
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
    """The ``[num_rows, row_nbytes]`` uint8 destination of a batch on one device.

    Row ``i`` receives block ``i``'s payload bytes. Copies may still be running until
    ``wait()`` returns (CUDA: they run on a side stream that first waits for the caller's
    current stream, since ``dst`` may reuse memory that stream still reads).
    """

    def __init__(self, device: torch.device, num_rows: int, row_nbytes: int) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._stream: Any = None
        self._np: np.ndarray | None = None
        if self.is_cuda:
            self.dst = torch.empty((num_rows, row_nbytes), dtype=torch.uint8, device=device)
            self._stream = torch.cuda.Stream(device=device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
        else:  # numpy asks for huge pages on large arrays (kvstore.cluster_store.new_block_buffer)
            self._np = np.empty((num_rows, row_nbytes), dtype=np.uint8)
            self.dst = torch.from_numpy(self._np)

    def copy(self, row: int, src: torch.Tensor) -> None:
        """Copy one payload (a 1-D uint8 CPU tensor, page-locked when the target is CUDA)."""
        if self._np is not None:
            np.copyto(self._np[row], src.numpy())
            return
        with torch.cuda.stream(self._stream):
            self.dst[row].copy_(src, non_blocking=True)

    def copy_rows(self, stage: torch.Tensor, src_rows: Sequence[int], dst_rows: Sequence[int],
                  cols: slice) -> None:
        """Copy ``stage[src_rows[j], cols]`` to row ``dst_rows[j]``: one copy for a batch of
        staged blocks (CUDA: the staged rows move in one DMA, then are placed on the device)."""
        if not src_rows:
            return
        k = max(src_rows) + 1
        run = list(src_rows) == list(range(k)) and list(dst_rows) == list(
            range(dst_rows[0], dst_rows[0] + k))
        if self._np is not None:
            src_np = stage.numpy()
            if run:
                np.copyto(self._np[dst_rows[0] : dst_rows[0] + k], src_np[:k, cols])
            else:
                self._np[np.asarray(dst_rows)] = src_np[np.asarray(src_rows), cols]
            return
        with torch.cuda.stream(self._stream):
            scratch = stage[:k].to(self.device, non_blocking=True)
            if run:
                self.dst[dst_rows[0] : dst_rows[0] + k].copy_(scratch[:, cols])
            else:
                to = torch.as_tensor(list(dst_rows), device=self.device)
                self.dst[to] = scratch[torch.as_tensor(list(src_rows), device=self.device), cols]

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

    def wait(self) -> None:
        """Block until every copy issued so far has landed."""
        if self._stream is not None:
            self._stream.synchronize()

    def payloads(self, namespace: Namespace) -> tuple[torch.Tensor, ...]:
        """Each row as a ``[L, 2, bs, H, D]`` payload of the namespace's dtype (views)."""
        if not len(self.dst):
            return ()
        return self.dst.view(namespace.torch_dtype).unflatten(1, namespace.payload_shape) \
            .unbind(0)


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


def register_host(ptr: int, nbytes: int, what: str) -> bool:
    """Page-lock ``[ptr, ptr + nbytes)`` (read-only memory) so CUDA copies read it directly;
    False, logged, where the driver refuses (old CUDA, no read-only support, limits)."""
    nbytes = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # the mapping is whole pages

    def call() -> int:
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


def unregister_host(ptr: int) -> None:
    """Undo ``register_host`` (before the memory is unmapped)."""
    rc = _on_own_thread(lambda: int(torch.cuda.cudart().cudaHostUnregister(ptr)))
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
