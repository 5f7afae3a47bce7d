"""Host-to-device copies of a strided region in one DMA: ``cudaMemcpy2DAsync`` through ctypes.

A same-node read into a GPU copies whole blocks (``[L, 2, bs, H, D]`` payloads) out of the
page-locked arena. Copied block after block, no layer of the prompt is complete until the last
block has landed, so the forward waits for the whole transfer. Copied layer after layer, the
forward's first layer can start once 1/L of the bytes are there and the rest of the transfer
runs beside the compute. One layer of a run of adjacent blocks is a 2-D region: ``count`` rows
of one layer's bytes, ``stride`` apart in the arena and in the destination. torch's ``copy_``
takes a strided host source through a contiguous host copy first (a memcpy of the whole run on
the CPU), so the region goes to the CUDA runtime's ``cudaMemcpy2DAsync`` directly.

The runtime is the one torch loaded (found in the process's mappings), so the copy runs in the
same primary context and on the caller's torch stream. Where it cannot be found or called,
``available`` says no and reads copy block after block as before. ``KVSTORE_LAYERED_COPIES=0``
turns layered copies off.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

#: cudaMemcpyHostToDevice.
_HOST_TO_DEVICE = 1


@functools.cache
def _runtime() -> Any:
    """The CUDA runtime library torch uses (None where there is none)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "libcudart" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    # Else the runtime wheels torch depends on (site-packages/nvidia/.../lib), then the loader's.
    site = os.path.dirname(os.path.dirname(torch.__file__))
    paths += sorted(glob.glob(os.path.join(site, "nvidia", "**", "libcudart.so*"),
                              recursive=True))
    for name in [*paths, "libcudart.so", "libcudart.so.13", "libcudart.so.12"]:
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        log.debug("layered copies through %s", name)
        return lib
    log.info("no CUDA runtime library found for layered copies; same-node reads copy block "
             "after block")
    return None


_broken = False


def available() -> bool:
    """Whether layered (2-D) host-to-device copies can be issued here."""
    if os.environ.get("KVSTORE_LAYERED_COPIES", "1") == "0" or _broken:
        return False
    return _runtime() is not None


def copy_2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
            stream: Any) -> None:
    """Copy ``height`` rows of ``width`` bytes from page-locked host memory at ``src``
    (rows ``src_pitch`` apart) to device memory at ``dst`` (rows ``dst_pitch`` apart),
    asynchronously on ``stream`` (a ``torch.cuda.Stream``). Raises where the runtime refuses,
    and layered copies are off from then on."""
    global _broken
    lib = _runtime()
    if lib is None:
        raise RuntimeError("no CUDA runtime library for 2-D copies")
    rc = lib.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, _HOST_TO_DEVICE,
                               stream.cuda_stream)
    if rc != 0:
        _broken = True
        lib.cudaGetLastError()  # leave no sticky error for torch's next launch check
        raise RuntimeError(f"cudaMemcpy2DAsync failed (cudaError {rc}); same-node reads "
                           "copy block after block from now on")
