"""The trace replay's simulators against brute-force references, and the trace expansion."""

from __future__ import annotations

import functools
import random

import pytest

from benchmarks.trace_sim import (
    TraceExpander,
    TraceRequest,
    simulate_belady,
    simulate_lru,
)
from kvstore.keys import BlockHasher, Namespace

NS = Namespace("trace-test", "float16", 64, 1, 1, 8)


def make_requests(seed: int, num_requests: int, num_keys: int, max_len: int
                  ) -> list[list[bytes]]:
    """Random requests over a small alphabet (repeats within a request allowed)."""
    rng = random.Random(seed)
    return [[bytes([rng.randrange(num_keys)]) for _ in range(rng.randint(1, max_len))]
            for _ in range(num_requests)]


def reference_lru(requests: list[list[bytes]], capacity: int) -> tuple[int, int, int]:
    """LRU as a plain list, most recent last: (lookups, prefix hits, block hits)."""
    cache: list[bytes] = []
    lookups = prefix_hits = block_hits = 0
    for keys in requests:
        lookups += len(keys)
        present = [k in cache for k in keys]
        run = 0
        while run < len(present) and present[run]:
            run += 1
        prefix_hits += run
        for k in keys:
            if k in cache:
                block_hits += 1
                cache.remove(k)
            cache.append(k)
            if len(cache) > capacity:
                cache.pop(0)
    return lookups, prefix_hits, block_hits


def reference_optimum(seq: list[bytes], capacity: int) -> int:
    """The most block hits any demand-paging cache of ``capacity`` gets: every eviction tried."""

    @functools.cache
    def best(pos: int, cached: frozenset[bytes]) -> int:
        if pos == len(seq):
            return 0
        key = seq[pos]
        if key in cached:
            return 1 + best(pos + 1, cached)
        if len(cached) < capacity:
            return best(pos + 1, cached | {key})
        return max(best(pos + 1, (cached - {victim}) | {key}) for victim in cached)

    return best(0, frozenset())


@pytest.mark.parametrize("capacity", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("seed", range(20))
def test_lru_matches_reference(seed: int, capacity: int) -> None:
    requests = make_requests(seed, 12, 10, 6)
    got = simulate_lru(requests, capacity)
    assert (got.num_lookups, got.prefix_hits, got.block_hits) == reference_lru(requests,
                                                                                capacity)


@pytest.mark.parametrize("capacity", [1, 2, 3])
@pytest.mark.parametrize("seed", range(30))
def test_belady_is_the_optimum(seed: int, capacity: int) -> None:
    requests = make_requests(seed, 5, 5, 3)
    seq = [k for keys in requests for k in keys]
    got = simulate_belady(requests, capacity)
    assert got.block_hits == reference_optimum(seq, capacity)
    assert got.block_hits >= simulate_lru(requests, capacity).block_hits
    assert got.prefix_hits <= got.block_hits


def test_belady_prefix_hits_follow_its_cache() -> None:
    # capacity 2: a b | a b c | a -> MIN keeps a and b, so the second request's prefix is a, b.
    requests = [[b"a", b"b"], [b"a", b"b", b"c"], [b"a"]]
    got = simulate_belady(requests, 2)
    assert (got.prefix_hits, got.block_hits) == (3, 3)
    assert simulate_lru(requests, 2).prefix_hits == 2  # LRU: c evicts a, so [a] misses


def test_zero_capacity_hits_nothing() -> None:
    requests = make_requests(0, 10, 3, 4)
    assert simulate_lru(requests, 0).block_hits == 0
    assert simulate_belady(requests, 0).block_hits == 0


def make_request(hash_ids: list[int], input_length: int | None = None) -> TraceRequest:
    return TraceRequest(0.0, 512 * len(hash_ids) if input_length is None else input_length, 1,
                        hash_ids)


def test_equal_hash_id_prefixes_give_equal_keys() -> None:
    ex = TraceExpander(NS)
    a = ex.expand(make_request([1, 2, 3]))
    b = ex.expand(make_request([1, 2, 4]))
    c = ex.expand(make_request([5, 2, 3]))
    assert len(a.keys) == 24  # 3 x 512 tokens in 64-token blocks
    assert a.keys[:16] == b.keys[:16]
    assert not set(a.keys[16:]) & set(b.keys)
    # The same hash_id after a different prefix is different content in the chain.
    assert not set(a.keys) & set(c.keys)
    assert len(set(a.keys)) == 24


def test_expansion_matches_hashing_the_tokens() -> None:
    ex = TraceExpander(NS)
    req = ex.expand(make_request([7, 8], input_length=512 + 200))  # 8 + 3 full blocks
    assert len(req.keys) == 11
    tokens = [int(t) for block in req.token_ids for t in block]
    assert req.keys == BlockHasher(NS).block_keys(tokens)
    assert req.parent_keys == [NS.root, *req.keys[:-1]]
    # A fresh expander (another process) gives the same keys: nothing depends on the memo.
    assert TraceExpander(NS).expand(make_request([7, 8], 712)).keys == req.keys


def test_expansion_never_exceeds_its_hash_ids() -> None:
    req = TraceExpander(NS).expand(make_request([3], input_length=5000))
    assert len(req.keys) == 8
