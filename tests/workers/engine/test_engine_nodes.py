"""The engine over real store nodes started in this process (no Ray, no Redis: as on the GPU
machine): blocks published through a node, read back on the same node (leased arena) and from
another (bulk channel) straight to the model's device; a cached run is bitwise the store-less
one, and a block corrupted in the arena is recomputed. CPU in CI, CUDA where there is one."""

from __future__ import annotations

import pytest
import torch

from kvstore.config import WorkerConfig
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.sampling import SamplingParams
from tests.client.test_cluster_store_device import DATA_KEY
from tests.client.test_cluster_store_device import make_cluster as make_cluster  # noqa: F401 (fixture)
from tests.support.arena import corrupt_in_arena

BS = 16
SAMPLING = SamplingParams(max_new_tokens=4)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
#: reader -> the node the reader runs on (node-a holds the blocks)
READERS = {"samenode": "node-a", "bulk": "node-b"}


@pytest.fixture(scope="module", params=DEVICES)
def model(request):
    return load_model("tiny", device=request.param)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, tokens: list[int], config: WorkerConfig):
    pre, dec = Engine(model, None, config).generate(tokens, sampling=SAMPLING,
                                                    return_logits=True)
    return pre.logits, dec.output_token_ids


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("keyed", [False, True])
def test_hits_through_a_node_equal_no_cache_and_corruption_is_recomputed(
        model, make_cluster, reader: str, keyed: bool) -> None:  # noqa: F811
    cluster = make_cluster(keyed)
    config = WorkerConfig(block_size=BS, prefill_chunk_tokens=64,
                          cache_salt="tenant" if keyed else "")
    data_key = DATA_KEY if keyed else None
    writer = Engine(model, cluster.store("node-a"), config, data_key=data_key)
    tokens = prompt(150, seed=11)
    cold = writer.prefill(tokens, sampling=SAMPLING)
    writer.wait_published()
    ref_logits, ref_tokens = reference(model, tokens, config)

    engine = Engine(model, cluster.store(READERS[reader]), config, data_key=data_key)
    pre, dec = engine.generate(tokens, sampling=SAMPLING, return_logits=True)
    assert pre.cached_tokens == (150 - 1) // BS * BS and not pre.misses
    assert pre.bytes_fetched == pre.cached_tokens // BS * engine.namespace.payload_nbytes
    assert torch.equal(pre.logits, ref_logits) and dec.output_token_ids == ref_tokens

    corrupt_in_arena(cluster.pools["node-a"], cold.block_keys[2])
    fresh = Engine(model, cluster.store(READERS[reader]), config, data_key=data_key)
    pre2, dec2 = fresh.generate(tokens, sampling=SAMPLING, return_logits=True)
    assert pre2.cached_tokens <= 2 * BS and any("corrupted" in m for m in pre2.misses)
    assert torch.equal(pre2.logits, ref_logits) and dec2.output_token_ids == ref_tokens
    for e in (writer, engine, fresh):
        e.close()
