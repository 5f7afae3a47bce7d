"""Where a worker computes and with what arithmetic: its device, dtype, attention and numerics tag.

A worker's settings say ``auto`` by default and are resolved here, once, at model load:

- ``worker.device: auto`` is the first CUDA device when torch sees one, else ``cpu``; any other
  torch device string (``cuda:1``, ``npu:0`` where torch_npu is installed) is taken as given.
- ``worker.dtype: auto`` is ``bfloat16`` on an accelerator and ``float32`` on the CPU (where
  bf16 matmuls are slow and float32 is what the CPU tests pin).
- ``worker.attn_implementation: auto`` is ``sdpa`` on an accelerator (fused kernels) and
  ``eager`` on the CPU (two plain matmuls: the same arithmetic on every CPU).

The numerics tag names the arithmetic a block's KV was computed with: device kind and
capability, torch version and attention implementation. It is part of the namespace by default,
so a block is only ever served to a worker that would have computed exactly its bytes; that is
what keeps a cache hit bitwise equal to a recomputation across a mixed fleet (measured: an H100
and an H200 with one torch build give identical KV, and they share one tag, ``cuda sm_90``).
``worker.numerics: portable`` drops the tag on purpose: blocks are then shared across hardware,
torch builds and attention implementations, and outputs are numerically close, not bitwise.
"""

from __future__ import annotations

import contextlib
import importlib
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
    """The arithmetic-relevant name of a device: ``cuda sm_90``, ``cpu AVX512``, ``npu``.

    A GPU is named by its compute capability, not its marketing name: kernels are chosen per
    architecture, so two boards of one architecture (H100, H200) compute alike. A CPU is named
    by the vector ISA torch dispatches its kernels for.
    """
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        hip = getattr(torch.version, "hip", None)
        return f"rocm gfx {major}{minor}" if hip else f"cuda sm_{major}{minor}"
    if device.type == "cpu":
        capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
        return f"cpu {capability}".strip()
    return device.type


def numerics_tag(device: torch.device, attn_implementation: str, setting: str = "auto") -> str:
    """The namespace's numerics tag for ``worker.numerics`` (``auto``, ``portable`` or a tag).

    ``auto``: ``"<device kind>|torch <version>|<attention>"``, e.g.
    ``cuda sm_90|torch 2.13.0+cu130|sdpa``; ``portable``: ``""`` (shared across hardware).
    """
    if setting == NUMERICS_PORTABLE:
        return ""
    if setting != NUMERICS_AUTO:
        return setting
    return f"{device_kind(device)}|torch {torch.__version__}|{attn_implementation}"


def describe_numerics(tag: str) -> str:
    """What a namespace's numerics promise, for ``kvstore status`` and worker logs."""
    if not tag:
        return ("portable: blocks shared across hardware and attention implementations; "
                "outputs numerically close, not bitwise")
    return f"bitwise (blocks served only to workers computing as {tag})"
