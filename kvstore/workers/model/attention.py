"""Attention whose key length can be padded to the end of a chunk: full-chunk numerics for any
run of rows (docs/design.md §4, exact reuse).

A block's KV is only reusable bitwise if it was computed with exactly the arithmetic of the
canonical computation: the prompt in chunks of ``prefill_chunk_tokens`` from token 0. The rows
of a chunk attend over the keys up to the chunk's end, masked causally; a prompt's last,
partial chunk (or a request resuming in the middle of a chunk) has fewer keys, and the matmuls'
reduction order changes with that length, so the KV comes out different in the last bits.
Padding the key length to the chunk end (zero K/V, masked) gives every row the shapes of the
whole chunk. Masked keys contribute exactly zero, so the real rows are the rows of the whole
chunk wherever a backend's per-row results do not depend on how many rows run together; the
engine's probe (``kvstore.workers.engine.reuse_policy``) checks that on the real model before
relying on it.

The padded versions of transformers' ``eager`` and ``sdpa`` are registered under their own
names (``kvstore_eager``, ``kvstore_sdpa``) and take the target key length as the
``kv_pad_to`` keyword of the model call. Single-row steps (decode) and calls without
``kv_pad_to`` run the original function unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from kvstore.errors import ConfigError

#: The attention implementations a worker may ask for, and the padded one each runs as.
PADDED_IMPLEMENTATIONS = {"eager": "kvstore_eager", "sdpa": "kvstore_sdpa"}


def sdpa_backends(device: torch.device) -> list[SDPBackend]:
    """The SDPA kernels a CUDA worker's padded calls may run, in order of priority (named in
    the numerics tag): the order torch itself prefers on this GPU, made explicit.

    torch picks among flash, cuDNN, memory-efficient and math per call by an order that
    depends on its build, the cuDNN version, an environment variable and, on its first call,
    the GPU: pinning it keeps that choice a function of the call's shapes and dtype alone, so a
    cached and an uncached run of the same rows take the same kernel. Flash never takes the
    explicit mask a padded call has; cuDNN's attention goes first where torch puts it first
    (Hopper and later with cuDNN newer than 9.15, which fixed sequence lengths not a multiple
    of 128, and where it is the faster kernel for long keys); math is the fallback for shapes
    the others refuse.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    return list(_preferred_backends(index))


@functools.cache
def _preferred_backends(index: int) -> tuple[SDPBackend, ...]:
    major, _ = torch.cuda.get_device_capability(index)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if major >= 9 and (cudnn or 0) > 91500:
        return (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    return (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def _pinned(base: Callable[..., Any]) -> Callable[..., Any]:
    """``base`` (sdpa) run with ``sdpa_backends`` on CUDA, as is elsewhere."""

    def attention(module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if query.device.type != "cuda":
            return base(module, query, *args, **kwargs)  # type: ignore[no-any-return]
        with sdpa_kernel(sdpa_backends(query.device), set_priority=True):
            return base(module, query, *args, **kwargs)  # type: ignore[no-any-return]

    return attention


def _padded(base: Callable[..., Any], boolean_mask: bool,
            pin: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda f: f
            ) -> Callable[..., Any]:
    """``base`` attention with keys padded to ``kv_pad_to`` and an explicit causal mask
    (run as ``pin(base)``); calls without ``kv_pad_to`` (decode steps) run ``base`` as is."""
    pinned = pin(base)

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                  dropout: float = 0.0, kv_pad_to: int | None = None, **kwargs: Any
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        num_rows, num_keys = query.shape[-2], key.shape[-2]
        if kv_pad_to is None:
            return base(module, query, key, value, attention_mask, scaling=scaling,
                        dropout=dropout, **kwargs)
        target = max(int(kv_pad_to), num_keys)
        if target > num_keys:
            shape = (*key.shape[:-2], target - num_keys, key.shape[-1])
            key = torch.cat([key, key.new_zeros(shape)], dim=-2)
            value = torch.cat([value, value.new_zeros(shape)], dim=-2)
        # The rows are the last num_rows positions before the padding: row i sees keys <= i.
        rows = torch.arange(num_keys - num_rows, num_keys, device=query.device).unsqueeze(1)
        allowed = torch.arange(target, device=query.device).unsqueeze(0) <= rows
        if boolean_mask:
            mask = allowed[None, None]
        else:
            mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
            mask = mask.masked_fill(~allowed, torch.finfo(query.dtype).min)[None, None]
        return pinned(module, query, key, value, mask, scaling=scaling, dropout=dropout,
                      **kwargs)

    return attention


def padded_implementation(name: str) -> str:
    """The registered padded version of the attention implementation ``name``."""
    if name not in PADDED_IMPLEMENTATIONS:
        raise ConfigError(f"attention implementation {name!r} is not supported; use one of "
                          f"{sorted(PADDED_IMPLEMENTATIONS)}")
    return PADDED_IMPLEMENTATIONS[name]


AttentionInterface.register("kvstore_eager", _padded(eager_attention_forward, False))
AttentionInterface.register("kvstore_sdpa", _padded(sdpa_attention_forward, True, _pinned))
# The masks transformers builds before the layers: the originals (used when nothing is padded).
AttentionMaskInterface.register("kvstore_eager", eager_mask)
AttentionMaskInterface.register("kvstore_sdpa", sdpa_mask)
