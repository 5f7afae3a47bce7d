"""vLLM's paged KV as kvstore blocks, moved with kvstore's own operators.

A kvstore block's payload is ``[L, 2, block_size, H, D]`` (``kvstore.api.BlockPut``): every
layer's K and V rows of one block of tokens. vLLM keeps one cache tensor per attention layer,
shaped by its attention backend; ``LayerCache`` holds one layer's K and V as
``[num_blocks, block_size, H, D]`` views into that tensor (strided, never copies), which is the
ND layout of ``paged_cache_load``, and the same tensor as ``kv_cache_scatter``'s
``[layers, batch, max_seq_len, hidden]`` ``past``. So:

- saving gathers whole blocks with ``paged_cache_load`` (one sequence whose block table is the
  blocks to save), layer by layer, into block payloads;
- loading writes fetched payloads back with ``kv_cache_scatter``, one call per layer (and side,
  where K and V are apart): the batch axis walks every run of rows the cache keeps together
  (a block's ``block_size`` rows) over the span of blocks the load touches, the blocks being
  loaded get their whole run (``seq_len`` = the run) and the others in the span nothing
  (``seq_len`` 0), so a load costs one operator call per layer whatever its size, and never a
  pass over the whole cache;
- except on the CPU backend's layout, where a block's rows are per head, K then V, and a payload's
  per position: the operator would first pack each layer's rows into its ``[tokens, hidden]``
  form, a second copy of the whole load, so there each layer is written by one strided copy
  over the cache's block axis: the same bytes in the same places, in one pass
  (``tests/integrations/test_vllm_paged_layout.py`` checks both layouts against plain
  indexing). A run of payloads bound for consecutive blocks (what vLLM usually allocates a
  request) is one slice ``copy_``, faster than ``index_copy_``'s indexed rows
  (docs/vllm-measurements.md); blocks scattered in many runs take ``index_copy_``.

Backends whose cache is in neither known layout are refused when the caches are registered,
naming the shape seen, rather than read wrongly.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError
from kvstore.ops.operators import kv_cache_scatter, paged_cache_load


@dataclass(frozen=True)
class LayerCache:
    """One attention layer's K and V, each ``[num_blocks, block_size, H, D]`` (views), and how
    loads write it: ``blocks``, the CPU layout as ``[num_blocks, H, 2, block_size, D]``; else
    ``rows``, the layer as ``kv_cache_scatter`` writes it (``None`` where the tensor's strides
    do not allow that view: loads then take one operator call per block)."""

    key: torch.Tensor
    value: torch.Tensor
    rows: torch.Tensor | None = None
    blocks: torch.Tensor | None = None


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
        return LayerCache(kv[:, :, 0].permute(0, 2, 1, 3), kv[:, :, 1].permute(0, 2, 1, 3),
                          blocks=kv)
    if cache.dim() == 5 and shape[0] == 2 and shape[3:] == (num_kv_heads, head_dim):
        rows = _view_or_none(cache, (2, shape[1], shape[2], num_kv_heads * head_dim))
        return LayerCache(cache[0], cache[1], rows)
    raise ConfigError(
        f"unsupported vLLM KV cache layout {shape} for {num_kv_heads} KV heads of size "
        f"{head_dim}: expected [blocks, heads, block_size, 2*head_dim] (CPU) or "
        "[2, blocks, block_size, heads, head_dim]")


def _view_or_none(cache: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    try:
        return cache.view(shape)
    except RuntimeError:  # a permuted allocation (a backend's stride order): no such view
        return None


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


@dataclass(frozen=True)
class ScatterPlan:
    """Where one load's payloads go, the same for every layer: the block ids in payload order
    and their runs of consecutive blocks (what the CPU layout's slice copies need, no tensor);
    the operators' arguments are made on first use: the ids as a tensor (``ids``), the
    payloads in block order (``order``) and ``kv_cache_scatter``'s ``token_offset``/``seq_len``
    over the span of blocks ``[first_block, first_block + num_blocks)`` the load touches (not
    the whole cache: vLLM's holds thousands of blocks, and the operator reads every block it is
    given)."""

    block_ids: tuple[int, ...]
    block_size: int
    runs: tuple[tuple[int, int, int], ...] = ()  # (first payload, first block, length)

    @functools.cached_property
    def first_block(self) -> int:
        return min(self.block_ids, default=0)

    @functools.cached_property
    def num_blocks(self) -> int:
        return max(self.block_ids, default=-1) + 1 - self.first_block

    @functools.cached_property
    def ids(self) -> torch.Tensor:
        """The block ids, in payload order."""
        return torch.tensor(list(self.block_ids), dtype=torch.int64)

    @functools.cached_property
    def order(self) -> torch.Tensor:
        return torch.argsort(self.ids)

    @functools.cached_property
    def seq_len(self) -> torch.Tensor:
        """Per block of the span: the loaded blocks' rows whole, the others none."""
        lens = torch.zeros(self.num_blocks, dtype=torch.int64)
        lens[self.ids - self.first_block] = self.block_size
        return lens

    @functools.cached_property
    def token_offset(self) -> torch.Tensor:
        """Where each block's rows end: its whole run written from its start."""
        return self.seq_len.clone()


def plan_scatter(layer: LayerCache, block_ids: Sequence[int]) -> ScatterPlan:
    """Check ``block_ids`` against the cache and lay them out as the operator's arguments."""
    if len(set(block_ids)) != len(block_ids):
        raise ValueError("a vLLM block can be loaded once per step: duplicate block ids")
    num_blocks = layer.key.shape[0]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:4]} are outside vLLM's cache of {num_blocks} blocks")
    return ScatterPlan(tuple(block_ids), layer.key.shape[1], consecutive_runs(block_ids))


#: Up to this many runs of consecutive blocks, a CPU-layout write is one slice copy per run.
MAX_SLICE_RUNS = 4


def consecutive_runs(block_ids: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """``(first payload, first block, length)`` of each maximal run of payloads bound for
    consecutive blocks, in payload order."""
    runs: list[tuple[int, int, int]] = []
    for n, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((n, block, 1))
    return tuple(runs)


def scatter_layer(layer: LayerCache, index: int, plan: ScatterPlan,
                  payloads: torch.Tensor) -> None:
    """Write layer ``index`` of payloads ``[n, L, 2, block_size, H, D]`` into ``layer``."""
    if not plan.block_ids:
        return
    if layer.blocks is not None:  # CPU: [n, 2, bs, H, D] -> [n, H, 2, bs, D], strided copies
        new_kv = payloads[:, index].permute(0, 3, 1, 2, 4)
        if len(plan.runs) <= MAX_SLICE_RUNS:
            for start, first, length in plan.runs:
                layer.blocks[first:first + length].copy_(new_kv[start:start + length])
            return
        layer.blocks.index_copy_(0, plan.ids.to(layer.blocks.device),
                                 new_kv.to(layer.blocks.device, layer.blocks.dtype))
        return
    if layer.rows is None:
        for side, cache in ((0, layer.key), (1, layer.value)):
            _scatter_side(cache, plan.block_ids, payloads[:, index, side])
        return
    order = plan.order.to(payloads.device)
    dtype, width, device = layer.rows.dtype, layer.rows.shape[-1], layer.rows.device
    past = layer.rows.narrow(1, plan.first_block, plan.num_blocks)  # the span, a view
    for side in (0, 1):  # K is the operator's layer 0, V its layer 1
        new_kv = _in_block_order(payloads[:, index, side], order)
        kv_cache_scatter(past, new_kv.reshape(-1, width).to(device, dtype), side,
                         plan.token_offset, plan.seq_len)


def _in_block_order(view: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``view``'s rows in block order, contiguous, in one copy (``index_select`` into a fresh
    tensor), so the operator's ``[tokens, width]`` view of it is free; indexing a permuted view
    and then reshaping the result copies twice."""
    out = torch.empty(view.shape, dtype=view.dtype, device=view.device)
    return torch.index_select(view, 0, order, out=out)


def scatter_blocks(layers: Sequence[LayerCache], block_ids: Sequence[int],
                   payloads: torch.Tensor) -> None:
    """Write payloads ``[n, L, 2, block_size, H, D]`` into vLLM blocks ``block_ids``."""
    if len(block_ids) != payloads.shape[0]:
        raise ValueError(f"{len(block_ids)} block ids for {payloads.shape[0]} payloads")
    if not block_ids:
        return
    plan = plan_scatter(layers[0], block_ids)
    for i, layer in enumerate(layers):
        scatter_layer(layer, i, plan, payloads)


def _scatter_side(cache: torch.Tensor, targets: Sequence[int], rows: torch.Tensor) -> None:
    """``rows`` ``[n, block_size, H, D]`` into blocks ``targets`` of ``cache``, one operator
    call per block (for caches whose strides allow no whole-layer view).

    The operator's layer axis walks the cache's blocks, so each call fills its sequences whole:
    one sequence of ``[block_size, H*D]`` rows, or one per head where the backend keeps each
    head's rows together.
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
        kv_cache_scatter(past, new_kv.to(past.device, past.dtype), block, full, full)
