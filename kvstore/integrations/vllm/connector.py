"""``KVStoreConnector``: kvstore as a vLLM v1 KV connector (shared prefix cache across
instances, and the KV path between prefill and decode instances).

vLLM builds one connector in its scheduler process and one in each worker; both connect to the
kvstore cluster every kvstore command uses (``kv_connector_extra_config.address``, else
``RAY_ADDRESS``, else the cluster ``kvstore start`` recorded) and fail at start, in one line
naming ``kvstore start``, when there is none. ``kv_role``: ``kv_producer`` saves only,
``kv_consumer`` loads only, ``kv_both`` does both. ``kv_connector_extra_config`` may also set
``load_mode`` (``auto``, ``sync``, ``async``: ``scheduler_side``) and ``layerwise`` (true:
synchronous loads are written layer by layer under the forward; false: whole before it;
default: layer by layer on a GPU only, ``worker_side.WorkerSide``), ``save_generated`` (save
the blocks generated tokens fill too: ``scheduler_side``), and, for an
instance run by one tenant, ``credential`` and ``tenant_key`` (``tenancy``). A block kvstore
cannot load is recomputed (``recompute_load_failures``), never a failed request. Under tensor
parallelism each worker executes its own KV-head slice's part of each plan (``shard``). The
scheduler side is ``scheduler_side.SchedulerSide``, the worker side ``worker_side.WorkerSide``;
this class only maps vLLM's calls onto them.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.errors import ConfigError
from kvstore.integrations.vllm.namespace import (
    ModelGeometry,
    checkpoint_fingerprint,
    namespace,
    numerics,
)
from kvstore.integrations.vllm.plans import StepPlan
from kvstore.integrations.vllm.scheduler_side import SchedulerSide
from kvstore.integrations.vllm.spare_core import forward_cores
from kvstore.integrations.vllm.tenancy import tenancy
from kvstore.integrations.vllm.transfer_stats import KVStorePromMetrics, KVStoreTransferStats
from kvstore.integrations.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

#: The scheduler side's names for where a load's blocks lie, as vLLM's cache-hit sources.
_HIT_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
                "p2p": CacheHitSource.P2P}


def cache_hit_sources(split: dict[str, int], num_external_tokens: int
                      ) -> dict[CacheHitSource, int]:
    """``split`` (``SchedulerSide.hit_sources``) as vLLM's sources; when it does not add up to
    the tokens vLLM counts, vLLM's count wins, under ``EXTERNAL_UNSPECIFIED``."""
    if sum(split.values()) != num_external_tokens:
        return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens} \
            if num_external_tokens else {}
    return {_HIT_SOURCES[name]: n for name, n in split.items() if n}


class KVStoreMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler side to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


#: vLLM's quantized KV cache formats kvstore holds (vLLM stores them as bytes), by the name
#: of the format each spelling means (vLLM reads "fp8" as e4m3).
FP8_FORMATS = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def kv_cache_format(cache: Any, model_dtype: str) -> tuple[str, str]:
    """The KV cache's storage dtype and its format where that is not the model's dtype
    (``ModelGeometry.kv_cache_format``), from vLLM's ``--kv-cache-dtype``.

    An fp8 cache holds each value as one byte scaled by its layer's k/v scale, which comes
    from the checkpoint (fingerprinted with it) or is 1.0: the same bytes in every instance
    of the checkpoint. Formats that keep scales beside each token's values, or that not
    every layer uses (``kv_cache_dtype_skip_layers``), are refused."""
    name = cache.cache_dtype
    if name in ("auto", model_dtype):
        return model_dtype, ""
    if name in ("float16", "bfloat16"):
        return name, f"{name} of {model_dtype}"
    if name not in FP8_FORMATS:
        raise ConfigError(f"KVStoreConnector holds a KV cache of kv_cache_dtype auto, float16, "
                          f"bfloat16, fp8, fp8_e4m3 or fp8_e5m2, not {name!r}")
    if getattr(cache, "kv_cache_dtype_skip_layers", None):
        raise ConfigError("KVStoreConnector needs every layer's KV cache in one format: "
                          "kv_cache_dtype_skip_layers must be empty with an fp8 cache")
    return "uint8", f"{FP8_FORMATS[name]} of {model_dtype}"


def geometry_of(config: VllmConfig) -> ModelGeometry:
    """The instance's KV geometry (one rank's, under tensor parallelism); configurations
    whose KV kvstore cannot hold are refused."""
    model, parallel, cache = config.model_config, config.parallel_config, config.cache_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("KVStoreConnector needs every layer in one process: pipeline "
                          "parallel size 1 (tensor parallelism is supported)")
    if (getattr(parallel, "decode_context_parallel_size", 1) != 1
            or getattr(parallel, "prefill_context_parallel_size", 1) != 1):
        raise ConfigError("KVStoreConnector needs each rank to hold every token of a block: "
                          "decode and prefill context parallel size 1")
    dtype, cache_format = kv_cache_format(cache, str(model.dtype).removeprefix("torch."))
    per_rank = model.get_num_kv_heads(parallel)
    return ModelGeometry(
        checkpoint=str(model.model), dtype=dtype, kv_cache_format=cache_format,
        block_size=int(cache.block_size), num_layers=model.get_num_layers(parallel),
        num_kv_heads=per_rank, head_dim=model.get_head_size(),
        tensor_parallel_size=int(parallel.tensor_parallel_size),
        total_kv_heads=per_rank if model.use_mla else model.get_total_num_kv_heads())


def tensor_parallel_rank() -> int:
    """This worker's rank in its tensor-parallel group (0 outside vLLM's workers)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return int(parallel_state.get_tensor_model_parallel_rank())


def device_label(config: VllmConfig) -> str:
    """Where the instance computes, named the same in its scheduler and worker processes."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "cpu":
        return numerics(torch.device("cpu"), vllm.__version__, "CPU_ATTN")
    backend = getattr(getattr(config, "attention_config", None), "backend", None) or "auto"
    return (f"{current_platform.device_type} {current_platform.get_device_name()}|torch "
            f"{torch.__version__}|vllm {vllm.__version__} {backend}")


def recompute_load_failures(transfer: Any, extra: dict[str, Any]) -> None:
    """Make vLLM recompute what kvstore could not load, as a cache miss is.

    vLLM's ``kv_load_failure_policy`` defaults to ``fail``, which ends a request whose blocks
    failed to load (a corrupted block, a dead holder, a cluster gone) with an error; for a cache
    that is a miss, never a failed request. vLLM reads the policy right after it builds the
    scheduler's connector, so it is set here; ``fail_on_load_error: true`` in
    ``kv_connector_extra_config`` keeps vLLM's ``fail``.
    """
    if extra.get("fail_on_load_error") or transfer.kv_load_failure_policy == "recompute":
        return
    log.info("kvstore: kv_load_failure_policy 'recompute': blocks kvstore cannot load are "
             "recomputed (set kv_connector_extra_config.fail_on_load_error to fail instead)")
    transfer.kv_load_failure_policy = "recompute"


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM's KV connector over a kvstore cluster."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from kvstore.cluster.host_signals import outlive_the_cluster
        from kvstore.cluster.lifecycle import cluster_config, connect
        from kvstore.config_loader import load_config
        from kvstore.security.data_keys import parse_data_key

        transfer = self._kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        geometry = geometry_of(vllm_config)
        fingerprint = checkpoint_fingerprint(geometry.checkpoint)
        tag = device_label(vllm_config)
        # KVSTORE_* settings apply as to every kvstore client; a credential given here wins.
        # Joining Ray here leaves vLLM's own SIGTERM handler in place, and the kvstore cluster
        # going away never ends vLLM's processes (host_signals).
        outlive_the_cluster()
        config = cluster_config(
            load_config(overrides={"client": {"auth_token": extra.get("credential")}}),
            address=extra.get("address"))
        tenants = tenancy(extra, config.client.auth_token,
                          parse_data_key(config.security.data_key))
        scheduler = role == KVConnectorRole.SCHEDULER
        rank = 0 if scheduler else tensor_parallel_rank()
        #: The KV-head slice this worker holds, and whether it saves it (the first rank
        #: holding it does); the scheduler plans for every slice (``StepPlan.for_shard``).
        self.shard, self.saves_shard = geometry.shard_of_rank(rank), geometry.saves_on_rank(rank)
        own = self.shard
        self.namespace_of = functools.lru_cache(maxsize=1024)(
            lambda salt, weights="", shard=None: namespace(
                geometry, fingerprint, tag, salt, **tenants.keys(), weights=weights,
                shard=own if shard is None else shard))
        self.store = connect(config)
        save, load = transfer.is_kv_producer, transfer.is_kv_consumer
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if scheduler:
            recompute_load_failures(transfer, extra)
            self.scheduler_side = SchedulerSide(
                self.store, self.namespace_of, geometry.block_size,
                save=save and tenants.may_write, load=load,
                load_mode=str(extra.get("load_mode", "auto")), salt_for=tenants.salt_for,
                shards=geometry.num_shards, save_generated=bool(extra.get("save_generated")),
                publish_wait_s=float(extra.get("publish_wait_s",
                                               config.worker.publish_wait_s)))
            self.scheduler_side.warm_up()
        else:
            self.worker_side = WorkerSide(
                self.store, self.namespace_of, geometry.num_kv_heads, geometry.head_dim,
                layerwise=None if extra.get("layerwise") is None else bool(extra["layerwise"]),
                forward_cores=forward_cores(geometry.tensor_parallel_size))

    # -- worker side ---------------------------------------------------------------------
    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-side call on the scheduler's connector"
        return self.worker_side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register(kv_caches)

    def _plan(self) -> StepPlan:
        """This step's plan for this worker's KV-head slice."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreMetadata)
        return meta.plan.for_shard(self.shard, saves=self.saves_shard)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker().before_step()  # saves gathered before vLLM reuses any block

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # saved whole blocks, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker().finish_loads()
        self._worker().save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker().finished_receiving() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().load_errors() if self.worker_side is not None else set()

    def reset_cache(self) -> bool:
        """vLLM resets its caches (``reset_prefix_cache(reset_connector=True)``, a pause that
        clears them), as it does after weights were updated in place: kvstore's blocks of the
        old weights must not load into the new ones, so new requests use a fresh weights
        version (``SchedulerSide.reset``). The blocks stay for instances still on the old
        weights, and age out as any other."""
        if self.scheduler_side is not None:
            self.scheduler_side.reset()
        return True

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        self.store.close()

    # -- vLLM's statistics (kvstore.integrations.vllm.transfer_stats) ---------------------
    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        """The tokens kvstore supplies, by tier, for vLLM's cached-prompt-tokens-by-source
        metric: this host's memory, its disk tier, or another node (peer to peer)."""
        return cache_hit_sources(self._scheduler().hit_sources(request.request_id),
                                 num_external_tokens)

    def get_kv_connector_stats(self) -> KVStoreTransferStats | None:
        """What this worker moved since the last step; None when nothing (vLLM then sends
        no connector output for the step)."""
        if self.worker_side is None:
            return None
        taken = self.worker_side.tally.take()
        return KVStoreTransferStats(data=taken) if taken else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVStoreTransferStats:
        return KVStoreTransferStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVStorePromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side ------------------------------------------------------------------
    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler call on a worker's connector"
        return self.scheduler_side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._scheduler().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._scheduler().allocated(request, list(blocks.get_block_ids()[0]),
                                    num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVStoreMetadata(self._scheduler().step_plan(scheduler_output))

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        params = getattr(request, "kv_transfer_params", None)
        return False, self._scheduler().finished(request.request_id, params)
