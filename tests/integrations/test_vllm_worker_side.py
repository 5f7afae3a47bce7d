"""The connector's worker side over a real LocalStore: blocks saved out of one instance's paged
caches load into another's bitwise, and a block that cannot be loaded is reported for vLLM to
recompute, never written."""

from __future__ import annotations

import torch

from kvstore.api import MISS_NOT_FOUND, Miss
from kvstore.client.local_store import LocalStore
from kvstore.integrations.vllm.plans import BlockTransfer, StepPlan
from kvstore.integrations.vllm.worker_side import WorkerSide, layer_order
from kvstore.keys import BlockHasher, Namespace

BS, H, D, L, NB = 4, 2, 8, 3, 6


def ns(salt: str) -> Namespace:
    return Namespace("e" * 64, "float32", BS, L, H, D, salt)


def caches() -> dict[str, torch.Tensor]:  # the CPU backend's layout, one tensor per layer
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NB, H, BS, 2 * D) for i in range(L)}


def transfer(tokens: list[int], block_ids: list[int]) -> BlockTransfer:
    keys = [bytes(k) for k in BlockHasher(ns("")).block_keys(tokens)]
    return BlockTransfer("r", "", keys, [ns("").root, *keys[:-1]],
                         [tokens[i * BS:(i + 1) * BS] for i in range(len(keys))], block_ids)


def test_layers_are_ordered_by_index_not_by_name() -> None:
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1)]
    assert sorted(names, key=layer_order) == [names[2], names[1], names[0]]


def test_saved_blocks_load_bitwise_into_another_instance() -> None:
    store = LocalStore()
    src, dst = caches(), caches()
    writer, reader = WorkerSide(store, ns, H, D), WorkerSide(store, ns, H, D)
    writer.register(src)
    reader.register(dst)
    tokens = list(range(8))
    writer.save(StepPlan(saves=[transfer(tokens, [4, 1])]))
    writer.flush()
    assert writer.saved_blocks == 2
    reader.load(StepPlan(loads=[transfer(tokens, [0, 5])]))
    assert reader.load_errors() == set()
    for name in src:
        assert torch.equal(dst[name][0], src[name][4]) and torch.equal(dst[name][5], src[name][1])
    writer.close()
    reader.close()


def test_blocks_from_the_first_miss_on_are_load_errors_and_stay_untouched() -> None:
    store = LocalStore()
    src, dst = caches(), caches()
    writer, reader = WorkerSide(store, ns, H, D), WorkerSide(store, ns, H, D)
    writer.register(src)
    reader.register(dst)
    tokens = list(range(12))
    writer.save(StepPlan(saves=[transfer(tokens, [0, 1, 2])]))
    writer.flush()
    before = {name: t.clone() for name, t in dst.items()}
    real_get = store.batch_get

    def second_block_lost(namespace, keys, token_ids, **kw):
        results = real_get(namespace, keys, token_ids, **kw)
        results[1] = Miss(keys[1], MISS_NOT_FOUND)
        return results

    store.batch_get = second_block_lost  # type: ignore[method-assign]
    reader.load(StepPlan(loads=[transfer(tokens, [3, 4, 5])]))
    assert reader.load_errors() == {4, 5}
    assert reader.load_errors() == set()  # reported once
    for name in dst:
        assert torch.equal(dst[name][3], src[name][0])
        assert torch.equal(dst[name][4], before[name][4])
        assert torch.equal(dst[name][5], before[name][5])
