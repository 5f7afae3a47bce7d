"""``benchmarks/baselines/cpu_layout.py`` against vLLM's CPU attention's own reading of a block:
view [blocks, heads, 2 * block_size, head_size] and split K from V along dim 2."""

from __future__ import annotations

import pytest
import torch

from benchmarks.baselines.cpu_layout import blocks_view, gather_tokens, scatter_tokens


def make_cache(num_blocks: int = 5, num_kv_heads: int = 3, block_size: int = 32,
               head_size: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size, generator=g
                       ).to(dtype)


def reference_kv(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[2, tokens, heads * head_size] read the way vLLM's cpu_attn.py reads the cache."""
    num_blocks, num_kv_heads, block_size, width = cache.shape
    key_cache, value_cache = cache.view(num_blocks, num_kv_heads, block_size * 2,
                                        width // 2).chunk(2, dim=2)
    rows = []
    for part in (key_cache, value_cache):
        rows.append(torch.stack([part[int(s) // block_size, :, int(s) % block_size].reshape(-1)
                                 for s in slots]))
    return torch.stack(rows)


def make_slots(num_tokens: int, num_blocks: int = 5, block_size: int = 32) -> torch.Tensor:
    return torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(1)
                          )[:num_tokens]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 37, 160])
def test_gather_reads_each_token_as_vllm_does(dtype: torch.dtype, num_tokens: int) -> None:
    cache, slots = make_cache(dtype=dtype), make_slots(num_tokens)
    got = gather_tokens(blocks_view(cache, 64), slots)
    assert got.shape == (2, num_tokens, 3 * 64)
    assert torch.equal(got, reference_kv(cache, slots))


def test_scatter_writes_only_the_given_slots_and_gather_reads_them_back() -> None:
    cache = make_cache()
    before = cache.clone()
    slots = make_slots(50)
    kv = torch.randn(2, 50, 3 * 64)
    scatter_tokens(blocks_view(cache, 64), slots, kv)
    assert torch.equal(reference_kv(cache, slots), kv)
    untouched = torch.ones(5 * 32, dtype=torch.bool)
    untouched[slots] = False
    others = torch.nonzero(untouched).flatten()
    assert torch.equal(reference_kv(cache, others), reference_kv(before, others))


def test_a_cache_of_another_head_size_or_a_missing_slot_is_refused() -> None:
    cache = make_cache()
    with pytest.raises(ValueError, match="last dimension"):
        blocks_view(cache, 32)
    with pytest.raises(ValueError, match="-1"):
        gather_tokens(blocks_view(cache, 64), torch.tensor([3, -1]))
