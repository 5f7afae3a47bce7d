"""Damage one block a vLLM instance published, where it lives (the store node's arena file), as
a faulty disk or a hostile process on the node would: ``python -m tests.support.vllm_blocks
JOBS`` with a JSON list of jobs ``{"checkpoint", "block_size", "tokens", "block", "salt"}``
(the instance ran with ``dtype="float32"``, as ``benchmarks.vllm_instance`` runs them), done in
one process and one connection (a process start costs seconds); one ``CORRUPTED <key>`` line
each. A job may name a tensor-parallel instance's KV-head slice (``tensor_parallel_size``,
``shard``) and its KV cache's dtype (``kv_cache_dtype``). A job with ``"held": true`` damages
nothing and prints ``HELD <n>``: how many of the prompt's blocks the cluster holds in that
namespace.

The block is found the way the connector finds it: the namespace kvstore makes for a vLLM CPU
instance of that checkpoint, the prompt's chained key, its holder in the index; one byte of its
payload is flipped through a lease's location in the holder's arena file. Runs in a process of
its own so that the test process never joins the Ray cluster.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from tests.support.arena import flip_last_byte


def cpu_namespace(checkpoint: str, block_size: int, salt: str | None,
                  dtype: str = "float32", tensor_parallel_size: int = 1, shard: int = 0,
                  kv_cache_dtype: str = "auto") -> Any:
    """The namespace ``KVStoreConnector`` makes on a vLLM CPU instance of ``checkpoint`` (the
    KV-head slice ``shard``, on one of ``tensor_parallel_size`` ranks; its KV cache in
    ``kv_cache_dtype``)."""
    from types import SimpleNamespace

    import vllm

    from kvstore.integrations.vllm.connector import kv_cache_format
    from kvstore.integrations.vllm.namespace import (
        ModelGeometry,
        checkpoint_fingerprint,
        namespace,
        numerics,
    )

    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = json.load(f)
    cache_dtype, cache_format = kv_cache_format(
        SimpleNamespace(cache_dtype=kv_cache_dtype, kv_cache_dtype_skip_layers=[]), dtype)
    geometry = ModelGeometry(
        checkpoint=checkpoint, dtype=cache_dtype, kv_cache_format=cache_format,
        block_size=block_size,
        num_layers=cfg["num_hidden_layers"],
        num_kv_heads=max(1, cfg["num_key_value_heads"] // tensor_parallel_size),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        tensor_parallel_size=tensor_parallel_size, total_kv_heads=cfg["num_key_value_heads"])
    tag = numerics(torch.device("cpu"), vllm.__version__, "CPU_ATTN")
    return namespace(geometry, checkpoint_fingerprint(checkpoint), tag, salt, shard=shard)


def run(jobs: list[dict[str, Any]]) -> list[str]:
    """Flip the last payload byte of block ``job["block"]`` of ``job["tokens"]``, for each job;
    their output lines (``held`` jobs: how many blocks are held)."""
    from kvstore.cluster.lifecycle import cluster_config, connect
    from kvstore.config import KVStoreConfig
    from kvstore.keys import BlockHasher

    store = connect(cluster_config(KVStoreConfig()))
    keys = []
    try:
        for job in jobs:
            ns = cpu_namespace(job["checkpoint"], job["block_size"], job.get("salt"),
                               tensor_parallel_size=job.get("tensor_parallel_size", 1),
                               shard=job.get("shard", 0),
                               kv_cache_dtype=job.get("kv_cache_dtype", "auto"))
            if job.get("held"):
                found = store.lookup_prefix(ns, BlockHasher(ns).block_keys(job["tokens"]))
                keys.append(f"HELD {found.num_blocks}")
                continue
            key = bytes(BlockHasher(ns).block_keys(job["tokens"])[job["block"]])
            [holders] = store.view.holders([key])
            if not holders:
                raise SystemExit(f"no node holds block {job['block']} ({key.hex()[:16]})")
            client = store._client(holders[0])
            lease = client.lease([key], 10.0)
            [loc] = lease.locations
            flip_last_byte(lease.shm_path, loc.offset, loc.nbytes)
            client.release(lease.lease_id)
            keys.append(f"CORRUPTED {key.hex()}")
    finally:
        store.close()
    return keys


if __name__ == "__main__":
    for line in run(json.loads(sys.argv[1])):
        print(line, flush=True)
