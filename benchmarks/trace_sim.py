"""Mooncake-format traces expanded into block keys, and the cache simulators they are judged by.

A trace line is ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``; each
hash_id stands for 512 tokens and equal ids mean equal prefix content. ``TraceExpander`` turns a
request into the chained keys of its full 64-token blocks: hash_id ``h`` becomes 512 tokens drawn
from ``shake_128(h)``, so equal hash_id prefixes give equal tokens and so equal keys, and the
chain (each key hashes its parent) makes two requests share a key only if they share everything
before it.

The simulators replay the same key sequence against a cache of ``capacity`` blocks:

* ``simulate_lru``: an exact LRU. Per request it counts the *prefix* hits (the leading run of
  keys in the cache as the request finds it: all a prefix lookup can use, as the store's
  ``lookup_prefix``), then accesses every key in order (a hit moves it to the front, a miss
  inserts it and evicts the least recently used), which is what lookup + get + put do to the
  store's recency; ``block_hits`` counts the hits of those accesses.
* ``simulate_belady``: Belady's MIN on the flattened sequence (demand paging: every accessed
  key is cached, evicting the one whose next use is furthest away). MIN maximises per-block
  hits, and prefix hits never exceed per-block hits, so its per-block hit rate bounds what any
  policy could serve.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.keys import BlockHasher, Namespace

#: Tokens one Mooncake hash_id stands for.
TOKENS_PER_HASH_ID = 512
#: Vocabulary the synthetic tokens are drawn from (a Llama-sized one).
VOCAB_SIZE = 32000


@dataclass(slots=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(slots=True)
class ExpandedRequest:
    """A request's full blocks: chained keys, their parents and their token ids."""

    keys: list[bytes]
    parent_keys: list[bytes]
    token_ids: list[np.ndarray]  # one int64 array of block_size tokens per key


@dataclass(slots=True)
class SimResult:
    """What a simulated cache served: blocks looked up, prefix hits and per-block hits."""

    num_lookups: int
    prefix_hits: int
    block_hits: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.num_lookups if self.num_lookups else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.block_hits / self.num_lookups if self.num_lookups else 0.0


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of a JSON-lines trace (all of them with None)."""
    requests: list[TraceRequest] = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            requests.append(TraceRequest(float(row["timestamp"]), int(row["input_length"]),
                                         int(row.get("output_length", 0)),
                                         [int(h) for h in row["hash_ids"]]))
    return requests


def hash_id_tokens(hash_id: int) -> np.ndarray:
    """The 512 tokens hash_id ``hash_id`` stands for: the same on every machine and run."""
    raw = hashlib.shake_128(hash_id.to_bytes(8, "little", signed=True)).digest(
        4 * TOKENS_PER_HASH_ID)
    return (np.frombuffer(raw, dtype="<u4") % VOCAB_SIZE).astype(np.int64)


class TraceExpander:
    """Keys and tokens of requests' full blocks, each (parent, hash_id) chunk hashed once."""

    def __init__(self, namespace: Namespace) -> None:
        if TOKENS_PER_HASH_ID % namespace.block_size:
            raise ValueError(f"block_size {namespace.block_size} must divide "
                             f"{TOKENS_PER_HASH_ID}, the tokens of one hash_id")
        self.namespace = namespace
        self._hasher = BlockHasher(namespace)
        self._tokens: dict[int, list[np.ndarray]] = {}
        # Keys depend on everything before them: memoise by (parent key, hash_id).
        self._chunks: dict[tuple[bytes, int], list[bytes]] = {}

    def _block_tokens(self, hash_id: int) -> list[np.ndarray]:
        blocks = self._tokens.get(hash_id)
        if blocks is None:
            tokens = hash_id_tokens(hash_id)
            bs = self.namespace.block_size
            blocks = [tokens[i : i + bs] for i in range(0, TOKENS_PER_HASH_ID, bs)]
            self._tokens[hash_id] = blocks
        return blocks

    def expand(self, request: TraceRequest) -> ExpandedRequest:
        """The request's full blocks: ``input_length // block_size`` of them at most, never
        more than its hash_ids cover (a partial tail block gets no key, as in the store)."""
        bs = self.namespace.block_size
        per_id = TOKENS_PER_HASH_ID // bs
        num_blocks = min(request.input_length // bs, len(request.hash_ids) * per_id)
        keys: list[bytes] = []
        parents: list[bytes] = []
        tokens: list[np.ndarray] = []
        parent = self.namespace.root
        for hash_id in request.hash_ids:
            if len(keys) >= num_blocks:
                break
            chunk = self._chunks.get((parent, hash_id))
            blocks = self._block_tokens(hash_id)
            if chunk is None:
                chunk = list(self._hasher.block_keys(np.concatenate(blocks), parent=parent))
                self._chunks[(parent, hash_id)] = chunk
            take = min(per_id, num_blocks - len(keys))
            parents.extend([parent, *chunk[: take - 1]])
            keys.extend(chunk[:take])
            tokens.extend(blocks[:take])
            parent = chunk[-1]
        return ExpandedRequest(keys, parents, tokens)


def simulate_lru(requests: Sequence[Sequence[bytes]], capacity: int) -> SimResult:
    """An exact LRU of ``capacity`` blocks over requests' key sequences (see module doc)."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    lookups = prefix_hits = block_hits = 0
    for keys in requests:
        lookups += len(keys)
        in_prefix = True
        for key in keys:  # the cache as the request finds it
            in_prefix = in_prefix and key in cache
            prefix_hits += in_prefix
        for key in keys:
            if key in cache:
                block_hits += 1
                cache.move_to_end(key)
            elif capacity > 0:
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return SimResult(lookups, prefix_hits, block_hits)


def simulate_belady(requests: Sequence[Sequence[bytes]], capacity: int) -> SimResult:
    """Belady's MIN of ``capacity`` blocks on the flattened key sequence (see module doc).

    ``prefix_hits`` counts, per request, the leading run of keys MIN's cache held when the
    request arrived: what a prefix lookup against MIN's cache would have served.
    """
    seq = [key for keys in requests for key in keys]
    never = len(seq)
    next_use = [never] * len(seq)
    seen: dict[bytes, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = seen.get(seq[i], never)
        seen[seq[i]] = i
    cached: dict[bytes, int] = {}  # key -> position of its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, key); stale entries skipped on pop
    lookups = prefix_hits = block_hits = 0
    pos = 0
    for keys in requests:
        lookups += len(keys)
        in_prefix = True
        for key in keys:  # the cache as the request finds it
            in_prefix = in_prefix and key in cached
            prefix_hits += in_prefix
        for key in keys:
            nu = next_use[pos]
            pos += 1
            if key in cached:
                block_hits += 1
            elif capacity <= 0:
                continue
            elif len(cached) >= capacity:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if cached.get(victim) == -neg:
                        del cached[victim]
                        break
            cached[key] = nu
            heapq.heappush(heap, (-nu, key))
    return SimResult(lookups, prefix_hits, block_hits)
