"""``LayerFedCache``: a prefill cache whose fetched layers are filled as the forward reaches them
equals the cache built up front (``prefill_cache`` through ``kv_cache_scatter``), bitwise, in
its logits and in every layer after the forward; on CUDA each layer's fill waits for that
layer's copies on the GPU."""

from __future__ import annotations

import pytest
import torch

from kvstore.client.early_fetch import LayerFeed
from kvstore.workers.engine.paged_kv import prefill_cache
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.layer_fed_cache import LayerFedCache

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _prompt_blocks(device: str):
    model = load_model("tiny", device=device, dtype="float32", attn_implementation="eager",
                       num_threads=1)
    tokens = list(range(3, 90))
    cache = model.new_cache()
    model.forward(tokens[:80], cache)
    return model, tokens, model.export_block_major(cache, 0, 5, 16)  # [5, L, 2, 16, H, D]


@pytest.mark.parametrize("device", DEVICES)
def test_filled_as_the_forward_reaches_each_layer_equals_the_cache_built_up_front(
        device: str) -> None:
    model, tokens, blocks = _prompt_blocks(device)
    num_layers = blocks.shape[1]
    marks: list = [None] * num_layers
    if device == "cuda":
        # The blocks "arrive" on a side stream after a delay: each fill must wait for them.
        landed = torch.zeros_like(blocks)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            for layer in range(num_layers):
                landed[:, layer].copy_(blocks[:, layer])
                marks[layer] = torch.cuda.Event()
                marks[layer].record(side)
        blocks_in = landed
    else:
        blocks_in = blocks
    n = 4  # the fetch kept its first four blocks
    up_front = prefill_cache(model, list(blocks[:n].unbind(0)))
    fed = prefill_cache(model, list(blocks_in[:n].unbind(0)), LayerFeed(blocks_in, marks))
    assert isinstance(fed, LayerFedCache)
    assert fed.get_seq_length() == n * 16, "lengths are right before any layer is filled"
    want = model.forward(tokens[n * 16:], up_front)
    got = model.forward(tokens[n * 16:], fed)
    assert torch.equal(got, want)
    for a, b in zip(up_front.layers, fed.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_fill_all_fills_the_layers_no_forward_reached() -> None:
    model, _, blocks = _prompt_blocks("cpu")
    fed = prefill_cache(model, list(blocks.unbind(0)),
                        LayerFeed(blocks, [None] * blocks.shape[1]))
    fed.fill_all()
    up_front = prefill_cache(model, list(blocks.unbind(0)))
    for a, b in zip(up_front.layers, fed.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_cache_made_ahead_is_cut_back_to_the_blocks_it_is_fed() -> None:
    """Made for the blocks asked for while the read still leases them, it may be fed fewer
    (the read kept only a leading run): it is cut back and equals the cache built for those."""
    model, tokens, blocks = _prompt_blocks("cpu")
    marks = [None] * blocks.shape[1]
    made = LayerFedCache.for_model(model, 5 * 16)
    fed = prefill_cache(model, list(blocks[:3].unbind(0)), LayerFeed(blocks, marks), made)
    assert fed is made and fed.get_seq_length() == 3 * 16
    up_front = prefill_cache(model, list(blocks[:3].unbind(0)))
    assert torch.equal(model.forward(tokens[48:], fed), model.forward(tokens[48:], up_front))
    for a, b in zip(up_front.layers, fed.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # Too short a cache made ahead is not used; a cache is fed once.
    short = LayerFedCache.for_model(model, 2 * 16)
    fed = prefill_cache(model, list(blocks[:3].unbind(0)), LayerFeed(blocks, marks), short)
    assert fed is not short and fed.get_seq_length() == 3 * 16
    with pytest.raises(ValueError, match="fed once"):
        fed.feed_from(LayerFeed(blocks[:3], marks))


def test_the_fetched_rows_are_let_go_once_every_layer_is_filled() -> None:
    model, tokens, blocks = _prompt_blocks("cpu")
    fed = prefill_cache(model, list(blocks.unbind(0)),
                        LayerFeed(blocks, [None] * blocks.shape[1]))
    assert fed._feed is not None
    model.forward(tokens[80:], fed)
    assert fed._feed is None, "a cache that lives on (a decode) must not pin the fetch's rows"
