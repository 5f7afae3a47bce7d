"""The planting attack against real store nodes (gRPC Put, same-node shm and remote bulk reads),
with the engine on top: two StoreServers holding the cluster's data key, an in-memory index,
ClusterStore clients; no Ray.

The node rebuilds each writer's namespace with its data key, so a Put whose blocks carry the
public root or a tag that is not the tenant's MAC is refused before it is stored, and blocks
forged straight into an arena (bypassing the node) are refused by every reader. The victim's
outputs equal the same engine run with the cache bypassed.
"""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvstore.api import BlockPut, FetchedBlock, Miss, NodeAddress
from kvstore.client.cluster_store import ClusterStore
from kvstore.client.local_store import LocalStore
from kvstore.config import ClientConfig, ServerConfig
from kvstore.errors import KVStoreError
from kvstore.index.base import IndexEntry
from kvstore.index.memory import InMemoryIndex
from kvstore.keys import BlockHasher, Namespace
from kvstore.node.block_pool import BlockPool
from kvstore.node.store_server import StoreServer
from kvstore.security.data_keys import block_tag, tenant_key
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import load_model
from tests.workers.engine.test_poisoning_engine import (
    BS,
    DATA_KEY,
    SAMPLING,
    SYSTEM,
    config,
    fake_kv,
    forged_block,
    prompt,
)

FAST = ClientConfig(timeout_s=10, retries=1)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=0)


@pytest.fixture
def cluster():
    index = InMemoryIndex()
    nodes: dict[str, tuple[StoreServer, BlockPool]] = {}
    directory: dict[str, NodeAddress] = {}
    for node_id in ("node-a", "node-b"):
        pool = BlockPool(32 << 20)
        srv = StoreServer(pool, node_id, ServerConfig(), on_publish=index.publish,
                          data_key=DATA_KEY)
        srv.start()
        grpc_addr, bulk_addr = srv.addresses
        nodes[node_id] = (srv, pool)
        directory[node_id] = NodeAddress(node_id, grpc_addr, bulk_addr, pool.path)
    stores: list[ClusterStore] = []

    def store(node_id: str) -> ClusterStore:
        s = ClusterStore(node_id, index, directory.__getitem__, FAST)
        stores.append(s)
        return s

    yield index, nodes, store
    for s in stores:
        s.close()
    for srv, pool in nodes.values():
        srv.stop(0)
        pool.close()


def no_cache(model, tokens: list[int]) -> list[int]:
    _, dec = Engine(model, LocalStore(), config()).generate(tokens, sampling=SAMPLING,
                                                            use_cache=False)
    return dec.output_token_ids


def test_the_node_refuses_a_public_root_put_and_the_victim_matches_no_cache(model, cluster):
    _, _, store = cluster
    attacker = store("node-a")
    tokens = prompt(seed=11)
    public = Engine(model, None, config()).namespace  # the old, precomputable namespace
    keys = BlockHasher(public).block_keys(tokens[:SYSTEM])
    puts = [BlockPut(k, keys[i - 1] if i else public.root, tokens[i * BS:(i + 1) * BS],
                     fake_kv(public, i)) for i, k in enumerate(keys)]
    with pytest.raises(KVStoreError):
        attacker.batch_put(public, puts)
    assert attacker.lookup_prefix(public, keys).num_blocks == 0
    for reader in ("node-a", "node-b"):
        pre, dec = Engine(model, store(reader), config(), data_key=DATA_KEY).generate(
            tokens, sampling=SAMPLING)
        assert dec.output_token_ids == no_cache(model, tokens)
    assert pre.cached_tokens > 0  # the second victim reused the first one's honest blocks


@pytest.mark.parametrize("forgery", ["xxh3", "tenant-b-mac", "zero-tag"])
def test_forged_puts_under_the_victims_keys_are_refused(model, cluster, forgery):
    """The attacker knows the victim's keys and tokens, not its tenant key, and Puts forged
    blocks through the node (one message per block, and a batch message): refused, nothing
    stored, and the victim's own blocks then publish and serve normally."""
    _, nodes, store = cluster
    attacker = store("node-a")
    tokens = prompt(seed=12)
    ns = Engine(model, None, config(), data_key=DATA_KEY).namespace
    keys = BlockHasher(ns).block_keys(tokens[:SYSTEM])
    b_mac = Namespace(**ns.to_dict(), tenant_key=tenant_key(DATA_KEY, "tenant-b")).mac_key
    assert b_mac is not None
    blocks = []
    for i, k in enumerate(keys):
        fake = fake_kv(ns, i)
        raw = fake.contiguous().view(torch.uint8).numpy().tobytes()
        tag = {"xxh3": xxhash.xxh3_64_digest(raw),
               "tenant-b-mac": block_tag(b_mac, ns.root, k, raw),
               "zero-tag": bytes(16)}[forgery]
        blocks.append((k, bytes(forged_block(ns, k, keys[i - 1] if i else ns.root,
                                             tokens[i * BS:(i + 1) * BS], fake, tag))))
    client = attacker._client("node-a")
    for one in ([blocks[0]], blocks):  # one block, then a batch message
        with pytest.raises(KVStoreError):
            client.put_blocks(ns, one)
    _, pool = nodes["node-a"]
    assert not any(pool.contains(k) for k in keys)
    assert attacker.lookup_prefix(ns, keys).num_blocks == 0
    pre, dec = Engine(model, attacker, config(), data_key=DATA_KEY).generate(
        tokens, sampling=SAMPLING)
    assert pre.cached_tokens == 0 and pre.num_published_blocks == 5
    assert dec.output_token_ids == no_cache(model, tokens)
    again, dec2 = Engine(model, store("node-b"), config(), data_key=DATA_KEY).generate(
        tokens, sampling=SAMPLING)
    assert again.cached_tokens > 0 and dec2.output_token_ids == dec.output_token_ids


@pytest.mark.parametrize("reader", ["node-a", "node-b"], ids=["same-node", "remote"])
def test_blocks_forged_straight_into_an_arena_are_misses(model, cluster, reader):
    """Bypassing the node: forged bytes under the victim's exact keys put into node-a's pool
    and published to the index; the victim reading over shm (node-a) or bulk (node-b)
    rejects them and recomputes."""
    index, nodes, store = cluster
    _, pool = nodes["node-a"]
    tokens = prompt(seed=13)
    ns = Engine(model, None, config(), data_key=DATA_KEY).namespace
    keys = BlockHasher(ns).block_keys(tokens[:SYSTEM])
    entries = []
    for i, k in enumerate(keys):
        fake = fake_kv(ns, i)
        raw = fake.contiguous().view(torch.uint8).numpy().tobytes()
        block = forged_block(ns, k, keys[i - 1] if i else ns.root, tokens[i * BS:(i + 1) * BS],
                             fake, xxhash.xxh3_64_digest(raw) + bytes(8))
        assert pool.put(k, bytes(block))
        entries.append(IndexEntry(k, "node-a", len(block), keys[i - 1] if i else ns.root,
                                  ns.root))
    index.publish(entries)
    victim_store = store(reader)
    assert victim_store.lookup_prefix(ns, keys).num_blocks == len(keys)
    got = victim_store.batch_get(ns, keys, [tokens[i * BS:(i + 1) * BS]
                                            for i in range(len(keys))])
    assert all(isinstance(g, Miss) for g in got), got
    assert not any(isinstance(g, FetchedBlock) for g in got)
    pre, dec = Engine(model, victim_store, config(), data_key=DATA_KEY).generate(
        tokens, sampling=SAMPLING)
    assert pre.cached_tokens == 0
    assert dec.output_token_ids == no_cache(model, tokens)
