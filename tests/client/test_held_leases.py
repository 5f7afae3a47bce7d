"""A lease taken by one process's lookup and read under by another (vLLM's scheduler and its
worker): the read asks for no lease of its own, a stale one is replaced, and every lease ends
(nothing left pinned on the node)."""

# ruff: noqa: F811  (the cluster fixture is imported, then named as a test argument)
from __future__ import annotations

import pickle
import time

import torch

from kvstore.api import FetchedBlock
from kvstore.client.cluster_store import ClusterStore
from kvstore.errors import Overloaded
from tests.client.test_cluster_store import FAST, cluster, make_puts  # noqa: F401 - fixture
from tests.node.test_store_server import make_namespace


def no_leases_left(pool, within_s: float = 5.0) -> bool:  # noqa: ANN001 - a BlockPool
    """Releases go out without waiting (``release_nowait``): give them a moment."""
    deadline = time.monotonic() + within_s
    while pool._leases and time.monotonic() < deadline:
        time.sleep(0.01)
    return not pool._leases


def counting_leases(store: ClusterStore, node: str) -> list[tuple]:
    client = store._client(node)
    asked: list[tuple] = []
    real = client.lease

    def lease(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        asked.append(args)
        return real(*args, **kwargs)

    client.lease = lease  # type: ignore[method-assign]
    return asked


def on_node_a(cluster, num_blocks: int, seed: int, held: int | None = None):  # noqa: ANN001, ANN201
    """A namespace and ``num_blocks`` blocks' puts, tokens and keys, the first ``held`` of
    them (all by default) put on node-a."""
    index, _, directory = cluster
    ns = make_namespace()
    puts, tokens = make_puts(ns, num_blocks, seed=seed)
    ClusterStore("node-a", index, directory.__getitem__, FAST).batch_put(ns, puts[:held])
    return ns, puts, tokens, [p.key for p in puts]


def test_a_lookups_lease_is_read_under_and_then_ended(cluster) -> None:
    index, nodes, directory = cluster
    ns, puts, tokens, keys = on_node_a(cluster, 4, seed=11, held=3)
    looker = ClusterStore("node-a", index, directory.__getitem__, FAST)
    hit, lease = looker.lease_prefix(ns, keys)
    assert hit.num_blocks == 3 and hit.holders == [["node-a"]] * 3 and lease is not None
    assert nodes["node-a"][1]._leases  # pinned on the node until the read ends
    lease = pickle.loads(pickle.dumps(lease))  # the plan crosses vLLM's processes pickled
    reader = ClusterStore("node-a", index, directory.__getitem__, FAST)
    asked = counting_leases(reader, "node-a")
    got = reader.batch_get(ns, keys[:3], tokens[:3], held=lease)
    assert all(isinstance(g, FetchedBlock) for g in got) and asked == []
    for g, p in zip(got, puts[:3], strict=True):
        assert torch.equal(g.payload.view(torch.int16), p.payload.view(torch.int16))
    assert no_leases_left(nodes["node-a"][1])
    looker.close()
    reader.close()


def test_a_stale_lease_is_replaced_and_an_unused_one_released(cluster) -> None:
    index, nodes, directory = cluster
    ns, _, tokens, keys = on_node_a(cluster, 2, seed=12)
    store = ClusterStore("node-a", index, directory.__getitem__, FAST)
    _, lease = store.lease_prefix(ns, keys)
    assert lease is not None
    lease.granted_at -= store.lease_ttl_s / 2  # older than a third of its TTL
    asked = counting_leases(store, "node-a")
    got = store.batch_get(ns, keys, tokens, held=lease)
    assert all(isinstance(g, FetchedBlock) for g in got) and len(asked) == 1
    _, unused = store.lease_prefix(ns, keys)
    assert unused is not None
    store.release_lease(unused)
    assert no_leases_left(nodes["node-a"][1])
    _, none = store.lease_prefix(ns, [bytes(32)])  # held nowhere: no lease, none left open
    assert none is None and no_leases_left(nodes["node-a"][1])
    store.close()


def test_a_remote_reader_gets_no_lease_and_the_index_answers(cluster) -> None:
    index, nodes, directory = cluster
    ns, _, _, keys = on_node_a(cluster, 2, seed=13)
    hit, lease = ClusterStore("node-b", index, directory.__getitem__, FAST).lease_prefix(ns, keys)
    assert hit.num_blocks == 2 and hit.holders == [["node-a"]] * 2 and lease is None
    assert no_leases_left(nodes["node-a"][1])


def test_a_node_at_its_lease_limit_answers_the_lookup_without_a_lease_and_at_once(
        cluster) -> None:
    """A refused lease is asked once, never retried inside a lookup (vLLM's scheduler would
    stall on gRPC's busy retries for up to ``client.timeout_s``): the yes/no lookup answers."""
    index, nodes, directory = cluster
    ns, _, _, keys = on_node_a(cluster, 2, seed=14)
    refusals = []

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        refusals.append(args)
        raise Overloaded("the node holds as many leases as it allows")

    nodes["node-a"][1].lease = refuse  # as LeaseTable.check_room refuses a credential
    store = ClusterStore("node-a", index, directory.__getitem__, FAST)
    hit, lease = store.lease_prefix(ns, keys)
    assert hit.num_blocks == 2 and lease is None and len(refusals) == 1
    store.close()
