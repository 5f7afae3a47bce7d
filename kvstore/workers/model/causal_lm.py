"""The model adapter: a Llama-architecture causal LM whose KV the store can hold.

It loads a local weights directory or builds a random-initialised preset in-process (nothing is
downloaded), fingerprints config + weights bytes for the namespace, and exposes the three
things the engine needs: run a chunk on top of a cache, build a cache from given K/V, and
export K/V in the block layout ``[L, 2, bs, H, D]``.

Reproducibility: the thread count is fixed and the attention implementation is ``eager`` by
default. Eager attention is two plain matmuls and a softmax on every machine; ``sdpa`` picks
among fused kernels by shape, mask and CPU features, so two hosts (or two torch builds) may
reduce in different orders. Bitwise reuse needs the arithmetic pinned, and eager pins more of
it. Either runs as its padded version (``kvstore.workers.model.attention``), so a chunk's rows can
attend over keys padded to the chunk's end.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.cache_utils import DynamicLayer

from kvstore.config import WORKER_DTYPES, WorkerConfig
from kvstore.errors import ConfigError
from kvstore.keys import DTYPES, Namespace
from kvstore.workers.model.attention import padded_implementation
from kvstore.workers.model.device import WorkerDevice, numerics_tag, resolve_worker
from kvstore.workers.model.fingerprint import model_fingerprint

ATTN_IMPLEMENTATION = "eager"

#: Random-initialised presets: ``tiny`` for tests, ``small`` for the demo and benchmarks,
#: ``llama3-8b`` for GPU benchmarks.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=176, vocab_size=512,
                 max_position_embeddings=4096, initializer_range=0.08),
    "small": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                  num_key_value_heads=4, intermediate_size=2816, vocab_size=32000,
                  max_position_embeddings=8192, initializer_range=0.02),
    # Shaped like Llama-3-8B (random weights, 16 GB in bf16): GPU benchmarks only; a CPU
    # would take minutes to initialise it.
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      max_position_embeddings=32768, rope_theta=500000.0,
                      initializer_range=0.02),
}


def cache_keyword(model: torch.nn.Module) -> str:
    """The name ``model.forward`` takes its KV cache by: ``cache``, the current transformers 5.x
    name, or ``past_key_values`` for a model written before the rename.

    Passing the old name to a renamed ``forward`` still works, but transformers warns that it
    will be removed; asking the signature (which sees through transformers' renaming
    decorator) keeps the adapter on the interface the installed version has.
    """
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@dataclass(slots=True)
class ModelShape:
    """What a KV block of this model looks like."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


class CausalLM:
    """A loaded causal LM with its fingerprint; runs chunks on a ``DynamicCache``.

    Everything runs on the model's device (``self.device``): its input ids, its caches, the
    K/V given to ``cache_from_kv`` and exported by ``export_kv``. Logits come back on the CPU,
    where tokens are picked.
    """

    def __init__(self, model: torch.nn.Module, dtype: str, name: str,
                 attn_implementation: str = ATTN_IMPLEMENTATION, numerics: str = "auto"
                 ) -> None:
        # transformers' own typing of models and configs is loose; Any keeps mypy honest here.
        self.model: Any = model.eval()
        cfg: Any = model.config
        cfg._attn_implementation = padded_implementation(attn_implementation)
        self.config: Any = cfg
        self.attn_implementation = attn_implementation
        self.dtype = dtype
        self.name = name
        self.device: torch.device = next(model.parameters()).device
        #: The namespace's numerics tag (``kvstore.workers.model.device``): "" when shared across
        #: hardware.
        self.numerics = numerics_tag(self.device, attn_implementation, numerics)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = ModelShape(cfg.num_hidden_layers,
                                cfg.num_key_value_heads or cfg.num_attention_heads,
                                head_dim, cfg.vocab_size)
        if getattr(cfg, "sliding_window", None):
            raise ConfigError(f"model {name!r} uses sliding-window attention; kvstore blocks "
                              "need full attention (use a Llama-style model without it)")
        other = sorted({str(t) for t in getattr(cfg, "layer_types", None) or ()}
                       - {"full_attention"})
        if other:
            raise ConfigError(f"model {name!r} has layers of type {', '.join(other)} "
                              "(config layer_types); kvstore blocks need full attention in "
                              "every layer")
        #: The keyword the model's ``forward`` takes its cache by (``cache_keyword``).
        self.cache_keyword = cache_keyword(self.model)
        self._check_cache_layout()
        # Computed once at load, on the weights' device (kvstore.workers.model.fingerprint).
        self.fingerprint = model_fingerprint(model)

    def _check_cache_layout(self) -> None:
        """Refuse a model whose cache is not one plain ``[1, H, T, D]`` K and V per layer.

        Blocks are exported and rebuilt in that layout; a model whose cache differs (sliding or
        chunked layers, latent attention with other K and V head dims, shared or missing
        layers) would be served wrong KV without any error. One token on an empty cache shows
        the layout structurally, whatever the config claims.
        """
        cache = self.new_cache()
        self.forward([0], cache)
        s = self.shape
        want = (1, s.num_kv_heads, 1, s.head_dim)

        def refuse(what: str) -> ConfigError:
            return ConfigError(f"model {self.name!r} cannot be served exactly: {what}; "
                               "kvstore blocks need one full-attention K and V "
                               f"{list(want)} per layer")

        if len(cache.layers) != s.num_layers:
            raise refuse(f"its cache has {len(cache.layers)} layers, the config "
                         f"{s.num_layers}")
        for i, lay in enumerate(cache.layers):
            if type(lay) is not DynamicLayer:
                raise refuse(f"layer {i} caches as {type(lay).__name__}, not full attention")
            keys, values = getattr(lay, "keys", None), getattr(lay, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                raise refuse(f"layer {i} stores no K/V tensors")
            if keys.shape[:-1] == values.shape[:-1] and keys.shape[-1] != values.shape[-1]:
                raise refuse(f"layer {i} has different K and V head dims (MLA): "
                             f"{keys.shape[-1]} and {values.shape[-1]}")
            for label, got in (("K", keys), ("V", values)):
                if tuple(got.shape) != want:
                    raise refuse(f"layer {i} {label} is {list(got.shape)}")

    def namespace(self, block_size: int, cache_salt: str = "", *,
                  data_key: bytes | None = None, tenant_key: bytes | None = None
                  ) -> Namespace:
        """The namespace of this model's KV blocks for a block size and tenant salt; with the
        cluster's ``data_key`` or the tenant's own ``tenant_key`` its root and block MACs are
        keyed (docs/design.md §3.1)."""
        return Namespace(self.fingerprint, self.dtype, block_size, self.shape.num_layers,
                         self.shape.num_kv_heads, self.shape.head_dim, cache_salt,
                         numerics=self.numerics, data_key=data_key, tenant_key=tenant_key)

    def new_cache(self) -> DynamicCache:
        """An empty cache."""
        return DynamicCache(config=self.config)

    def cache_from_kv(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
        """A cache holding given per-layer K/V, each ``[T, H, D]`` (token-major, as gathered),
        on the model's device."""
        data = [(k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
                for k, v in zip(keys, values, strict=True)]
        # DynamicLayer.update concatenates onto an empty tensor, so the cache owns a fresh,
        # contiguous [1, H, T, D] copy: the same layout a cache built by running the model has.
        return DynamicCache(ddp_cache_data=data, config=self.config)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], cache: DynamicCache, *,
                pad_keys_to: int | None = None, pad_rows_to: int | None = None,
                to_host: bool = True) -> torch.Tensor:
        """Run ``token_ids`` on top of ``cache`` (which grows by them); the last one's logits
        (float32; on the host, or on the device with ``to_host=False``: no sync, so a prefill
        queues its next chunk while this one still runs).

        ``pad_keys_to``: every row attends over keys padded to this length (the chunk's end).
        ``pad_rows_to``: dummy tokens are appended up to this many rows, run, and dropped from
        the cache again; causality keeps them out of every real row, so the real rows get the
        shapes of a whole chunk on any backend (at the cost of computing the dummy rows).
        """
        ids = [int(t) for t in token_ids]
        num_real = len(ids)
        keep: int | torch.Tensor = 1
        if pad_rows_to is not None and pad_rows_to > num_real:
            ids += [0] * (pad_rows_to - num_real)
            keep = torch.tensor([num_real - 1])
        kwargs: dict[str, Any] = {self.cache_keyword: cache}
        if pad_keys_to is not None:
            kwargs["kv_pad_to"] = pad_keys_to
        input_ids = torch.tensor([ids], dtype=torch.long).to(self.device, non_blocking=True)
        if isinstance(keep, torch.Tensor):
            keep = keep.to(self.device, non_blocking=True)
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=keep, **kwargs)
        if len(ids) > num_real:
            cache.crop(num_real - len(ids))
        logits = out.logits[0, -1].float()
        # Tokens are picked on the host: one small copy per step, the step's only sync.
        return logits.to("cpu") if to_host else logits

    @staticmethod
    def cache_kv(cache: DynamicCache, layer: int, start: int, end: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens ``[start, end)`` of one layer, as ``[T, H, D]`` views."""
        lay: Any = cache.layers[layer]
        return (lay.keys[0, :, start:end].transpose(0, 1),
                lay.values[0, :, start:end].transpose(0, 1))

    def export_kv(self, cache: DynamicCache, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of the cache as one ``[L, 2, T, H, D]`` tensor (a copy)."""
        per_layer = [torch.stack(self.cache_kv(cache, layer, start, end))
                     for layer in range(self.shape.num_layers)]
        return torch.stack(per_layer).contiguous()

    def export_block_major(self, cache: DynamicCache, start: int, num_blocks: int,
                           block_size: int) -> torch.Tensor:
        """``num_blocks`` full blocks from token ``start`` as one block-major
        ``[num_blocks, L, 2, bs, H, D]`` tensor on the model's device (one copy per layer):
        block ``i`` is ``out[i]``, contiguous, as the store holds it."""
        s = self.shape
        out = torch.empty((num_blocks, s.num_layers, 2, block_size, s.num_kv_heads, s.head_dim),
                          dtype=DTYPES[self.dtype], device=self.device)
        end = start + num_blocks * block_size
        for layer in range(s.num_layers):
            k, v = self.cache_kv(cache, layer, start, end)
            out[:, layer, 0].copy_(k.reshape(num_blocks, block_size, *k.shape[1:]))
            out[:, layer, 1].copy_(v.reshape(num_blocks, block_size, *v.shape[1:]))
        return out

    def export_blocks(self, cache: DynamicCache, start: int, num_blocks: int,
                      block_size: int) -> list[torch.Tensor]:
        """``num_blocks`` full blocks from token ``start``, each ``[L, 2, bs, H, D]``."""
        kv = self.export_kv(cache, start, start + num_blocks * block_size)
        return [kv[:, :, i * block_size:(i + 1) * block_size].contiguous()
                for i in range(num_blocks)]


def _random_model(preset: str, seed: int, dtype: torch.dtype, device: torch.device
                  ) -> torch.nn.Module:
    """A preset with random weights from ``seed``, built where it will run.

    On the CPU it is built in float32 and cast (the weights the CPU tests pin); elsewhere it
    is built directly on the device in its dtype, so a large preset skips CPU initialisation
    and a host-to-device copy.
    """
    config = LlamaConfig(**PRESETS[preset])
    # A forked RNG: loading a model must not disturb the caller's random stream.
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        if device.type == "cpu":
            model: Any = LlamaForCausalLM(config)
            return model.to(dtype)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype)


def load_model(spec: str, *, seed: int = 0, dtype: str = "auto",
               num_threads: int | None = 1, attn_implementation: str = "auto",
               device: str = "auto", numerics: str = "auto") -> CausalLM:
    """A preset name (``tiny``, ``small``: random weights from ``seed``) or a weights directory.

    ``device``, ``dtype`` and ``attn_implementation`` say ``auto`` by default: the first GPU
    with bfloat16 and sdpa where there is one, else the CPU with float32 and eager
    (``kvstore.workers.model.device``). ``num_threads`` fixes torch's intra-op thread count for
    this process (None leaves it). ``numerics``: ``worker.numerics`` (the namespace's numerics tag).
    """
    where = resolve_worker(device, dtype, attn_implementation)
    return _load(spec, seed, where, num_threads, numerics)


def load_worker_model(wc: WorkerConfig, *, keep_threads: bool = False) -> CausalLM:
    """The model a worker with settings ``wc`` runs: its device, dtype, attention, numerics.

    ``keep_threads`` leaves torch's thread count as it is (a front end checking a model).
    """
    return load_model(wc.model, seed=wc.seed, dtype=wc.dtype,
                      num_threads=None if keep_threads else wc.num_threads,
                      attn_implementation=wc.attn_implementation, device=wc.device,
                      numerics=wc.numerics)


def _load(spec: str, seed: int, where: WorkerDevice, num_threads: int | None,
          numerics: str) -> CausalLM:
    attn_implementation, dtype = where.attn_implementation, where.dtype
    padded_implementation(attn_implementation)  # refuse an unknown one before loading
    if dtype not in WORKER_DTYPES:
        raise ConfigError(f"model dtype {dtype!r} is not supported; use float32, float16 or "
                          "bfloat16")
    if num_threads is not None:
        if num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    torch_dtype = DTYPES[dtype]
    if spec in PRESETS:
        return CausalLM(_random_model(spec, seed, torch_dtype, where.device), dtype, spec,
                        attn_implementation, numerics)
    if not os.path.isdir(spec):
        raise ConfigError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                          "local weights directory (with config.json and *.safetensors)")
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            spec, dtype=torch_dtype, attn_implementation=padded_implementation(
                attn_implementation), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load model from {spec!r}: {exc}") from exc
    return CausalLM(model.to(where.device), dtype, os.path.basename(os.path.normpath(spec)),
                    attn_implementation, numerics)


def _token_ids(value: Any) -> tuple[int, ...]:
    """An ``eos_token_id`` field (absent, one id or a list) as a tuple."""
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(int(v) for v in values if v is not None)


def generation_stop_ids(spec: str) -> tuple[int, ...]:
    """The end-of-sequence ids a checkpoint's generation stops at; ``()`` for a preset.

    A published checkpoint says them in ``generation_config.json`` (chat models often list
    several: end of turn and end of text); an older one only in ``config.json``.
    """
    if spec in PRESETS or not os.path.isdir(spec):
        return ()  # a preset has none; a bad spec is load_model's error to report
    try:
        ids = _token_ids(GenerationConfig.from_pretrained(spec, local_files_only=True)
                         .eos_token_id)
    except (OSError, ValueError):  # no (or no readable) generation_config.json
        ids = ()
    if ids:
        return ids
    try:
        with open(os.path.join(spec, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return ()  # load_model reports a missing or broken config
    return _token_ids(config.get("eos_token_id")) if isinstance(config, dict) else ()
