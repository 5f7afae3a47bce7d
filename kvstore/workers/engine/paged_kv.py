"""Fetched blocks into a model's per-layer K/V: the two places the store's operators are used.

Prefill writes the blocks it fetched into the request's paged KV with ``kv_cache_scatter``
(or, where they arrive layer after layer on a GPU, each layer straight into the cache as the
forward reaches it: ``kvstore.workers.model.layer_fed_cache``);
decode places them in a block-major pool and gathers contiguous K/V with ``paged_cache_load``.
Both return per-layer ``[T, H, D]`` tensors that ``CausalLM.cache_from_kv`` turns into a cache
(``prefill_cache``, ``decode_cache``). Everything stays on the payloads' device (the model's);
the block tables and lengths are built here on the host, so the operators need no
device-to-host synchronisation.

A block-major pool slot is one block payload, exactly as the store holds it::

    pool[slot] = [L, 2, bs, H, D]      pool[:, layer, 0] = K cache of one layer
                                       (a strided [num_blocks, bs, H, D] view: no copy)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from kvstore.client.early_fetch import LayerFeed
from kvstore.ops.operators import kv_cache_scatter, paged_cache_load
from kvstore.workers.model.causal_lm import CausalLM
from kvstore.workers.model.layer_fed_cache import LayerFedCache


def _check_payloads(payloads: Sequence[torch.Tensor]) -> tuple[int, int, int, int]:
    if not payloads:
        raise ValueError("no blocks given")
    shape = payloads[0].shape
    if len(shape) != 5 or shape[1] != 2:
        raise ValueError(f"block payload must be [L, 2, bs, H, D], got {tuple(shape)}")
    for p in payloads:
        if p.shape != shape or p.dtype != payloads[0].dtype:
            raise ValueError("all blocks of a request must share shape and dtype")
    num_layers, _, block_size, num_heads, head_dim = shape
    return num_layers, block_size, num_heads, head_dim


def scatter_blocks(payloads: Sequence[torch.Tensor]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Write blocks (in token order) into paged K and V with ``kv_cache_scatter``.

    Returns per-layer K and V as ``[T, H, D]`` views of the request's paged KV.
    """
    num_layers, block_size, num_heads, head_dim = _check_payloads(payloads)
    num_tokens = len(payloads) * block_size
    hidden = num_heads * head_dim
    dtype = payloads[0].dtype
    # [layers, batch=1, max_seq_len, hidden]: the request's paged KV, one for K and one for V.
    past_k = torch.empty(num_layers, 1, num_tokens, hidden, dtype=dtype,
                         device=payloads[0].device)
    past_v = torch.empty_like(past_k)
    stacked = torch.stack(list(payloads))  # [nb, L, 2, bs, H, D]
    lens = torch.tensor([num_tokens], dtype=torch.int32)
    for layer in range(num_layers):
        new_k = stacked[:, layer, 0].reshape(num_tokens, hidden)
        new_v = stacked[:, layer, 1].reshape(num_tokens, hidden)
        kv_cache_scatter(past_k, new_k, layer, lens, lens, check=False)
        kv_cache_scatter(past_v, new_v, layer, lens, lens, check=False)
    keys = [past_k[layer, 0].view(num_tokens, num_heads, head_dim) for layer in range(num_layers)]
    values = [past_v[layer, 0].view(num_tokens, num_heads, head_dim)
              for layer in range(num_layers)]
    return keys, values


def gather_blocks(payloads: Sequence[torch.Tensor]
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Place blocks in a block-major pool and gather per-layer ``[T, H, D]`` K/V from it."""
    num_layers, block_size, _, _ = _check_payloads(payloads)
    num_blocks = len(payloads)
    pool = torch.stack(list(payloads))  # [num_blocks, L, 2, bs, H, D]
    block_table = torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0)
    context_lens = torch.tensor([num_blocks * block_size], dtype=torch.int32)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in range(num_layers):
        k, v = paged_cache_load(pool[:, layer, 0], pool[:, layer, 1], block_table, context_lens,
                                check=False)
        keys.append(k)
        values.append(v)
    return keys, values


def prefill_cache(model: CausalLM, payloads: Sequence[torch.Tensor],
                  feed: LayerFeed | None = None, made: DynamicCache | None = None
                  ) -> DynamicCache:
    """A prefill's cache holding its fetched blocks (in token order; none: an empty cache).

    ``feed``: the blocks are still arriving layer after layer (a same-node read into a GPU):
    each layer is filled straight from them as the forward reaches it
    (``kvstore.workers.model.layer_fed_cache``), the first ``len(payloads)`` blocks; ``made``
    is a ``LayerFedCache`` made for them ahead (used when long enough)."""
    if not payloads:
        return model.new_cache()
    if feed is not None:
        num_tokens = len(payloads) * feed.blocks.shape[3]
        cache = made if isinstance(made, LayerFedCache) and made.num_tokens >= num_tokens \
            else LayerFedCache.for_model(model, num_tokens)
        cache.feed_from(LayerFeed(feed.blocks[:len(payloads)], feed.marks))
        return cache
    return model.cache_from_kv(*scatter_blocks(payloads))


def decode_cache(model: CausalLM, payloads: Sequence[torch.Tensor],
                 tail_kv: torch.Tensor | None) -> DynamicCache:
    """A decode's cache: its fetched blocks (in token order), then ``tail_kv`` (the prefill's
    private tail, ``[L, 2, T, H, D]`` on any device) right after them when given."""
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    if payloads:
        keys, values = gather_blocks(payloads)
    if tail_kv is not None:
        kv = tail_kv.to(model.device)
        tail_k = [kv[layer, 0] for layer in range(kv.shape[0])]
        tail_v = [kv[layer, 1] for layer in range(kv.shape[0])]
        keys = [torch.cat(p) for p in zip(keys, tail_k, strict=True)] if keys else tail_k
        values = [torch.cat(p) for p in zip(values, tail_v, strict=True)] if values else tail_v
    return model.cache_from_kv(keys, values) if keys else model.new_cache()
