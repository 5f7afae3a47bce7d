"""A prefill cache whose fetched layers are filled as the forward reaches them.

A warm prefill's cached prefix arrives over DMA. Built up front, the cache waits for every
byte before the forward's first layer can start, so the transfer and the compute add up. When
the blocks arrive layer after layer (``kvstore.client.device_copy.DeviceRows.copy_runs_by_layer``),
each layer of the cache can instead be filled just before the forward's attention for that
layer reads it: its kernels wait on the GPU (not the host) for that layer's copies, and the
copies of the later layers run beside the compute of the earlier ones.

The cache is an ordinary ``DynamicCache`` of the prefix's full length from the start (every
length and mask the model computes from it is right), whose layers hold the fetched K/V once
``update`` has been called for them: the model calls it in each layer's attention, before the
layer reads its keys. Every layer a forward runs is filled, so after the first forward the cache
is exactly ``CausalLM.cache_from_kv``'s; ``fill_all`` fills any a caller reads without a
forward.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from kvstore.client.early_fetch import LayerFeed


class LayerFedCache(DynamicCache):
    """A ``DynamicCache`` holding ``feed.blocks`` (``[n, L, 2, bs, H, D]``, token order),
    each layer filled when the model first updates it."""

    def __init__(self, feed: LayerFeed, config: Any) -> None:
        self._feed: LayerFeed | None = None  # DynamicCache's own setup updates no layer of ours
        n, num_layers, _, bs, heads, head_dim = feed.blocks.shape
        # Stand-ins of the right shape: the cache copies them into its own tensors, which the
        # fills then overwrite. Expanded, so only the copy's writes cost.
        blank = torch.empty((1, heads, 1, head_dim), dtype=feed.blocks.dtype,
                            device=feed.blocks.device).expand(1, heads, n * bs, head_dim)
        super().__init__(ddp_cache_data=[(blank, blank)] * num_layers, config=config)
        self._feed = feed
        self._unfilled = set(range(num_layers))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self._feed is not None and layer_idx in self._unfilled:
            self._fill(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def fill_all(self) -> None:
        """Fill every layer no forward has reached yet."""
        for layer in sorted(getattr(self, "_unfilled", ())):
            self._fill(layer)

    def _fill(self, layer: int) -> None:
        feed = self._feed
        assert feed is not None
        self._unfilled.discard(layer)
        feed.wait_layer(layer)
        n, _, _, bs, heads, head_dim = feed.blocks.shape
        lay: Any = self.layers[layer]
        src = feed.blocks[:, layer]  # [n, 2, bs, H, D]
        for dst, kv in ((lay.keys, 0), (lay.values, 1)):
            # [1, H, n*bs, D] seen as [n, bs, H, D]: one strided copy from the blocks.
            dst[0].view(heads, n, bs, head_dim).permute(1, 2, 0, 3).copy_(src[:, kv])
