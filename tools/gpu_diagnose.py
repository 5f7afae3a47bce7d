"""What this GPU does to the assumptions kvstore makes, measured in one short run.

Prints (and writes as flat JSON with ``--json``) the facts the GPU path depends on:

- the device (name, SMs, capability, driver/runtime, cuBLAS/cuDNN, matmul precision flags);
- whether the driver page-locks a read-only shared mapping (``cudaHostRegister`` with the
  read-only flag, and the device attribute that says it may), and what that costs per GiB;
- copy rates host -> device from that mapping, from pinned and from pageable memory, and the
  cost of issuing one small copy per block;
- the time of one padded attention call per SDPA kernel, and of the order a worker pins;
- row-count invariance on a Llama-3-8B-shaped layer pair (bf16): whether pieces of 16..256 rows
  reproduce their whole 512-row chunk bitwise, at one chunk of keys and at 16k keys, per SDPA
  backend and eager (the exact-reuse probe's assumption, ``kvstore.workers.engine.reuse_policy``).

Run it on a GPU machine: ``python -m tools.gpu_diagnose --json out.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import tempfile
import time
from typing import Any

import torch

GiB = 1 << 30


def device_facts() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    facts: dict[str, Any] = {
        "device": props.name, "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "bf16_reduced_precision_reduction":
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "fp16_reduced_precision_reduction":
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        facts["cublas"] = torch._C._cuda_getCompiledVersion()
    except Exception:  # noqa: BLE001 - a diagnostic
        pass
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        value = ctypes.c_int()
        rc = cuda.cuDeviceGetAttribute(ctypes.byref(value), 113, 0)  # READ_ONLY_HOST_REGISTER
        facts["attr_read_only_host_register"] = value.value if rc == 0 else f"error {rc}"
        version = ctypes.c_int()
        cuda.cuDriverGetVersion(ctypes.byref(version))
        facts["driver_api_version"] = version.value
    except OSError as exc:
        facts["attr_read_only_host_register"] = f"no libcuda: {exc}"
    st = os.statvfs("/dev/shm")
    facts["dev_shm_free_gib"] = round(st.f_bavail * st.f_frsize / GiB, 1)
    return facts


def register_and_copy(size: int = GiB) -> dict[str, Any]:
    """Page-lock a read-only MAP_SHARED mapping of a /dev/shm file, then time copies from it."""
    out: dict[str, Any] = {}
    path = tempfile.mktemp(prefix="kvstore-diag-", dir="/dev/shm")
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDWR)
    try:
        rw = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        view = memoryview(rw)
        for off in range(0, size, 64 << 20):
            view[off:off + (64 << 20)] = os.urandom(1) * (64 << 20)
        ro = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    import numpy as np

    arr = np.frombuffer(ro, dtype=np.uint8)
    ptr = arr.ctypes.data
    rt = torch.cuda.cudart()
    for flags, name in ((0x09, "portable_readonly"), (0x01, "portable")):
        t0 = time.perf_counter()
        rc = int(rt.cudaHostRegister(ptr, size, flags))
        out[f"register_{name}_rc"] = rc
        out[f"register_{name}_s_per_gib"] = (time.perf_counter() - t0) * GiB / size
        if rc == 0:
            src = torch.from_numpy(arr)
            dst = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            dst.copy_(src[: 256 << 20], non_blocking=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(4):
                dst.copy_(src[: 256 << 20], non_blocking=True)
            torch.cuda.synchronize()
            out[f"h2d_registered_{name}_gbps"] = 4 * (256 << 20) / (time.perf_counter() - t0) / 1e9
            # One copy per 2 MiB block, issued from Python: the per-copy issue cost.
            blocks = 128
            t0 = time.perf_counter()
            for i in range(blocks):
                dst[i * (2 << 20):(i + 1) * (2 << 20)].copy_(
                    src[i * (2 << 20):(i + 1) * (2 << 20)], non_blocking=True)
            issued = time.perf_counter() - t0
            torch.cuda.synchronize()
            out["per_block_copy_issue_us"] = issued / blocks * 1e6
            out["per_block_copy_gbps"] = blocks * (2 << 20) / (time.perf_counter() - t0) / 1e9
            rt.cudaHostUnregister(ptr)
            break
    pinned = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(256 << 20, dtype=torch.uint8)
    pageable.fill_(1)
    dst = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for name, src in (("pinned", pinned), ("pageable", pageable)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[f"h2d_{name}_gbps"] = 4 * (256 << 20) / (time.perf_counter() - t0) / 1e9
    del ro
    os.unlink(path)
    return out


def row_invariance() -> dict[str, Any]:
    """Pieces of the last chunk vs the whole chunk, at 512 and 16k keys, per attention kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kvstore.workers.engine.reuse_policy import _first_layers, _prefix_cache
    from kvstore.workers.model.causal_lm import load_model

    out: dict[str, Any] = {}
    chunk = 512
    for attn in ("sdpa", "eager"):
        model = _first_layers(load_model("llama3-8b", device="cuda", attn_implementation=attn,
                                         num_threads=None), 2)
        backends: list[Any] = [None]
        if attn == "sdpa":
            backends += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                         SDPBackend.MATH]
        for total in (chunk, 16384):
            tokens = torch.randint(0, 128256, (total,),
                                   generator=torch.Generator().manual_seed(total)).tolist()
            for backend in backends:
                label = f"{attn}_{'default' if backend is None else backend.name.lower()}" \
                    f"_{total // 1024 or 0}k" if total > chunk else \
                    f"{attn}_{'default' if backend is None else backend.name.lower()}_512"
                try:
                    ctx = sdpa_kernel([backend]) if backend is not None else _null()
                    with ctx:
                        cache = model.new_cache()
                        for s in range(0, total, chunk):
                            logits = model.forward(tokens[s:s + chunk], cache,
                                                   pad_keys_to=s + chunk)
                        whole = model.export_kv(cache, 0, total)
                        passing = []
                        for size in (16, 32, 64, 128, 256, 496):
                            start = total - size
                            c = _prefix_cache(model, whole, start)
                            got = model.forward(tokens[start:], c, pad_keys_to=total)
                            same = torch.equal(model.export_kv(c, start, total),
                                               whole[:, :, start:]) and torch.equal(got, logits)
                            if same:
                                passing.append(size)
                        # A 16-row piece in the middle of the chunk, padded to 16 rows.
                        start = total - chunk + 240
                        c = _prefix_cache(model, whole, start)
                        model.forward(tokens[start:start + 16], c, pad_keys_to=total)
                        mid = torch.equal(model.export_kv(c, start, start + 16),
                                          whole[:, :, start:start + 16])
                    out[f"pass_{label}"] = ",".join(map(str, passing)) or "none"
                    out[f"mid16_{label}"] = mid
                except Exception as exc:  # noqa: BLE001 - a backend this GPU lacks
                    out[f"pass_{label}"] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
        del model
        torch.cuda.empty_cache()
    return out


def attention_speed() -> dict[str, Any]:
    """ms per padded-attention call (bf16, 32 heads of 128, an explicit causal mask, as the
    engine's padded calls) for each SDPA kernel and for the order the worker pins."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from kvstore.workers.model.attention import sdpa_backends

    out: dict[str, Any] = {"pinned_order": ",".join(
        b.name.lower() for b in sdpa_backends(torch.device("cuda", 0)))}
    for rows, keys in ((512, 16384), (304, 16384), (512, 4096)):
        q = torch.randn(1, 32, rows, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 32, keys, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        mask = (torch.arange(keys, device="cuda")[None] <=
                torch.arange(keys - rows, keys, device="cuda")[:, None])[None, None]
        for name, backends in (("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                               ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                               ("math", [SDPBackend.MATH]),
                               ("pinned", sdpa_backends(torch.device("cuda", 0)))):
            label = f"attn_ms_{name}_{rows}x{keys}"
            try:
                with sdpa_kernel(backends, set_priority=True):
                    sdpa(q, k, v, attn_mask=mask)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(20):
                        sdpa(q, k, v, attn_mask=mask)
                    torch.cuda.synchronize()
                out[label] = round((time.perf_counter() - t0) / 20 * 1e3, 3)
            except Exception as exc:  # noqa: BLE001 - a kernel this GPU or shape lacks
                out[label] = f"error: {type(exc).__name__}: {str(exc)[:80]}"
    return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_diagnose: skipped: no CUDA device")
        return
    facts: dict[str, Any] = {}
    for step in (device_facts, register_and_copy, attention_speed, row_invariance):
        t0 = time.perf_counter()
        try:
            facts |= step()
        except Exception as exc:  # noqa: BLE001 - report and go on
            facts[f"{step.__name__}_error"] = f"{type(exc).__name__}: {exc}"
        facts[f"{step.__name__}_s"] = round(time.perf_counter() - t0, 2)
        print(json.dumps({k: v for k, v in facts.items()}, default=str), flush=True)
    for k, v in facts.items():
        print(f"{k:45s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(facts, f, indent=1, default=str)


if __name__ == "__main__":
    main()
