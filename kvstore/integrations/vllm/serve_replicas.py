"""vLLM engines as ``kvstore serve``'s prefill and decode replicas (``--engine vllm``).

Each replica runs one vLLM ``AsyncLLM`` whose KV connector is kvstore's: prefill replicas are
``kv_producer`` (they save every full prompt block, never load), decode replicas
``kv_consumer`` (they load, never save). A request goes:

1. prefill: the prompt with ``max_tokens=1``; the connector publishes its full blocks off the
   forward path, and the first token goes back to the front end at once;
2. decode: runs the prompt plus the first token, its ``kv_transfer_params`` naming the blocks
   the prefill publishes (``handoff.BLOCKS_PARAM``), as vLLM's own P/D proxies hand a
   prefill's answer on: the connector holds the request in vLLM's scheduler (its other
   requests go on decoding) until kvstore holds those blocks, up to ``publish_wait_s``, then
   loads them, so vLLM computes only the tail after the last full block; the tokens stream
   back as vLLM makes them.

``AsyncLLM`` schedules every request a replica has in flight together, so concurrent requests
decode in one forward (vLLM's continuous batching); ``stats()`` reports the largest batch the
engine's scheduler ran, from vLLM's own step statistics. The replicas speak the front end's
replica interface (``kvstore.frontend.engines``), so the router, the OpenAI API and the
coalescing of shared prefixes are the same as with kvstore's own engine.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray import serve
from vllm import SamplingParams as VLLMSampling
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

from kvstore.config import KVStoreConfig
from kvstore.errors import KVStoreError
from kvstore.frontend.serve_replicas import EngineCall
from kvstore.integrations.vllm.engine_shm import engine_segments, remove_segments
from kvstore.integrations.vllm.handoff import BLOCKS_PARAM
from kvstore.keys import Namespace
from kvstore.workers.model.sampling import SamplingParams


@dataclass(slots=True)
class VLLMPrefillResult:
    """What a vLLM prefill replica returns (the fields the front end reads)."""

    request_id: str
    first_token: int
    num_prompt_tokens: int
    cached_tokens: int  # prompt tokens vLLM did not compute (its own prefix cache)
    num_prefix_blocks: int  # full prompt blocks its connector publishes
    tail: None = None  # the decode instance computes the tail itself


class BatchTally(StatLoggerBase):
    """vLLM's per-step statistics, kept as the largest batch the scheduler ran."""

    def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
        self.peak_running_requests = 0
        self.peak_tokens_per_step = 0  # tokens sampled by one forward, across requests

    def record(self, scheduler_stats: Any, iteration_stats: Any,
               mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.peak_running_requests = max(self.peak_running_requests,
                                             scheduler_stats.num_running_reqs)
        if iteration_stats is not None:
            self.peak_tokens_per_step = max(self.peak_tokens_per_step,
                                            iteration_stats.num_generation_tokens)

    def log_engine_initialized(self) -> None:
        return


def vllm_sampling(sampling: SamplingParams, max_tokens: int,
                  extra_args: dict[str, Any] | None = None) -> VLLMSampling:
    """kvstore's sampling settings in vLLM's terms.

    EOS is the front end's business (``stop_token_ids``, empty with ``ignore_eos``), so vLLM's
    own is switched off; vLLM returns token ids only, the front end detokenizes.
    """
    return VLLMSampling(max_tokens=max_tokens, temperature=sampling.temperature,
                        top_k=sampling.top_k, seed=sampling.sampling_seed,
                        stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True,
                        detokenize=False, output_kind=RequestOutputKind.DELTA,
                        extra_args=extra_args)


def _unique(request_id: str) -> str:
    """vLLM wants request ids unique per engine: a retried call must not collide."""
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


def _replica_id(role: str) -> str:
    try:
        return f"vllm-{role}-{serve.get_replica_context().replica_id.unique_id}"
    except Exception:  # noqa: BLE001 - outside Serve
        return f"vllm-{role}"


class _VLLMReplica:
    """What both roles share: the engine, the namespace, the counters."""

    def __init__(self, config: KVStoreConfig, engine_args: dict[str, Any],
                 role: Literal["kv_producer", "kv_consumer"]) -> None:
        from kvstore.cluster.lifecycle import cluster_config
        from kvstore.integrations.vllm.connector import device_label, geometry_of
        from kvstore.integrations.vllm.namespace import checkpoint_fingerprint, namespace
        from kvstore.security.data_keys import parse_data_key

        self.replica_id = _replica_id("prefill" if role == "kv_producer" else "decode")
        # The engine's connector finds the cluster this replica runs on, named explicitly:
        # its engine process is no Ray worker and may not see RAY_ADDRESS or a record. It
        # holds a decode call until the prefill's blocks are in, as long as this config says.
        address = ray.get_runtime_context().gcs_address
        transfer = KVTransferConfig(kv_connector="KVStoreConnector",
                                    kv_connector_module_path="kvstore.integrations.vllm",
                                    kv_role=role,
                                    kv_connector_extra_config={
                                        "address": address,
                                        "publish_wait_s": config.worker.publish_wait_s})
        settings = {"enable_prefix_caching": True, "skip_tokenizer_init": True, **engine_args}
        args = AsyncEngineArgs(model=config.worker.model, kv_transfer_config=transfer,
                               **settings)
        self.tally = BatchTally()
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[lambda *_: self.tally])
        self._segments = engine_segments()  # removed at stop: a killed replica cannot
        vllm_config = self.engine.vllm_config
        geometry = geometry_of(vllm_config)
        self.block_size = geometry.block_size
        cluster = cluster_config(KVStoreConfig(), address=address)
        fingerprint = checkpoint_fingerprint(geometry.checkpoint)
        tag, key = device_label(vllm_config), parse_data_key(cluster.security.data_key)
        self._namespace = lambda salt: namespace(geometry, fingerprint, tag, salt, key)
        self.active = 0
        self.cancelled = 0
        self.requests = 0
        self.cached_tokens = 0
        self.last_cached_tokens = 0

    def namespace_of(self, salt: str | None) -> Namespace:
        return self._namespace(salt or "")

    async def _generate(self, tokens: list[int], params: VLLMSampling, request_id: str,
                        cache_salt: str | None = None) -> AsyncIterator[Any]:
        """vLLM's outputs for one request; a caller that goes away aborts it in vLLM."""
        self.active += 1
        finished = False
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                finished = out.finished
                yield out
        finally:
            self.active -= 1
            if not finished:
                self.cancelled += 1
                await self.engine.abort(request_id)

    def _count(self, cached: int) -> None:
        self.requests += 1
        self.cached_tokens += cached
        self.last_cached_tokens = cached

    async def stats(self) -> dict[str, Any]:
        """For ``/health``: this replica is up, its requests, and vLLM's largest batch."""
        return {"replica": self.replica_id, "node_id": ray.get_runtime_context().get_node_id(),
                "engine": "vllm", "active_requests": self.active, "cancelled": self.cancelled,
                "requests": self.requests, "cached_tokens": self.cached_tokens,
                "last_cached_tokens": self.last_cached_tokens,
                "peak_running_requests": self.tally.peak_running_requests,
                "peak_tokens_per_step": self.tally.peak_tokens_per_step}

    def __del__(self) -> None:
        """Serve calls this when the replica stops: the engine's processes and memory go."""
        with contextlib.suppress(Exception):
            self.engine.shutdown()
        with contextlib.suppress(Exception):
            remove_segments(self._segments)


@serve.deployment(name="prefill", ray_actor_options={"num_cpus": 1})
class VLLMPrefillServer(_VLLMReplica):
    """A vLLM ``kv_producer``: computes the prompt, publishes its blocks, returns one token."""

    def __init__(self, config: KVStoreConfig, engine_args: dict[str, Any]) -> None:
        super().__init__(config, engine_args, "kv_producer")

    async def namespace(self, cache_salt: str | None) -> Namespace:
        """The namespace this replica's connector publishes a tenant's blocks in."""
        return self.namespace_of(cache_salt)

    async def prefill(self, call: EngineCall) -> VLLMPrefillResult:
        params = vllm_sampling(call.sampling, 1)
        first, cached = None, 0
        async for out in self._generate(call.token_ids, params, _unique(call.request_id)):
            cached = out.num_cached_tokens or cached
            if out.outputs and out.outputs[0].token_ids and first is None:
                first = int(out.outputs[0].token_ids[0])
        if first is None:
            raise KVStoreError(f"vLLM returned no token for {call.request_id}")
        self._count(cached)
        return VLLMPrefillResult(call.request_id, first, len(call.token_ids), cached,
                                 len(call.token_ids) // self.block_size)


@serve.deployment(name="decode", ray_actor_options={"num_cpus": 1})
class VLLMDecodeServer(_VLLMReplica):
    """A vLLM ``kv_consumer``: loads the prompt's blocks from kvstore, streams the tokens."""

    def __init__(self, config: KVStoreConfig, engine_args: dict[str, Any]) -> None:
        super().__init__(config, engine_args, "kv_consumer")

    async def stream(self, call: EngineCall, first_token: int | None = None,
                     tail: Any = None, wait_for_blocks: int = 0
                     ) -> AsyncIterator[dict[str, Any]]:
        """``{"token_ids": [...]}`` as vLLM makes them, then ``{"done": {...}}``.

        ``first_token=None`` (``bypass_cache``): the whole generation here, computed from
        scratch: kvstore neither read nor written (``kv_transfer_params``' ``kvstore_bypass``)
        and vLLM's own prefix cache kept out by a cache salt of the request's own, so the
        reference never reuses KV that a cached run loaded or computed.
        """
        max_new = call.sampling.max_new_tokens
        if first_token is not None and max_new <= 1:  # the first token was all there was
            yield {"done": {"prompt_tokens": len(call.token_ids), "cached_tokens": 0,
                            "num_tokens": 0}}
            return
        salt = None
        if first_token is None:
            tokens = call.token_ids
            params = vllm_sampling(call.sampling, max_new,
                                   {"kv_transfer_params": {"kvstore_bypass": True}})
            salt = f"kvstore-bypass-{uuid.uuid4().hex}"
        else:  # the connector waits for the prefill's blocks (its publish is off its forward)
            tokens = [*call.token_ids, first_token]
            params = vllm_sampling(call.sampling, max_new - 1, {"kv_transfer_params": {
                BLOCKS_PARAM: wait_for_blocks}} if wait_for_blocks > 0 else None)
        cached, count = 0, 0
        async for out in self._generate(tokens, params, _unique(call.request_id), salt):
            cached = out.num_cached_tokens or cached
            new = list(out.outputs[0].token_ids) if out.outputs else []
            if new:
                count += len(new)
                yield {"token_ids": new}
        self._count(cached)
        yield {"done": {"prompt_tokens": len(call.token_ids), "cached_tokens": cached,
                        "num_tokens": count}}
