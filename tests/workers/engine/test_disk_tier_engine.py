"""The engine over a real store node with a disk tier (``StoreServer`` on a ``TieredPool``,
real block files, gRPC leases, same-node shared memory; an in-memory index, no Ray): a shared
prompt's blocks demoted to disk serve a warm request, and a file corrupted, truncated or
replaced by another block's file is a miss and a recompute whose output equals the same engine
run with the cache bypassed (``use_cache=False``, the ``--no-cache`` path), in an unkeyed
namespace (the xxh3 checksum catches it) and a keyed one (the node checks the tenant's MAC
when it promotes for the reader's namespace)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvstore.api import NodeAddress
from kvstore.client.cluster_store import ClusterStore
from kvstore.config import ClientConfig, ServerConfig, WorkerConfig
from kvstore.index.memory import InMemoryIndex
from kvstore.keys import BlockHasher
from kvstore.node.block_pool import BlockPool
from kvstore.node.disk_tier import DiskTier
from kvstore.node.store_server import StoreServer
from kvstore.node.tiered_pool import TieredPool
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.sampling import SamplingParams

BS = 16
SHARED = 96  # tokens of the shared prompt: 6 blocks
SAMPLING = SamplingParams(max_new_tokens=8)
DATA_KEY = b"disk-tier-engine-tests-data-key!"


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=0)


def config() -> WorkerConfig:
    return WorkerConfig(model="tiny", block_size=BS, prefill_chunk_tokens=32)


def prompt(seed: int) -> list[int]:
    """The shared prompt, then a suffix of the request's own (shorter than a block)."""
    shared = torch.randint(0, 512, (SHARED,), generator=torch.Generator().manual_seed(7))
    own = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(seed))
    return shared.tolist() + own.tolist()


@dataclass
class Node:
    pool: TieredPool
    store: ClusterStore
    data_key: bytes | None


@pytest.fixture(params=[None, DATA_KEY], ids=["unkeyed", "keyed"])
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Node]:
    data_key = request.param
    pool = TieredPool(BlockPool(8 << 20), DiskTier(str(tmp_path / "disk"), 64 << 20,
                                                   data_key=data_key), queue_bytes=16 << 20)
    index = InMemoryIndex()
    server = StoreServer(pool, "node-a", ServerConfig(), on_publish=index.publish,
                         data_key=data_key)
    server.start()
    grpc_addr, bulk_addr = server.addresses
    address = NodeAddress("node-a", grpc_addr, bulk_addr, pool.path)
    store = ClusterStore("node-a", index, lambda _: address, ClientConfig(timeout_s=10,
                                                                          retries=1))
    try:
        yield Node(pool, store, data_key)
    finally:
        store.close()
        server.stop(0)
        pool.close(purge=True)


def engine(model, node: Node) -> Engine:
    return Engine(model, node.store, config(), data_key=node.data_key)


def no_cache(model, tokens: list[int]) -> list[int]:
    _, dec = Engine(model, None, config()).generate(tokens, sampling=SAMPLING, use_cache=False)
    return dec.output_token_ids


def publish_then_demote(model, node: Node) -> list[bytes]:
    """A first request publishes the shared prompt; then every block goes to disk."""
    eng = engine(model, node)
    eng.generate(prompt(seed=1), sampling=SAMPLING, request_id="cold")
    eng.wait_published()
    keys = BlockHasher(eng.namespace).block_keys(prompt(seed=1)[:SHARED])
    node.pool.demote(node.pool.arena.keys())
    assert node.pool.flush()
    assert node.pool.arena.held(keys) == [False] * len(keys)
    assert node.pool.disk.held(keys) == [True] * len(keys)
    return [bytes(k) for k in keys]


def test_blocks_only_on_disk_serve_a_warm_request(model, node: Node) -> None:
    publish_then_demote(model, node)
    tokens = prompt(seed=2)
    pre, dec = engine(model, node).generate(tokens, sampling=SAMPLING, request_id="warm")
    assert pre.cached_tokens == SHARED  # all of it, promoted from the files
    assert node.pool.counters.promotions >= SHARED // BS
    assert dec.output_token_ids == no_cache(model, tokens)


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_a_damaged_file_is_a_miss_and_a_recompute(model, node: Node, damage: str) -> None:
    keys = publish_then_demote(model, node)
    victim = Path(node.pool.disk.path_of(keys[2]))
    raw = bytearray(victim.read_bytes())
    if damage == "flip":
        raw[-9] ^= 0x20  # in the payload: the checksum (or the reader's MAC) catches it
        victim.write_bytes(raw)
    elif damage == "truncate":
        victim.write_bytes(raw[: len(raw) // 3])
    else:  # another block's whole, valid file under this key's name
        victim.write_bytes(Path(node.pool.disk.path_of(keys[3])).read_bytes())
    tokens = prompt(seed=3)
    pre, dec = engine(model, node).generate(tokens, sampling=SAMPLING, request_id="warm")
    assert dec.output_token_ids == no_cache(model, tokens)  # never wrong KV, never an error
    assert pre.cached_tokens == 2 * BS  # the blocks before the damaged one, then recompute
    # The node saw it (in a keyed namespace by the tenant's MAC, checked on promotion in the
    # reader's namespace): dropped, counted, the file gone, never promoted into the arena.
    assert node.pool.counters.drops == {"corrupted": 1}
    assert node.pool.counters.promotions == SHARED // BS - 1  # all but the damaged one
