"""Facts of kvstore's formats that several layers share, in one module with no heavy imports.

The operator CLI and the config loader must not import torch (seconds of start-up), so the key
size and the dtype names live here rather than in ``kvstore.keys``; the arena and the block
codec share one alignment.
"""

from __future__ import annotations

#: Bytes of a block key: a sha256 digest (docs/design.md §3.1).
KEY_NBYTES = 32

#: A block's pin level in the coordinator's table (one byte per block): soft pins are evicted
#: last, hard pins never.
PIN_NONE = 0
PIN_SOFT = 1
PIN_HARD = 2

#: dtype names as a namespace spells them: torch's names without the ``torch.`` prefix.
#: ``uint8`` holds a quantized KV cache's bytes (vLLM keeps its fp8 caches so; the format
#: itself is in the namespace's numerics tag).
DTYPE_NAMES: tuple[str, ...] = ("float16", "bfloat16", "float32", "int8", "uint8")

#: Alignment of a block's payload and of every arena extent: a cache line, and enough for any
#: dtype's vectorised loads.
ALIGN = 64


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN
