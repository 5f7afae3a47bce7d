"""Warm TTFT with a shared prompt's blocks only on disk against the same blocks in the arena.

Part of ``bench_tier``. One real store node (``StoreServer`` over a ``TieredPool`` with a disk
directory, gRPC leases, same-node copies out of its shared memory) and an in-memory index; no
Ray (the coordinator would add nothing to a lease on one node). A cold request publishes the
shared prompt; then each warm prompt (the shared prompt and its own suffix, shorter than a
block so that it is never published and both runs of it fetch and compute the same) is timed
with the blocks in the arena, and again after every block the node holds was demoted to disk
and the page cache dropped, so that the lease promotes them from the files. Which tier goes
first alternates, medians are compared; every warm output must equal the same engine run with
``use_cache=False``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from kvstore.api import NodeAddress
from kvstore.client.cluster_store import ClusterStore
from kvstore.config import ClientConfig, ServerConfig, WorkerConfig
from kvstore.index.memory import InMemoryIndex
from kvstore.node.block_pool import BlockPool
from kvstore.node.disk_tier import DiskTier
from kvstore.node.store_server import StoreServer
from kvstore.node.tiered_pool import TieredPool
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.sampling import SamplingParams

NODE = "tier-node"


def make_tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def bench_warm_ttft(quick: bool, workdir: Path, drop_caches: Callable[[], bool]
                    ) -> dict[str, float | int | str | bool]:
    preset = "small"
    shared_tokens, rounds, new_tokens = (512, 2, 4) if quick else (2048, 3, 8)
    config = WorkerConfig(model=preset, block_size=16, prefill_chunk_tokens=256,
                          num_threads=2, max_new_tokens=new_tokens)
    model = load_model(preset, seed=0, num_threads=config.num_threads)
    vocab = model.shape.vocab_size
    sampling = SamplingParams(max_new_tokens=new_tokens)
    shared = make_tokens(shared_tokens, 1, vocab)
    prompts = [shared + make_tokens(8 + i, 100 + i, vocab) for i in range(rounds + 1)]

    pool = TieredPool(BlockPool(256 << 20), DiskTier(str(workdir / "ttft"), 1 << 30),
                      queue_bytes=1 << 30)
    index = InMemoryIndex()
    server = StoreServer(pool, NODE, ServerConfig(), on_publish=index.publish)
    server.start()
    grpc_addr, bulk_addr = server.addresses
    address = NodeAddress(NODE, grpc_addr, bulk_addr, pool.path)
    store = ClusterStore(NODE, index, lambda _: address, ClientConfig(timeout_s=30))
    arena_ttft: list[float] = []
    disk_ttft: list[float] = []
    matches: list[bool] = []
    disk_cached: list[int] = []
    dropped = True
    try:
        engine = Engine(model, store, config)
        engine.generate(prompts[0], sampling=sampling, request_id="cold")
        engine.wait_published()
        for i, prompt in enumerate(prompts[1:]):
            _, ref = Engine(model, None, config).generate(prompt, sampling=sampling,
                                                          use_cache=False)
            for on_disk in ((False, True) if i % 2 == 0 else (True, False)):
                if on_disk:  # every block the node holds goes to disk; the arena is empty
                    pool.demote(pool.arena.keys())
                    pool.flush(120)
                    assert not pool.arena.keys(), "blocks left in the arena"
                    dropped = drop_caches() and dropped
                pre, dec = engine.generate(prompt, sampling=sampling, request_id=f"w{i}")
                (disk_ttft if on_disk else arena_ttft).append(pre.ttft_s)
                if on_disk:
                    disk_cached.append(pre.cached_tokens)
                matches.append(dec.output_token_ids == ref.output_token_ids)
        disk_hits = pool.counters.disk_hits
    finally:
        store.close()
        server.stop(0)
        pool.close(purge=True)
    arena = statistics.median(arena_ttft)
    disk = statistics.median(disk_ttft)
    return {"ttft_model": preset, "ttft_shared_prompt_tokens": shared_tokens,
            "ttft_rounds": rounds, "ttft_page_cache_dropped": dropped,
            "ttft_disk_cached_tokens_min": min(disk_cached), "ttft_disk_hits": disk_hits,
            "warm_ttft_arena_s": arena, "warm_ttft_disk_s": disk,
            "ratio_warm_ttft_disk_vs_arena": disk / arena,
            "ttft_outputs_equal_no_cache": all(matches)}
