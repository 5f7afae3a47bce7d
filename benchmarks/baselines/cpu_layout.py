"""vLLM's CPU paged KV cache, token by token: the copy a connector needs, with torch alone.

vLLM's CPU attention keeps, per layer, a tensor shaped [num_blocks, num_kv_heads, block_size,
2 * head_size] that its kernels view as [num_blocks, num_kv_heads, 2 * block_size, head_size] and
split in two along dim 2: for each head, the whole block's K rows, then its V rows. So the last
dimension is *not* one token's K beside its V. Connectors want token-major K and V:

  vLLM, one layer, one block                 token-major, one layer (LMCache's KV_2LTD)
  head 0: K[tok 0..bs-1][0..hs-1]            [0 = K][token][head * hs + d]
          V[tok 0..bs-1][0..hs-1]            [1 = V][token][head * hs + d]
  head 1: K[...] V[...]  ...

A token's slot in vLLM's slot mapping is block * block_size + offset, so each copy is one
gather (or scatter) over [block, :, :, offset, :] of the 5-d view ``blocks_view`` returns.
Kept free of any connector's imports so the project's tests can check it against vLLM's view.
"""

from __future__ import annotations

import torch


def blocks_view(cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """One layer's cache as [num_blocks, num_kv_heads, 2 (K, V), block_size, head_size]."""
    num_blocks, num_kv_heads, block_size, width = cache.shape
    if width != 2 * head_size:
        raise ValueError(f"a CPU KV cache of shape {tuple(cache.shape)} for head size "
                         f"{head_size}: the last dimension should be {2 * head_size}")
    return cache.view(num_blocks, num_kv_heads, 2, block_size, head_size)


def _split(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = slots.to(device="cpu", dtype=torch.long)
    if bool((slots < 0).any()):
        raise ValueError("a slot mapping with -1 (a token vLLM has no slot for)")
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


def gather_tokens(view: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The tokens at ``slots`` of one layer's ``blocks_view``, as [2, tokens, heads * hs]."""
    blocks, offsets = _split(slots, view.shape[3])
    tokens = view[blocks, :, :, offsets]  # [tokens, heads, 2, head_size]
    return tokens.permute(2, 0, 1, 3).reshape(2, len(slots), -1)


def scatter_tokens(view: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Write ``kv`` ([2, tokens, heads * hs]) into the ``slots`` of one layer's view."""
    blocks, offsets = _split(slots, view.shape[3])
    _, num_kv_heads, _, _, head_size = view.shape
    view[blocks, :, :, offsets] = kv.reshape(2, len(slots), num_kv_heads, head_size
                                             ).permute(1, 2, 0, 3)
