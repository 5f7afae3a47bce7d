"""Synchronous loads on a spare core, against real store nodes: blocks a lookup leased are
written from the node's arena layer by layer, bitwise what another instance saved; a block
damaged in the arena is caught once written and becomes a load error (vLLM recomputes it);
blocks without a lease are fetched the usual way on the same thread; every lease ends."""

# ruff: noqa: F811  (the cluster fixture is imported, then named as a test argument)
from __future__ import annotations

import dataclasses
import os
import pickle

import pytest
import torch

from kvstore.client.cluster_store import ClusterStore
from kvstore.integrations.vllm.namespace import weights_fingerprint
from kvstore.integrations.vllm.plans import BlockTransfer, StepPlan
from kvstore.integrations.vllm.spare_core import (
    SpareCoreLoader,
    SpareCoreStep,
    forward_cores,
    spare_cores,
)
from kvstore.integrations.vllm.worker_side import WorkerSide
from kvstore.keys import BlockHasher, Namespace
from tests.client.test_cluster_store import FAST, cluster  # noqa: F401 - fixture
from tests.client.test_held_leases import no_leases_left
from tests.support.arena import corrupt_in_arena

BS, H, D, L, NB = 4, 2, 8, 3, 8


def ns(salt: str, weights: str = "") -> Namespace:
    return Namespace(weights_fingerprint("f" * 64, weights), "float32", BS, L, H, D, salt)


def caches() -> dict[str, torch.Tensor]:  # the CPU backend's layout, one tensor per layer
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NB, H, BS, 2 * D) for i in range(L)}


def transfer(tokens: list[int], block_ids: list[int]) -> BlockTransfer:
    keys = [bytes(k) for k in BlockHasher(ns("")).block_keys(tokens)]
    return BlockTransfer("r", "", keys, [ns("").root, *keys[:-1]],
                         [tokens[i * BS:(i + 1) * BS] for i in range(len(keys))], block_ids)


def forward(worker: WorkerSide) -> None:
    for i in range(L):
        worker.wait_for_layer(f"model.layers.{i}.self_attn.attn")
    worker.finish_loads()


def any_core() -> set[int]:
    return {min(os.sched_getaffinity(0))}


def publish(cluster, tokens: list[int]) -> dict[str, torch.Tensor]:  # noqa: ANN001
    index, _, directory = cluster
    src = caches()
    writer = WorkerSide(ClusterStore("node-a", index, directory.__getitem__, FAST), ns, H, D)
    writer.register(src)
    writer.save(StepPlan(saves=[transfer(tokens, list(range(len(tokens) // BS)))]))
    writer.close()
    return src


def reader(cluster) -> tuple[WorkerSide, ClusterStore, dict[str, torch.Tensor]]:  # noqa: ANN001
    index, _, directory = cluster
    store = ClusterStore("node-a", index, directory.__getitem__, FAST)
    worker = WorkerSide(store, ns, H, D, layerwise=True)
    worker._spare = SpareCoreLoader(any_core())  # what register finds on a pinned forward
    dst = caches()
    worker.register(dst)
    return worker, store, dst


def leased(store: ClusterStore, t: BlockTransfer) -> BlockTransfer:
    hit, t.lease = store.lease_prefix(ns(""), t.keys)  # the scheduler's lookup
    assert hit.num_blocks == len(t.keys) and t.lease is not None
    return t


def test_spare_cores_are_those_the_calling_thread_may_not_use() -> None:
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, any_core())  # as vLLM pins its forward
        spare = spare_cores()
    finally:
        os.sched_setaffinity(0, mine)
    assert mine - any_core() <= spare and not spare & any_core()
    assert not spare_cores() & mine  # a forward free to run anywhere leaves nothing spare


def test_other_ranks_forward_cores_are_never_spare() -> None:
    """Under tensor parallelism each rank's forward is bound to its own cores: another
    rank's are no loader's; where vLLM binds ranks itself, which cores are whose is unknown,
    and no core is spare."""
    assert forward_cores(2, "0-3|4,6-7") == frozenset({0, 1, 2, 3, 4, 6, 7})
    assert forward_cores(1, "0") == frozenset({0})
    assert forward_cores(1, "auto") == frozenset() and forward_cores(2, "auto") is None
    assert forward_cores(2, "nobind") is None
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, any_core())
        others = frozenset((mine | set(range(os.cpu_count() or 1))) - any_core())
        assert spare_cores(others) == set() and spare_cores(None) == set()
    finally:
        os.sched_setaffinity(0, mine)


def test_leased_blocks_load_from_the_arena_bitwise_without_a_fetch(cluster) -> None:
    tokens = list(range(4 * BS))
    src = publish(cluster, tokens)
    worker, store, dst = reader(cluster)
    fetched: list[object] = []
    worker._fetch_step = lambda ts, out=None: fetched.append(ts) or []  # type: ignore[method-assign]
    # Blocks 0..3 of the prompt into vLLM blocks 5, 6, 7 (one run) and 1, the plan pickled
    # as it crosses from vLLM's scheduler process to its worker.
    plan = StepPlan(loads=[leased(store, transfer(tokens, [5, 6, 7, 1]))])
    assert pickle.loads(pickle.dumps(plan)) == plan
    worker.load(pickle.loads(pickle.dumps(plan)))
    assert isinstance(worker._step, SpareCoreStep)
    forward(worker)
    assert worker.load_errors() == set() and fetched == [] and worker.loaded_blocks == 4
    for name in src:
        for block, target in zip(range(4), [5, 6, 7, 1], strict=True):
            assert torch.equal(dst[name][target], src[name][block])
    assert no_leases_left(cluster[1]["node-a"][1])
    worker.close()
    store.close()


def test_a_block_damaged_in_the_arena_is_a_load_error_from_it_on(cluster) -> None:
    tokens = list(range(100, 100 + 3 * BS))
    publish(cluster, tokens)
    t = transfer(tokens, [2, 3, 4])
    corrupt_in_arena(cluster[1]["node-a"][1], t.keys[1])
    worker, store, _ = reader(cluster)
    worker.load(StepPlan(loads=[leased(store, t)]))
    forward(worker)
    assert worker.load_errors() == {3, 4}  # vLLM recomputes from the damaged block on
    assert worker.layerwise  # a damaged block is no reason to stop loading under the forward
    assert no_leases_left(cluster[1]["node-a"][1])
    worker.close()
    store.close()


def test_registering_maps_the_arena_on_the_spare_core(cluster) -> None:
    worker, store, _ = reader(cluster)
    populator = store._client("node-a")._shm._populator  # started by register
    populator.join(timeout=60)
    assert populator.cores == any_core() and populator.done
    assert populator.mapped == store._client("node-a")._shm.size
    worker.close()
    store.close()


@pytest.mark.parametrize("lease", ["none", "stale"])
def test_blocks_without_a_fresh_lease_are_fetched_on_the_spare_core(cluster, lease: str
                                                                     ) -> None:
    tokens = list(range(200, 200 + 2 * BS))
    src = publish(cluster, tokens)
    worker, store, dst = reader(cluster)
    t = transfer(tokens, [0, 4])
    if lease == "stale":
        leased(store, t).lease.granted_at -= store.lease_ttl_s  # type: ignore[union-attr]
    worker.load(StepPlan(loads=[t]))
    forward(worker)
    assert worker.load_errors() == set() and worker.loaded_blocks == 2
    for name in src:
        assert torch.equal(dst[name][0], src[name][0]) and torch.equal(dst[name][4], src[name][1])
    assert no_leases_left(cluster[1]["node-a"][1])
    worker.close()
    store.close()


def test_a_block_in_another_keys_place_is_never_written(cluster) -> None:
    tokens, others = list(range(300, 300 + 2 * BS)), list(range(700, 700 + 2 * BS))
    publish(cluster, tokens)
    publish(cluster, others)
    worker, store, dst = reader(cluster)
    before = {name: c.clone() for name, c in dst.items()}
    elsewhere = leased(store, transfer(others, [0, 1])).lease
    t = leased(store, transfer(tokens, [6, 7]))
    # The lease places the prompt's first block where another prompt's lies: a whole, good
    # block whose tag matches its own payload, only not the key asked for.
    swapped = elsewhere.info.locations[0]
    t.lease.info.locations[0] = dataclasses.replace(swapped, key=t.keys[0])
    store.release_lease(elsewhere)
    worker.load(StepPlan(loads=[t]))
    forward(worker)
    assert worker.load_errors() == {6, 7}
    for name in dst:
        assert torch.equal(dst[name], before[name])
    assert no_leases_left(cluster[1]["node-a"][1])
    worker.close()
    store.close()
