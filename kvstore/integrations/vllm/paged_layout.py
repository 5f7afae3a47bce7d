"""vLLM's paged KV as kvstore blocks, moved with kvstore's own operators.

A kvstore block's payload is ``[L, 2, block_size, H, D]`` (``kvstore.api.BlockPut``): every
layer's K and V rows of one block of tokens. vLLM keeps one cache tensor per attention layer,
shaped by its attention backend; ``LayerCache`` is one layer's K and V as
``[num_blocks, block_size, H, D]`` views into that tensor (strided, never copies), which is the
ND layout of ``paged_cache_load``. So:

- saving gathers whole blocks with ``paged_cache_load`` (one sequence whose block table is the
  blocks to save), layer by layer, into block payloads;
- loading writes fetched payloads back with ``kv_cache_scatter``, reading the cache as a batch
  whose layer axis walks the blocks: each block is one call filling its sequences whole (one
  of ``[block_size, H*D]`` rows, or one per head where the backend keeps a head's rows
  together).

Backends whose cache is in neither known layout are refused when the caches are registered,
naming the shape seen, rather than read wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError
from kvstore.ops.operators import kv_cache_scatter, paged_cache_load


@dataclass(frozen=True)
class LayerCache:
    """One attention layer's K and V, each ``[num_blocks, block_size, H, D]`` (views)."""

    key: torch.Tensor
    value: torch.Tensor


def layer_cache(cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> LayerCache:
    """K and V views of one layer's vLLM cache tensor, whichever known layout it has.

    - ``[num_blocks, H, block_size, 2*D]`` (the CPU backend): each (block, head) holds its
      ``block_size`` K rows, then its ``block_size`` V rows;
    - ``[2, num_blocks, block_size, H, D]`` (flash-attention style backends): K, then V.
    """
    shape = tuple(cache.shape)
    if cache.dim() == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_dim:
        nb, heads, bs, _ = shape
        kv = cache.view(nb, heads, 2, bs, head_dim)
        return LayerCache(kv[:, :, 0].permute(0, 2, 1, 3), kv[:, :, 1].permute(0, 2, 1, 3))
    if cache.dim() == 5 and shape[0] == 2 and shape[3:] == (num_kv_heads, head_dim):
        return LayerCache(cache[0], cache[1])
    raise ConfigError(
        f"unsupported vLLM KV cache layout {shape} for {num_kv_heads} KV heads of size "
        f"{head_dim}: expected [blocks, heads, block_size, 2*head_dim] (CPU) or "
        "[2, blocks, block_size, heads, head_dim]")


def gather_blocks(layers: Sequence[LayerCache], block_ids: Sequence[int]) -> torch.Tensor:
    """Payloads ``[n, L, 2, block_size, H, D]`` of vLLM blocks ``block_ids``, in that order."""
    first = layers[0].key
    _, bs, heads, dim = first.shape
    n = len(block_ids)
    out = torch.empty((n, len(layers), 2, bs, heads, dim), dtype=first.dtype, device=first.device)
    if n == 0:
        return out
    table = torch.tensor([list(block_ids)], dtype=torch.int64)
    lens = torch.tensor([n * bs], dtype=torch.int64)
    for i, layer in enumerate(layers):
        k, v = paged_cache_load(layer.key, layer.value, table, lens)
        out[:, i, 0] = k.view(n, bs, heads, dim)
        out[:, i, 1] = v.view(n, bs, heads, dim)
    return out


def scatter_blocks(layers: Sequence[LayerCache], block_ids: Sequence[int],
                   payloads: torch.Tensor) -> None:
    """Write payloads ``[n, L, 2, block_size, H, D]`` into vLLM blocks ``block_ids``."""
    if len(block_ids) != payloads.shape[0]:
        raise ValueError(f"{len(block_ids)} block ids for {payloads.shape[0]} payloads")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError("a vLLM block can be loaded once per step: duplicate block ids")
    if not block_ids:
        return
    num_blocks = layers[0].key.shape[0]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:4]} are outside vLLM's cache of {num_blocks} blocks")
    for i, layer in enumerate(layers):
        for side, cache in ((0, layer.key), (1, layer.value)):
            _scatter_side(cache, block_ids, payloads[:, i, side])


def _scatter_side(cache: torch.Tensor, targets: Sequence[int], rows: torch.Tensor) -> None:
    """``rows`` ``[n, block_size, H, D]`` into blocks ``targets`` of ``cache``.

    The operator's layer axis walks the cache's blocks, so each block is one call that fills
    its sequences whole: one sequence of ``[block_size, H*D]`` rows, or one per head where the
    backend keeps each head's rows together.
    """
    nb, bs, heads, dim = cache.shape
    try:
        past, per_head = cache.view(nb, 1, bs, heads * dim), False
    except RuntimeError:
        past, per_head = cache.permute(0, 2, 1, 3), True  # [blocks, H, block_size, D]
    full = torch.full((past.shape[1],), bs, dtype=torch.int64)
    for n, block in enumerate(targets):
        block_rows = rows[n]  # [block_size, H, D]
        new_kv = (block_rows.permute(1, 0, 2).reshape(-1, dim) if per_head
                  else block_rows.reshape(bs, heads * dim))
        kv_cache_scatter(past, new_kv.to(past.dtype), block, full, full)
