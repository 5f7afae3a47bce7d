"""The kvstore namespace of a vLLM instance: which other instances may use its blocks.

Blocks are shared only between instances that would compute the same KV bytes: the same
checkpoint (config and every weight, fingerprinted from the checkpoint's files the way kvstore
fingerprints a loaded model), dtype, vLLM block size, layers, KV heads and head size, and the
same arithmetic (the numerics tag: device kind, torch and vLLM versions, attention backend,
and the KV cache's format where it is not the model's dtype). A request's ``cache_salt`` is its
tenant: two salts never share a block.

Under tensor parallelism each rank holds a slice of the KV heads (or, with fewer KV heads than
ranks, one head that several ranks hold alike), and computes it with the all-reduces of its
parallel size: each distinct slice is a namespace of its own (a *shard*), named by the parallel
size and the heads it holds, so a rank loads only what a rank holding the same heads saved.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.workers.model.device import device_kind
from kvstore.workers.model.fingerprint import config_digest, tensor_checksum


@dataclass(frozen=True)
class ModelGeometry:
    """What a vLLM instance's KV looks like, as its config says."""

    checkpoint: str
    dtype: str  # the KV cache's storage dtype (``uint8`` for vLLM's fp8 formats)
    block_size: int
    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    tensor_parallel_size: int = 1
    total_kv_heads: int = 0  # the model's, all ranks together (0: ``num_kv_heads``)
    #: The KV cache's format where it is not the model's own dtype, e.g. ``fp8_e4m3 of
    #: float32`` ("": the model's dtype). The bytes of one format mean nothing in another.
    kv_cache_format: str = ""

    @property
    def num_shards(self) -> int:
        """Distinct KV-head slices across the ranks: the parallel size when it divides the
        heads, else the heads (each replicated on ``tensor_parallel_size // heads`` ranks)."""
        return min(self.tensor_parallel_size, self.total_kv_heads or self.num_kv_heads)

    def shard_of_rank(self, rank: int) -> int:
        """The slice tensor-parallel rank ``rank`` holds (vLLM splits heads in rank order)."""
        if not 0 <= rank < self.tensor_parallel_size:
            raise ConfigError(f"tensor-parallel rank {rank} is not one of "
                              f"{self.tensor_parallel_size}")
        return rank * self.num_shards // self.tensor_parallel_size

    def saves_on_rank(self, rank: int) -> bool:
        """Whether ``rank`` is the first of the ranks holding its slice: the one that saves
        it (the others hold the same bytes)."""
        return self.shard_of_rank(rank) != self.shard_of_rank(rank - 1) if rank else True

    def shard_label(self, shard: int) -> str:
        """What sets slice ``shard`` apart in its namespace ("" without tensor parallelism,
        so a single-rank instance's namespace is what it always was)."""
        if self.tensor_parallel_size == 1:
            return ""
        if not 0 <= shard < self.num_shards:
            raise ConfigError(f"KV shard {shard} is not one of {self.num_shards}")
        total = self.total_kv_heads or self.num_kv_heads
        first = shard * total // self.num_shards
        return (f"tp {self.tensor_parallel_size}: kv heads {first}-"
                f"{first + self.num_kv_heads - 1} of {total}")


def checkpoint_fingerprint(checkpoint: str | Path, cache_dir: Path | None = None) -> str:
    """Config and weights of a checkpoint directory: sha256 over the config's digest and, for
    every tensor of every ``*.safetensors`` file in name order, its name, dtype, shape and
    device checksum (``kvstore.workers.model.fingerprint``).

    Reading every weight takes seconds on a large checkpoint, and vLLM builds a connector in
    its scheduler process and in each worker, so the result is remembered under ``cache_dir``
    (the state directory's ``fingerprints/``), keyed by each file's path, size, inode, mtime and
    ctime (the last cannot be set back by a user): files changed in any way are read again."""
    path = Path(checkpoint)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise ConfigError(
            f"the vLLM model {str(checkpoint)!r} is not a local checkpoint directory with "
            "safetensors weights: kvstore fingerprints the weights it shares KV for, so give "
            "vLLM the directory (e.g. the Hugging Face snapshot path)")
    if cache_dir is None:
        from kvstore.cluster.address import state_dir

        cache_dir = state_dir() / "fingerprints"
    stamp = hashlib.sha256()
    for file in [path / "config.json", *files]:
        st = file.stat()
        stamp.update(f"{file.resolve()}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}|"
                     f"{st.st_ctime_ns}\n".encode())
    remembered = cache_dir / stamp.hexdigest()
    try:
        return remembered.read_text().strip()
    except OSError:
        pass
    fingerprint = _read_fingerprint(path, files)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        partial = remembered.with_suffix(f".{os.getpid()}")
        partial.write_text(fingerprint)
        partial.replace(remembered)  # whole or absent, whoever writes it first
    except OSError:
        pass  # an unwritable state directory: computed again next time
    return fingerprint


def _read_fingerprint(path: Path, files: list[Path]) -> str:
    from safetensors import safe_open
    from transformers import AutoConfig

    h = hashlib.sha256(config_digest(AutoConfig.from_pretrained(path)).encode())
    entries: dict[str, bytes] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                tensor = handle.get_tensor(name)
                entry = f"{tensor.dtype}:{tuple(tensor.shape)}".encode()
                entries[name] = entry + (tensor_checksum(tensor) if tensor.numel() else b"")
    for name in sorted(entries):
        h.update(name.encode())
        h.update(entries[name])
    return h.hexdigest()


def numerics(device: torch.device, vllm_version: str, attention_backend: str) -> str:
    """The numerics tag of an instance: who computes KV bitwise alike."""
    return (f"{device_kind(device)}|torch {torch.__version__}|vllm {vllm_version} "
            f"{attention_backend}")


def weights_fingerprint(fingerprint: str, weights: str) -> str:
    """The checkpoint's fingerprint, or, after vLLM reset the connector's cache (it does so
    when weights are updated in place, as RL trainers do between rollouts), one of its own.

    The checkpoint's files no longer describe such weights, and nothing the connector sees
    does, so each reset draws a fresh version: the instance then shares blocks with no one, not
    even its own earlier self, rather than ever reading KV of other weights."""
    if not weights:
        return fingerprint
    return hashlib.sha256(f"{fingerprint}|weights reset {weights}".encode()).hexdigest()


def namespace(geometry: ModelGeometry, fingerprint: str, tag: str, cache_salt: str | None,
              data_key: bytes | None = None, tenant_key: bytes | None = None,
              weights: str = "", shard: int = 0) -> Namespace:
    """The namespace of one request of an instance (``cache_salt``: its tenant), keyed on a
    secure cluster with the cluster's data key or that tenant's own key (``tenancy``), as the
    store nodes rebuild it. ``weights``: the instance's weights version since its cache was
    last reset ("" while they are the checkpoint's; ``weights_fingerprint``). ``shard``: the
    KV-head slice, under tensor parallelism (``ModelGeometry.shard_of_rank``)."""
    cache = f"kv cache {geometry.kv_cache_format}" if geometry.kv_cache_format else ""
    numerics = "|".join(part for part in (tag, cache, geometry.shard_label(shard)) if part)
    return Namespace(weights_fingerprint(fingerprint, weights), geometry.dtype,
                     geometry.block_size, geometry.num_layers, geometry.num_kv_heads,
                     geometry.head_dim, cache_salt or "", numerics=numerics,
                     data_key=data_key, tenant_key=tenant_key)
