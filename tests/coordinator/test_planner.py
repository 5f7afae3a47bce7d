"""The fast eviction planner against a copy of the previous (sort-everything) algorithm."""

from __future__ import annotations

import hashlib
import heapq
import random
from collections.abc import Sequence

import numpy as np
import pytest

from kvstore.constants import PIN_HARD, PIN_NONE, PIN_SOFT
from kvstore.coordinator.lru import LRUTable
from kvstore.coordinator.planner import plan_evictions


def reference_plan_evictions(table: LRUTable, node: int, nbytes_to_free: int,
                             exclude: Sequence[bytes] = ()) -> list[bytes]:
    """The planner without the prefix pass (one heap over every held block): the reference."""
    if nbytes_to_free <= 0:
        return []
    held = table._slots_of(node)
    if not held.size:
        return []
    eligible = table.pin[held] != PIN_HARD
    if exclude:
        skip = table.lookup(exclude)
        eligible &= ~np.isin(held, skip[skip >= 0])
    fps = table.keys[held, 0]
    order = np.argsort(fps, kind="stable")
    sorted_fps = fps[order]
    parents = table.parent[held, 0]
    pidx = np.minimum(np.searchsorted(sorted_fps, parents), sorted_fps.size - 1)
    has_parent = sorted_fps[pidx] == parents
    parent_pos = np.full(held.size, -1, dtype=np.int64)
    parent_pos[has_parent] = order[pidx[has_parent]]
    children = np.bincount(parent_pos[has_parent], minlength=held.size)
    soft = table.pin[held] == PIN_SOFT
    last = table.last_use[held]
    sizes = table.nbytes[held]
    ready = np.flatnonzero((children == 0) & eligible)
    heap = list(zip(soft[ready].tolist(), last[ready].tolist(), ready.tolist(), strict=True))
    heapq.heapify(heap)
    chosen: list[int] = []
    freed = 0
    while heap and freed < nbytes_to_free:
        _, _, i = heapq.heappop(heap)
        chosen.append(i)
        freed += int(sizes[i])
        p = int(parent_pos[i])
        if p >= 0:
            children[p] -= 1
            if children[p] == 0 and eligible[p]:
                heapq.heappush(heap, (bool(soft[p]), int(last[p]), p))
    return table.key_of(held[np.asarray(chosen, dtype=np.int64)]) if chosen else []


def _key(rng: random.Random) -> bytes:
    return rng.randbytes(32)


def _random_table(seed: int) -> tuple[LRUTable, list[bytes], int]:
    """Chains (some branching off shared parents) on several nodes, pins, touches, removals
    and re-adds (stale and repeated per-node slot entries), a few fingerprint collisions and
    equal last uses."""
    rng = random.Random(seed)
    table = LRUTable(initial_capacity=64)
    nodes = rng.randint(1, 4)
    all_keys: list[bytes] = []
    roots = [_key(rng) for _ in range(rng.randint(1, 5))]
    for _ in range(rng.randint(5, 40)):
        # a new chain from a root, or a branch off an existing block (shared parent)
        parent = rng.choice(all_keys) if all_keys and rng.random() < 0.4 else rng.choice(roots)
        chain = []
        for _ in range(rng.randint(1, 60)):
            if all_keys and rng.random() < 0.02:  # same fingerprint as another block
                k = rng.choice(all_keys)[:8] + rng.randbytes(24)
            else:
                k = _key(rng)
            chain.append(k)
        parents = [parent, *chain[:-1]]
        for node in rng.sample(range(nodes), rng.randint(1, nodes)):
            lo = rng.randint(0, len(chain) - 1) if rng.random() < 0.3 else 0
            sizes = [rng.choice([1, 4, 16, 100, rng.randint(1, 500)]) for _ in chain[lo:]]
            table.add(node, chain[lo:], parents[lo:], sizes)
        all_keys += chain
    for _ in range(rng.randint(0, 6)):  # reads: touch chain prefixes and random blocks
        table.touch(rng.sample(all_keys, rng.randint(1, min(50, len(all_keys)))))
    for _ in range(rng.randint(0, 4)):  # churn: evicted, some published again
        node = rng.randrange(nodes)
        gone = rng.sample(all_keys, rng.randint(1, min(40, len(all_keys))))
        table.remove(node, gone)
        back = [k for k in gone if rng.random() < 0.5]
        if back:
            table.add(node, back, [rng.choice(all_keys) for _ in back], [10] * len(back))
    known = [k for k in all_keys if table.lookup([k])[0] >= 0]
    if known:
        for k in rng.sample(known, rng.randint(0, min(10, len(known)))):
            table.set_pin([k], rng.choice([PIN_SOFT, PIN_HARD, PIN_NONE]))
        if rng.random() < 0.3:  # equal last uses: the slot breaks the tie
            slots = table.lookup(rng.sample(known, min(20, len(known))))
            table.last_use[slots] = int(table.last_use[slots].min())
    return table, known, nodes


@pytest.mark.parametrize("seed", range(150))
def test_plan_matches_the_previous_planner(seed: int) -> None:
    table, known, nodes = _random_table(seed)
    rng = random.Random(seed + 10_000)
    for node in range(nodes + 1):  # plus a node that holds nothing
        total = int(table.nbytes[table._slots_of(node)].sum())
        for need in (0, 1, 50, total // 50, total // 10, total // 2, total, total + 1):
            exclude = rng.sample(known, rng.randint(0, min(30, len(known)))) if known else []
            for skip in ([], exclude):
                want = reference_plan_evictions(table, node, need, skip)
                assert plan_evictions(table, node, need, skip) == want, (seed, node, need)
                assert table.plan(node, need, skip) == want


@pytest.mark.parametrize("seed", range(3))
def test_large_node_with_long_chains_matches(seed: int) -> None:
    """~20k blocks in chains of ~200, interleaved reads: the prefix pass and its growth."""
    rng = random.Random(seed)
    table = LRUTable()
    chains = []
    for c in range(100):
        root = hashlib.sha256(bytes([seed, c])).digest()
        chain = [rng.randbytes(32) for _ in range(rng.randint(150, 250))]
        table.add(c % 2, chain, [root, *chain[:-1]], [rng.choice([4096, 8192])] * len(chain))
        chains.append(chain)
    for _ in range(50):  # a read touches a chain prefix in order: parents older than children
        chain = rng.choice(chains)
        table.touch(chain[: rng.randint(1, len(chain))])
    table.set_pin(rng.sample(chains[0], 5), PIN_HARD)
    table.set_pin(rng.sample([k for c in chains for k in c], 300), PIN_SOFT)
    for node in (0, 1):
        total = int(table.nbytes[table._slots_of(node)].sum())
        for frac in (0.001, 0.02, 0.1, 0.5, 0.97):
            need = int(total * frac)
            assert plan_evictions(table, node, need) == reference_plan_evictions(table, node,
                                                                                  need)
        ordered = table.plan(node, total // 20)
        table.remove(node, ordered[: len(ordered) // 2])  # half done: the rest excluded
        rest = ordered[len(ordered) // 2:]
        assert plan_evictions(table, node, total // 20, rest) == reference_plan_evictions(
            table, node, total // 20, rest)


def test_held_slots_is_exact_after_churn() -> None:
    rng = random.Random(7)
    table = LRUTable(initial_capacity=16)
    keys = [rng.randbytes(32) for _ in range(500)]
    for _ in range(200):
        node = rng.randrange(3)
        batch = rng.sample(keys, rng.randint(1, 40))
        if rng.random() < 0.6:
            table.add(node, batch, [None] * len(batch), [1] * len(batch))
        else:
            table.remove(node, batch)
        for n in range(3):
            fast = table._slots_of(n, ordered=False)
            assert len(set(fast.tolist())) == fast.size
            assert sorted(fast.tolist()) == table._slots_of(n).tolist()
