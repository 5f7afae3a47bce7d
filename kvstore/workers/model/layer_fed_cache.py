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
layer reads its keys. It needs only the prefix's length to be made, so the engine makes it while
the read is still leasing its blocks and issuing the copies. Every layer a forward runs is
filled, so after the first forward the cache is exactly ``CausalLM.cache_from_kv``'s;
``fill_all`` fills any a caller reads without a forward.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from kvstore.client.early_fetch import LayerFeed
from kvstore.keys import DTYPES


class LayerFedCache(DynamicCache):
    """A ``DynamicCache`` of ``num_tokens`` tokens whose layers are filled from a ``LayerFeed``
    (``feed_from``), each when the model first updates it.

    Made before the blocks are there (its shapes are all it needs), it can be built while the
    read is still leasing and issuing its copies; ``feed_from`` then gives it the blocks, which
    may cover fewer tokens than it was made for (it is cut back to them)."""

    def __init__(self, num_tokens: int, num_layers: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, config: Any) -> None:
        self._feed: LayerFeed | None = None  # DynamicCache's own setup fills no layer of ours
        self._fed = False
        self._unfilled: set[int] = set()
        # Stand-ins of the right shape: the cache copies them into its own tensors, which the
        # fills then overwrite. Expanded, so only the copy's writes cost.
        blank = torch.empty((1, num_heads, 1, head_dim), dtype=dtype, device=device) \
            .expand(1, num_heads, num_tokens, head_dim)
        super().__init__(ddp_cache_data=[(blank, blank)] * num_layers, config=config)
        self.num_tokens = num_tokens

    @classmethod
    def for_model(cls, model: Any, num_tokens: int) -> LayerFedCache:
        """One for ``model`` (a ``CausalLM``), ``num_tokens`` long."""
        s = model.shape
        return cls(num_tokens, s.num_layers, s.num_kv_heads, s.head_dim, DTYPES[model.dtype],
                   model.device, model.config)

    def feed_from(self, feed: LayerFeed) -> None:
        """Fill the layers from ``feed`` (its blocks are the first tokens, up to
        ``num_tokens``; a cache made longer is cut back to them)."""
        n, num_layers, _, bs, _, _ = feed.blocks.shape
        if self._fed or n * bs > self.num_tokens or num_layers != len(self.layers):
            raise ValueError(f"cannot feed {n} blocks of {num_layers} layers to a cache of "
                             f"{self.num_tokens} tokens and {len(self.layers)} layers "
                             "(fed once, before any forward)")
        if n * bs < self.num_tokens:
            self.crop(n * bs)
            self.num_tokens = n * bs
        self._feed, self._fed = feed, True
        self._unfilled = set(range(num_layers))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self._unfilled:
            self._fill(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def fill_all(self) -> None:
        """Fill every layer no forward has reached yet."""
        for layer in sorted(self._unfilled):
            self._fill(layer)

    def _fill(self, layer: int) -> None:
        feed = self._feed
        assert feed is not None
        self._unfilled.discard(layer)
        if not self._unfilled:  # the rows (the whole fetch) need not live as long as the cache
            self._feed = None
        feed.wait_layer(layer)
        n, _, _, bs, heads, head_dim = feed.blocks.shape
        lay: Any = self.layers[layer]
        src = feed.blocks[:, layer]  # [n, 2, bs, H, D]
        for dst, kv in ((lay.keys, 0), (lay.values, 1)):
            # [1, H, n*bs, D] seen as [n, bs, H, D]: one strided copy from the blocks.
            dst[0].view(heads, n, bs, head_dim).permute(1, 2, 0, 3).copy_(src[:, kv])
