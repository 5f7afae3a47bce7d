"""LMCache as a baseline on vLLM's CPU backend: the copy between vLLM's blocks and LMCache.

LMCache 0.5.6 has no CPU connector: its factory ``lmcache.v1.gpu_connector.CreateGPUConnector``
raises "No supported cpu connector found", and vLLM then runs on without caching anything. This
module supplies the missing piece, written against LMCache's ``GPUConnectorInterface``, and
``LMCacheCPUConnector`` (vLLM's own LMCache connector) installs it in whichever vLLM process
builds the connector, so no installed file is edited. vLLM loads it with
``kv_connector: LMCacheCPUConnector``, ``kv_connector_module_path:
benchmarks.baselines.lmcache_cpu``.

Runs only in the LMCache venv (``setup.sh``): LMCache needs protobuf < 7, kvstore >= 7.36.
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

from benchmarks.baselines.cpu_layout import blocks_view, gather_tokens, scatter_tokens


class CPUPagedConnector(GPUConnectorInterface):
    """Copies KV between vLLM's CPU paged blocks and LMCache's KV_2LTD memory objects."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        # vLLM's CPU layout and the copy itself are cpu_layout's; this class speaks LMCache.
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.kvcaches: list[torch.Tensor] | None = None

    @classmethod
    def from_metadata(cls, metadata: Any) -> CPUPagedConnector:
        """Sizes from LMCache's metadata: kv_shape is (layers, 2, chunk, kv heads, head size)."""
        if metadata.use_mla:
            raise NotImplementedError("MLA's latent cache has no CPU layout here")
        num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
        return cls(num_layers, num_kv_heads, head_size)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    def _views(self, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Each layer's cache as ``blocks_view`` shows it (the 'kvcaches' LMCache passes)."""
        caches = kwargs.get("kvcaches", self.kvcaches)
        if caches is None:
            raise ValueError("LMCache passed no 'kvcaches' and none were registered")
        self.kvcaches = list(caches)
        if len(self.kvcaches) != self.num_layers:
            raise ValueError(f"{len(self.kvcaches)} KV caches for {self.num_layers} layers")
        return [blocks_view(cache, self.head_size) for cache in self.kvcaches]

    @staticmethod
    def _slots(kwargs: dict[str, Any], start: int, end: int) -> torch.Tensor:
        if "slot_mapping" not in kwargs:
            raise ValueError("LMCache passed no 'slot_mapping'")
        return kwargs["slot_mapping"][start:end]

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Gather tokens [start, end) of every layer into ``memory_obj`` (KV_2LTD)."""
        out = memory_obj.tensor
        assert out is not None
        slots = self._slots(kwargs, start, end)
        for layer, view in enumerate(self._views(kwargs)):
            out[:, layer, :end - start] = gather_tokens(view, slots)
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Scatter ``memory_obj`` into the slots of tokens [start, end) of every layer.

        Tokens vLLM already holds (``vllm_cached_tokens``) are left alone, as LMCache's CUDA
        connector does: their blocks may be shared with running requests.
        """
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"expected a KV_2LTD memory object, got {memory_obj.metadata.fmt}")
        src = memory_obj.tensor
        assert src is not None
        skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
        slots = self._slots(kwargs, start + skip, end)
        for layer, view in enumerate(self._views(kwargs)):
            scatter_tokens(view, slots, src[:, layer, skip:end - start])

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int],
                         **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: list[int] | None = None,
                       ends: list[int] | None = None, **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts or [], ends or [], strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)


def install() -> None:
    """Make LMCache's connector factory build ``CPUPagedConnector`` for vLLM on the CPU.

    Idempotent. LMCache's vLLM service imports the factory from its package at call time, so
    replacing the package attribute is enough; every other engine and device goes upstream.
    """
    import lmcache.v1.gpu_connector as factory
    from lmcache import torch_device_type
    from lmcache.utils import EngineType

    upstream = factory.CreateGPUConnector
    if getattr(upstream, "cpu_paged", False):
        return

    def create(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        if engine == EngineType.VLLM and torch_device_type == "cpu":
            return CPUPagedConnector.from_metadata(metadata)
        return upstream(config, metadata, engine, layout_hints)

    create.cpu_paged = True  # type: ignore[attr-defined]
    factory.CreateGPUConnector = create


class LMCacheCPUConnector(LMCacheConnectorV1):
    """vLLM's LMCache connector, with LMCache taught vLLM's CPU KV layout first."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        install()
        super().__init__(vllm_config, role, kv_cache_config)
