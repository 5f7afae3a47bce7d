"""A vLLM KV connector that moves a load's bytes and nothing else: the floor of any copying load.

``bench_vllm`` compares a fresh instance loading its prefix from kvstore with vLLM's own prefix
cache hit in one process, which moves no bytes at all. On a CPU the load's bytes travel
through the same memory the forward streams its weights and KV from, so moving them under the
forward costs the forward something whoever moves them. This connector measures that cost
alone: on a local prefix hit (vLLM's own cache, as the floor's) it does, on a core the forward
does not use and while the forward runs, exactly the memory traffic of a kvstore load of the
hit's blocks, with no lookup, lease, plan or header:

- each layer, every block's part of it copied from a private source laid out as kvstore's
  arena holds blocks (``[blocks, layers, per-block layer bytes]``, so each copy reads one
  strided run, as kvstore's does) into a private destination laid out as vLLM's CPU caches
  (``[layers, blocks, per-block layer bytes]``; ``wait_for_layer_load`` waits for that layer
  alone, as kvstore's);
- then every block's tag computed over its source bytes (xxh3-64, a plain cluster's tag), in
  ``wait_for_save`` at the latest, as kvstore's check.

It never writes vLLM's caches, so outputs are vLLM's own. kvstore's time over this one's is
what kvstore costs beyond the bytes any copying load must move; this one's over the floor is
what the machine charges for moving them. A request whose ``kv_transfer_params`` carry
``{"kvstore_bypass": true}`` moves nothing, as kvstore's connector skips it: ``bench_vllm``
pairs each warm request with such a one right after it in the same instance, as it pairs
kvstore's.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from kvstore.integrations.vllm.spare_core import pin_thread, spare_cores
from kvstore.integrations.vllm.worker_side import layer_order


@dataclass
class CopyFloorMetadata(KVConnectorMetadata):
    """The step's local prefix hits, in vLLM blocks (one count per new request)."""

    hit_blocks: list[int] = field(default_factory=list)


class _Step:
    """One step's copies: layer ``i``'s event is set once every hit's blocks are copied."""

    def __init__(self, num_layers: int) -> None:
        self.done = [threading.Event() for _ in range(num_layers)]
        self.future: Future[None] | None = None


class CopyFloorConnector(KVConnectorBase_V1):
    """Matches nothing and saves nothing; on a local prefix hit, moves its bytes aside."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.max_blocks = -(-vllm_config.model_config.max_model_len // self.block_size)
        self.layer_index: dict[str, int] = {}
        self.source: torch.Tensor | None = None  # [blocks, layers, chunk] uint8: an arena
        self.dest: torch.Tensor | None = None  # [layers, blocks, chunk] uint8: vLLM's caches
        self.pool: ThreadPoolExecutor | None = None
        self.step: _Step | None = None
        self.bypassed: set[str] = set()  # scheduler side: requests that move nothing

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and params.get("kvstore_bypass"):
            self.bypassed.add(request.request_id)
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        hits = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self.bypassed:
                self.bypassed.discard(new.req_id)
            elif new.num_computed_tokens >= self.block_size:
                hits.append(new.num_computed_tokens // self.block_size)
        return CopyFloorMetadata(hits)

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=layer_order)
        self.layer_index = {name: i for i, name in enumerate(names)}
        first = kv_caches[names[0]]
        chunk = first[0].numel() * first.element_size()  # one vLLM block of one layer (CPU)
        # zeros: every page is touched now, as kvstore's arena and vLLM's caches are
        self.source = torch.zeros((self.max_blocks, len(names), chunk), dtype=torch.uint8)
        self.dest = torch.zeros((len(names), self.max_blocks, chunk), dtype=torch.uint8)
        cores = spare_cores()  # vLLM pinned this thread, its forward's, by now
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy-floor")
        if cores:
            self.pool.submit(pin_thread, cores).result()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CopyFloorMetadata)
        if not meta.hit_blocks or self.pool is None:
            return
        step = self.step = _Step(len(self.layer_index))
        step.future = self.pool.submit(self._move, step, meta.hit_blocks)

    def _move(self, step: _Step, hits: list[int]) -> None:
        assert self.source is not None and self.dest is not None
        try:
            for i, done in enumerate(step.done):
                at = 0
                for blocks in hits:  # kvstore's: one strided copy per run of blocks
                    self.dest[i, at:at + blocks].copy_(self.source[at:at + blocks, i])
                    at += blocks
                done.set()
            at = 0
            for blocks in hits:
                for row in self.source[at:at + blocks]:  # each block's tag over its bytes
                    xxhash.xxh3_64(row.numpy()).digest()
                at += blocks
        finally:
            for done in step.done:
                done.set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        step, index = self.step, self.layer_index.get(layer_name)
        if step is not None and index is not None:
            step.done[index].wait()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        step, self.step = self.step, None
        if step is not None and step.future is not None:
            step.future.result()

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
