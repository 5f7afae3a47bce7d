"""The connector's worker side: fetched blocks into vLLM's paged KV, computed blocks out of it.

Loads run before the forward that needs them (``start_load_kv``): the blocks are fetched and
verified by the store (``batch_get``), then written with ``kv_cache_scatter``. Only a leading
run of verified blocks is written; every vLLM block of the plan from the first miss on (a
corrupted block, a dead holder, a cluster that went away) is reported as a load error, so vLLM
recomputes those tokens and the request never sees wrong KV. Saves gather the plan's blocks with
``paged_cache_load`` after the forward that completed them (``wait_for_save``, before vLLM can
reuse the memory) and put them from a background thread, off the forward path; ``close`` waits
for the puts still queued.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvstore.api import BlockPut, FetchedBlock
from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.paged_layout import (
    LayerCache,
    gather_blocks,
    layer_cache,
    scatter_blocks,
)
from kvstore.integrations.vllm.plans import BlockTransfer, StepPlan
from kvstore.keys import Namespace

log = logging.getLogger(__name__)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_order(name: str) -> tuple[int, str]:
    """Sort key of a vLLM attention layer name (``model.layers.12.self_attn.attn``)."""
    match = _LAYER_INDEX.search(name)
    return (int(match.group(1)) if match else -1, name)


class WorkerSide:
    """Executes step plans against one instance's caches and a kvstore store."""

    def __init__(self, store: Any, namespace_of: Callable[[str], Namespace],
                 num_kv_heads: int, head_dim: int) -> None:
        self.store = store
        self.namespace_of = namespace_of
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.layers: list[LayerCache] = []
        self._load_errors: set[int] = set()
        self._puts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-vllm-save")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self.loaded_blocks = 0
        self.saved_blocks = 0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer caches, in layer order."""
        self.layers = [layer_cache(kv_caches[name], self.num_kv_heads, self.head_dim)
                       for name in sorted(kv_caches, key=layer_order)]

    # -- loads ---------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        for transfer in plan.loads:
            self._load_one(transfer)

    def _load_one(self, t: BlockTransfer) -> None:
        try:
            results = self.store.batch_get(self.namespace_of(t.cache_salt), t.keys, t.tokens)
        except KVStoreError as exc:
            log.warning("kvstore fetch for %s failed; vLLM recomputes: %s", t.request_id, exc)
            results = []
        good = 0
        while good < len(results) and isinstance(results[good], FetchedBlock):
            good += 1
        if good:
            payloads = torch.stack([r.payload for r in results[:good]])
            scatter_blocks(self.layers, t.block_ids[:good], payloads)
            self.loaded_blocks += good
        if good < len(t.block_ids):
            log.warning("kvstore: %d of %d blocks of %s not loaded; vLLM recomputes them",
                        len(t.block_ids) - good, len(t.block_ids), t.request_id)
            self._load_errors.update(t.block_ids[good:])

    def load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ---------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        for t in plan.saves:
            payloads = gather_blocks(self.layers, t.block_ids)  # before vLLM reuses the memory
            puts = [BlockPut(k, p, tok, payloads[i]) for i, (k, p, tok)
                    in enumerate(zip(t.keys, t.parents, t.tokens, strict=True))]
            future = self._puts.submit(self._put, t.request_id, t.cache_salt, puts)
            with self._lock:
                self._pending = [f for f in self._pending if not f.done()] + [future]

    def _put(self, request_id: str, salt: str, puts: list[BlockPut]) -> None:
        try:
            self.store.batch_put(self.namespace_of(salt), puts)
            self.saved_blocks += len(puts)
        except KVStoreError as exc:  # a cache that misses later, never a failed request
            log.warning("kvstore: saving %d blocks of %s failed: %s", len(puts), request_id, exc)

    def flush(self) -> None:
        """Wait for every queued put."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self.flush()
        self._puts.shutdown(wait=True)
