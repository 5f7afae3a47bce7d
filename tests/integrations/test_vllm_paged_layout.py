"""vLLM's paged caches <-> kvstore block payloads, against plain indexing of the same tensors.

Both cache layouts vLLM's backends use are built here as vLLM allocates them (one tensor per
layer), filled with distinct values, so a row read from the wrong block, head or side shows.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.integrations.vllm.paged_layout import (
    consecutive_runs,
    gather_blocks,
    layer_cache,
    scatter_blocks,
)

NB, BS, H, D, L = 9, 4, 3, 8, 2


def cpu_cache() -> torch.Tensor:
    """The CPU backend's [blocks, heads, block_size, 2*D]: per (block, head) K rows, V rows."""
    return torch.randn(NB, H, BS, 2 * D)


def flash_cache() -> torch.Tensor:
    return torch.randn(2, NB, BS, H, D)


def permuted_flash_cache() -> torch.Tensor:
    """The flash shape over a head-major allocation (a backend's stride order): no whole-layer
    view exists, so loads take the per-block path."""
    return torch.randn(2, NB, H, BS, D).permute(0, 1, 3, 2, 4)


MAKERS = pytest.mark.parametrize("make", [cpu_cache, flash_cache, permuted_flash_cache],
                                 ids=["cpu", "flash", "permuted"])


def reference_block(cache: torch.Tensor, block: int) -> torch.Tensor:
    """[2, block_size, H, D] of one block, read by plain indexing of the backend's layout."""
    if cache.dim() == 4:  # K rows then V rows per (block, head)
        kv = cache[block].reshape(H, 2, BS, D)  # [H, 2, BS, D]
        return kv.permute(1, 2, 0, 3)
    return cache[:, block]


def test_whole_layer_views_where_the_strides_allow() -> None:
    cpu = layer_cache(cpu_cache(), H, D)  # written by one strided copy per layer
    assert cpu.blocks is not None and cpu.blocks.shape == (NB, H, 2, BS, D)
    assert layer_cache(flash_cache(), H, D).rows is not None  # by the operator
    assert layer_cache(permuted_flash_cache(), H, D).rows is None  # by it, block by block


@MAKERS
def test_gather_reads_each_block_like_plain_indexing(make) -> None:
    caches = [make() for _ in range(L)]
    layers = [layer_cache(c, H, D) for c in caches]
    blocks = [7, 2, 5]
    out = gather_blocks(layers, blocks)
    assert out.shape == (3, L, 2, BS, H, D)
    for n, b in enumerate(blocks):
        for i, c in enumerate(caches):
            assert torch.equal(out[n, i], reference_block(c, b))


@MAKERS
@pytest.mark.parametrize("blocks", [
    [6, 0, 3],  # not in order: each payload goes to its own block
    [2, 3, 4, 5],  # one run of consecutive blocks (one slice copy on the CPU layout)
    [7, 8, 1, 2, 4],  # three runs
    [8, 6, 4, 2, 0, 1],  # more runs than slice copies are made for (index_copy_)
], ids=["unordered", "one-run", "runs", "many-runs"])
def test_scatter_writes_only_the_named_blocks(make, blocks: list[int]) -> None:
    caches = [make() for _ in range(L)]
    before = [c.clone() for c in caches]
    layers = [layer_cache(c, H, D) for c in caches]
    payloads = torch.randn(len(blocks), L, 2, BS, H, D)
    scatter_blocks(layers, blocks, payloads)
    for i, (c, old) in enumerate(zip(caches, before, strict=True)):
        for b in range(NB):
            want = payloads[blocks.index(b), i] if b in blocks else reference_block(old, b)
            assert torch.equal(reference_block(c, b), want), (i, b)


def test_consecutive_runs_in_payload_order() -> None:
    assert consecutive_runs([7, 8, 1, 2, 4]) == ((0, 7, 2), (2, 1, 2), (4, 4, 1))
    assert consecutive_runs([3, 2]) == ((0, 3, 1), (1, 2, 1))  # descending is no run
    assert consecutive_runs([]) == ()


def test_round_trip_between_two_caches() -> None:
    """Saved from one instance's cache, loaded into another's at other block ids: equal KV."""
    src = [cpu_cache() for _ in range(L)]
    dst = [cpu_cache() for _ in range(L)]
    payloads = gather_blocks([layer_cache(c, H, D) for c in src], [1, 4])
    scatter_blocks([layer_cache(c, H, D) for c in dst], [8, 3], payloads)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[8], s[1]) and torch.equal(d[3], s[4])


def test_unknown_layouts_and_bad_arguments_are_refused() -> None:
    with pytest.raises(ConfigError, match="unsupported vLLM KV cache layout"):
        layer_cache(torch.zeros(NB, BS, H, D), H, D)
    layers = [layer_cache(cpu_cache(), H, D)]
    with pytest.raises(ValueError, match="2 block ids for 1 payloads"):
        scatter_blocks(layers, [1, 2], torch.zeros(1, 1, 2, BS, H, D))
    with pytest.raises(ValueError, match="duplicate"):
        scatter_blocks(layers, [1, 1], torch.zeros(2, 1, 2, BS, H, D))
    with pytest.raises(ValueError):  # out of range: the operator's own check names it
        scatter_blocks(layers, [NB], torch.zeros(1, 1, 2, BS, H, D))
