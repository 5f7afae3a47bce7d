"""What the scheduler side tells the worker side each step: blocks to load and to save.

Plain data that crosses from vLLM's scheduler process to its workers (pickled with the
connector metadata). A plan names kvstore blocks by key and vLLM blocks by id; the namespace
travels as its tenant (``cache_salt``) and weights version: each side builds the same
namespace from its own ``ModelGeometry``. A load may carry the lease its lookup took on this
host's store node, so the worker reads under it instead of asking for one
(``kvstore.client.leased_reads``). Under tensor parallelism a request's blocks travel once per
KV-head slice (``shard``): each slice has its own namespace, so its own keys and lease, and each
worker takes only its slice's (``StepPlan.for_shard``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.client.leased_reads import HeldLease


@dataclass
class BlockTransfer:
    """Blocks of one request, in chain order: kvstore key, its parent key, its tokens, and the
    vLLM block that holds (save) or receives (load) its KV."""

    request_id: str
    cache_salt: str
    keys: list[bytes]
    parents: list[bytes]
    tokens: list[list[int]]
    block_ids: list[int]
    asynchronous: bool = False  # a load the request waits for outside the forward (get_finished)
    holders: list[list[str]] | None = None  # a load's holders, as the scheduler's lookup said
    lease: HeldLease | None = None  # a load's lease, taken by the scheduler's lookup
    weights: str = ""  # the weights version its keys were made under (namespace.weights_...)
    shard: int = 0  # the KV-head slice its keys name (namespace.ModelGeometry.shard_of_rank)


@dataclass
class StepPlan:
    """One step's transfers: loads before the forward, saves after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)

    def for_shard(self, shard: int, *, saves: bool = True) -> StepPlan:
        """The transfers of one KV-head slice: what a worker holding it executes; without
        ``saves`` (a rank whose slice another rank saves) its loads only."""
        return StepPlan([t for t in self.loads if t.shard == shard],
                        [t for t in self.saves if t.shard == shard] if saves else [])
