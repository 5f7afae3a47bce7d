"""Where a worker computes and with what arithmetic: its device, dtype, attention and numerics tag.

A worker's settings say ``auto`` by default and are resolved here, once, at model load:

- ``worker.device: auto`` is the first CUDA device when torch sees one, else ``cpu``; any other
  torch device string (``cuda:1``, ``npu:0`` where torch_npu is installed) is taken as given.
  In a Ray replica that asked for GPUs (``kvstore.workers.replicas.placement``) Ray has set
  ``CUDA_VISIBLE_DEVICES`` to the GPUs it assigned, so ``cuda:0`` here is the replica's own
  GPU, not the host's first: nothing in this module needs to know about Ray.
- ``worker.dtype: auto`` is ``bfloat16`` on an accelerator and ``float32`` on the CPU (where
  bf16 matmuls are slow and float32 is what the CPU tests pin).
- ``worker.attn_implementation: auto`` is ``sdpa`` on an accelerator (fused kernels) and
  ``eager`` on the CPU (two plain matmuls: the same arithmetic on every CPU).

The numerics tag names the arithmetic a block's KV was computed with: device kind and
capability and SM count, torch version, the GPU math libraries and precision switches, and the
attention kernel. It is part of the namespace by default, so a block is only ever served to a
worker that would have computed exactly its bytes; that is what keeps a cache hit bitwise
equal to a recomputation across a mixed fleet (GPUs of one architecture and SM count with one
software stack share one tag: ``device_kind``).
``worker.numerics: portable`` drops the tag on purpose: blocks are then shared across hardware,
torch builds and attention implementations, and outputs are numerically close, not bitwise.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import re
from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError

#: ``worker.numerics`` values with a meaning; anything else is a tag given literally (an
#: operator on a GPU-less head naming the tag a GPU worker reports, for ``kvstore pin``).
NUMERICS_AUTO = "auto"
NUMERICS_PORTABLE = "portable"

_DEVICE_RE = re.compile(r"^[a-z][a-z0-9_]*(:\d+)?$")


@dataclass(frozen=True, slots=True)
class WorkerDevice:
    """A worker's resolved device, dtype and attention implementation."""

    device: torch.device
    dtype: str
    attn_implementation: str

    @property
    def is_accelerator(self) -> bool:
        return self.device.type != "cpu"


def resolve_device(spec: str) -> torch.device:
    """``auto`` (first CUDA device, else the CPU) or a torch device string, checked to exist."""
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if not isinstance(spec, str) or not _DEVICE_RE.match(spec):
        raise ConfigError(f"worker.device {spec!r} is not a device; use auto, cpu, cuda, "
                          "cuda:N or another torch device string such as npu:0")
    if spec.split(":")[0] == "npu":
        # Ascend NPUs are a torch plugin: importing it registers the "npu" device type.
        with contextlib.suppress(ImportError):
            importlib.import_module("torch_npu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise ConfigError(f"worker.device {spec!r} is not a torch device here ({exc}); use "
                          "auto, cpu, cuda:N, or npu:N with torch_npu installed") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"worker.device {spec!r}: torch sees no CUDA device here "
                              "(use auto or cpu)")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ConfigError(f"worker.device {spec!r}: this host has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    if device.type not in ("cpu", "meta"):
        module = getattr(torch, device.type, None)  # torch.npu once torch_npu is imported
        available = getattr(module, "is_available", None)
        if available is None or not available():
            raise ConfigError(f"worker.device {spec!r}: torch has no available {device.type!r} "
                              "backend in this process (is its torch plugin installed?)")
    return device


def resolve_worker(device: str = "auto", dtype: str = "auto",
                   attn_implementation: str = "auto") -> WorkerDevice:
    """The worker's device and the dtype and attention its ``auto`` settings mean there."""
    dev = resolve_device(device)
    accel = dev.type != "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if accel else "float32"
    if attn_implementation == "auto":
        attn_implementation = "sdpa" if accel else "eager"
    return WorkerDevice(dev, dtype, attn_implementation)


def device_kind(device: torch.device) -> str:
    """The arithmetic-relevant name of a device: ``cuda sm_90 x132``, ``cpu AVX512``, ``npu``.

    A GPU is named by its compute capability and SM count, not its marketing name: kernels
    are chosen per architecture, and cuBLAS's heuristics (tile sizes, split-K) by the SM count
    too. So an H100 SXM and an H200 (sm_90, 132 SMs) share a kind,
    while an H100 PCIe (114 SMs) or a MIG slice does not. A CPU is named by the vector ISA
    torch dispatches its kernels for.
    """
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        hip = getattr(torch.version, "hip", None)
        return f"rocm gfx {major}{minor} x{sms}" if hip else f"cuda sm_{major}{minor} x{sms}"
    if device.type == "cpu":
        capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
        return f"cpu {capability}".strip()
    return device.type


def math_libraries(device: torch.device) -> str:
    """What else decides a GPU's arithmetic: the cuBLAS and cuDNN builds and the matmul
    precision switches (reduced-precision reductions, TF32), e.g.
    ``cublas 13.1.0.3 cudnn 91900 rr bf16,fp16``; empty on the CPU."""
    if device.type != "cuda":
        return ""
    parts = []
    blas = _package_version("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12")
    if blas:
        parts.append(f"cublas {blas}")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if cudnn:
        parts.append(f"cudnn {cudnn}")
    matmul = torch.backends.cuda.matmul
    reduced = [name for name, on in (
        ("bf16", matmul.allow_bf16_reduced_precision_reduction),
        ("fp16", matmul.allow_fp16_reduced_precision_reduction)) if on]
    parts.append(f"rr {','.join(reduced) or 'off'}")
    if matmul.allow_tf32 or torch.backends.cudnn.allow_tf32:
        parts.append("tf32")
    return " ".join(parts)


def _package_version(*names: str) -> str:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return ""


def attention_numerics(device: torch.device, attn_implementation: str) -> str:
    """The attention part of the tag: on CUDA, sdpa's padded calls run pinned to an order of
    kernels (``kvstore.workers.model.attention.sdpa_backends``), which is named, e.g.
    ``sdpa cudnn,efficient,math``."""
    if attn_implementation == "sdpa" and device.type == "cuda":
        from kvstore.workers.model.attention import sdpa_backends

        names = {"CUDNN_ATTENTION": "cudnn", "EFFICIENT_ATTENTION": "efficient",
                 "FLASH_ATTENTION": "flash", "MATH": "math"}
        return "sdpa " + ",".join(names.get(b.name, b.name.lower())
                                  for b in sdpa_backends(device))
    return attn_implementation


def numerics_tag(device: torch.device, attn_implementation: str, setting: str = "auto") -> str:
    """The namespace's numerics tag for ``worker.numerics`` (``auto``, ``portable`` or a tag).

    ``auto``: ``"<device kind>|torch <version>[ <math libraries>]|<attention>"``, e.g.
    ``cuda sm_90 x132|torch 2.11.0+cu130 cublas 13.1.0.3 cudnn 91900 rr bf16,fp16|sdpa
    cudnn,efficient,math``: everything that changes the bytes a forward computes, so only
    workers that compute bitwise alike share a namespace; ``portable``: ``""`` (shared across
    hardware).
    """
    if setting == NUMERICS_PORTABLE:
        return ""
    if setting != NUMERICS_AUTO:
        return setting
    libraries = math_libraries(device)
    software = f"torch {torch.__version__}" + (f" {libraries}" if libraries else "")
    return f"{device_kind(device)}|{software}|{attention_numerics(device, attn_implementation)}"


def describe_numerics(tag: str) -> str:
    """What a namespace's numerics promise, for ``kvstore status`` and worker logs."""
    if not tag:
        return ("portable: blocks shared across hardware and attention implementations; "
                "outputs numerically close, not bitwise")
    return f"bitwise (blocks served only to workers computing as {tag})"
