"""xxh3-64 of block payloads where they landed on a CUDA device, so the host hashes nothing.

A same-node read into a GPU copies every leased block there with DMA; checking the payloads'
checksums on the host meanwhile takes the host longer than the copies (memory bandwidth, a few
threads) and contends for the GIL with the forward that computes on those blocks. The bytes
are on the device anyway, so the device hashes them, in one kernel for the whole batch, on the
copy stream right behind the copies: a check of exactly the bytes the model will read.

The hash is XXH3-64 with the default secret and seed 0, as ``kvstore.block.checksum`` (the
xxHash specification's long-input path; payloads are longer than 240 bytes): per payload, 8
accumulators take every 64-byte stripe, scrambled after every 1 KiB block, then merged. The
stripes of a block only add to the accumulators, so one Triton program per payload sums a
block's 16 stripes at once and runs the scrambles in order; the merge (a 128-bit multiply per
pair of accumulators) runs on the host over the batch's accumulators with numpy.

Triton comes with torch's CUDA builds; where it is missing, or the kernel fails, ``usable``
says no and the reader checks on the host as before. ``KVSTORE_DEVICE_CHECKSUM=0`` turns it
off. Tested against python-xxhash on the GPU and, where Triton is installed, in Triton's
interpreter on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

#: XXH3's default secret (XXH3_kSecret, from the xxHash specification).
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
PRIME32 = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)
PRIME64 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
           0x27D4EB2F165667C5)
STRIPE = 64
BLOCK = 1024  # 16 stripes: (secret size - stripe) / 8 bytes of secret consumed per stripe
MIN_BYTES = 241  # shorter inputs take XXH3's other paths
#: Warps per program: a program's loop is a chain of dependent 1 KiB steps, so one warp per
#: payload and many payloads in flight keep the device busy.
NUM_WARPS = 1


def _le64(offset: int) -> int:
    return struct.unpack_from("<Q", SECRET, offset)[0]


def _as_int64(values: Sequence[int]) -> list[int]:
    return [v - (1 << 64) if v >= 1 << 63 else v for v in values]


#: The secret's words at every 8-byte step (the stripe keys), then the scramble keys (from byte
#: 128), the last stripe's keys (from byte 121), the initial accumulators: int64 bit patterns.
_TABLE = _as_int64([_le64(8 * j) for j in range(23)] + [_le64(128 + 8 * i) for i in range(8)]
                   + [_le64(121 + 8 * i) for i in range(8)]
                   + [PRIME32[2], PRIME64[0], PRIME64[1], PRIME64[2], PRIME64[3], PRIME32[1],
                      PRIME64[4], PRIME32[0]])
_MERGE_KEYS = np.array([_le64(11 + 8 * i) for i in range(8)], dtype=np.uint64)

_triton: Any = None
_kernel: Any = None
_broken = False


def _load() -> Any:
    """The Triton kernel (None where Triton cannot be imported)."""
    global _triton, _kernel
    if _kernel is not None or _triton is False:
        return _kernel
    try:
        from kvstore.client import device_checksum_kernel
    except ImportError as exc:  # a CPU build of torch, or Triton removed
        log.info("payload checksums stay on the host: %s", exc)
        _triton = False
        return None
    _triton, _kernel = True, device_checksum_kernel.xxh3_accumulators
    return _kernel


def usable(device: torch.device) -> bool:
    """Whether payloads on ``device`` can be checked there."""
    if os.environ.get("KVSTORE_DEVICE_CHECKSUM", "1") == "0" or _broken:
        return False
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        return False
    return _load() is not None


def disable(reason: BaseException) -> None:
    """Check on the host from now on (the kernel failed: a Triton or driver that cannot run
    it); said once in the log."""
    global _broken
    if not _broken:
        log.warning("payload checksums move back to the host: the device kernel failed: %r",
                    reason)
    _broken = True


def warm_up(device: torch.device) -> bool:
    """Compile the kernel for ``device`` now (a fresh process's first use compiles it, which
    must not happen inside a request); whether it runs there. A kernel that fails turns the
    device checks off (``disable``)."""
    if not usable(device):
        return False
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            rows = torch.zeros((1, BLOCK + STRIPE), dtype=torch.uint8, device=device)
            checksums(rows, [0], 0, BLOCK + STRIPE)
    except Exception as exc:  # a Triton or driver that cannot run it: the host checks
        disable(exc)
        return False
    return True


@functools.cache
def _table(device: str) -> torch.Tensor:
    """``_TABLE`` on ``device``, made once per device."""
    return torch.tensor(_TABLE, dtype=torch.int64, device=device)


def accumulators(words: torch.Tensor, starts: torch.Tensor, nbytes: int) -> torch.Tensor:
    """XXH3's 8 accumulators, before the merge, of ``nbytes`` from each word offset in
    ``starts`` (int64 on the device) of ``words`` (a flat int64 view of the rows), queued on
    the current stream: ``[len(starts), 8]`` int64 bit patterns."""
    kernel = _load()
    assert kernel is not None and nbytes >= MIN_BYTES and nbytes % 8 == 0
    out = torch.empty((len(starts), 8), dtype=torch.int64, device=words.device)
    if len(starts):
        blocks = (nbytes - 1) // BLOCK
        kernel[(len(starts),)](words, starts, out, _table(str(words.device)), blocks,
                               ((nbytes - 1) - blocks * BLOCK) // STRIPE, (nbytes - STRIPE) // 8,
                               num_warps=NUM_WARPS)
    return out


def _mul128_fold64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The low and high 64 bits of each 128-bit product, xored (uint64 arrays)."""
    m32, s32 = np.uint64(0xFFFFFFFF), np.uint64(32)
    a0, a1, b0, b1 = a & m32, a >> s32, b & m32, b >> s32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> s32) + (p01 & m32) + (p10 & m32)
    low = (p00 & m32) | ((mid & m32) << s32)
    high = p11 + (p01 >> s32) + (p10 >> s32) + (mid >> s32)
    return low ^ high


def digests(accs: np.ndarray, nbytes: int) -> np.ndarray:
    """XXH3-64 of each payload from its accumulators (``[n, 8]`` int64 from ``accumulators``,
    on the host): uint64."""
    with np.errstate(over="ignore"):
        a = accs.view(np.uint64) ^ _MERGE_KEYS
        h = np.full(len(a), (nbytes * PRIME64[0]) & ((1 << 64) - 1), dtype=np.uint64)
        for i in range(4):
            h += _mul128_fold64(a[:, 2 * i], a[:, 2 * i + 1])
        h ^= h >> np.uint64(37)
        h *= np.uint64(0x165667919E3779F9)
        h ^= h >> np.uint64(32)
    return h


def checksums(rows: torch.Tensor, row_indices: Sequence[int], offset: int, nbytes: int
              ) -> np.ndarray:
    """XXH3-64 (uint64, on the host) of ``nbytes`` at ``offset`` in each of ``rows``'s rows
    ``row_indices`` (``rows``: ``[n, stride]`` uint8, its stride and ``offset`` multiples of 8),
    computed on the current stream of ``rows``'s device and waited for."""
    stride = rows.shape[1]
    assert stride % 8 == 0 and offset % 8 == 0
    words = rows.view(-1).view(torch.int64)
    starts = torch.tensor([(r * stride + offset) // 8 for r in row_indices], dtype=torch.int64)
    accs = accumulators(words, starts.to(rows.device, non_blocking=True), nbytes)
    return digests(accs.cpu().numpy(), nbytes)
