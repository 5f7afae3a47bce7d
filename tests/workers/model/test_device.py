"""Device-aware workers on the CPU (CI): what ``auto`` resolves to, the numerics tag in the
namespace, and the weights checksum against a plain reference computation."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from kvstore.client.local_store import LocalStore
from kvstore.config import WorkerConfig
from kvstore.errors import ConfigError
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model import attention, device
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.device import (
    describe_numerics,
    numerics_tag,
    resolve_device,
    resolve_worker,
)
from kvstore.workers.model.fingerprint import ROW, _weights, tensor_checksum, weights_digest
from kvstore.workers.model.sampling import SamplingParams

BS = 16


def test_auto_is_the_cpu_with_float32_and_eager_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: auto means cuda here")
    where = resolve_worker()
    assert (where.device, where.dtype, where.attn_implementation) == \
        (torch.device("cpu"), "float32", "eager")
    assert resolve_worker("cpu", "bfloat16", "sdpa").attn_implementation == "sdpa"


@pytest.mark.parametrize("spec, match", [
    ("gpu0", "not a torch device here"), ("cuda:x", "not a device"), ("", "not a device"),
    ("cuda:99", "CUDA device"), ("npu:0", "not a torch device here|no available 'npu'")])
def test_a_device_that_is_not_here_is_refused_by_name(spec: str, match: str) -> None:
    if spec.startswith("cuda") and torch.cuda.is_available() and spec != "cuda:99":
        pytest.skip("CUDA is here")
    with pytest.raises(ConfigError, match=match):
        resolve_device(spec)


def test_worker_settings_are_checked_when_they_load() -> None:
    with pytest.raises(ConfigError, match="attn_implementation"):
        WorkerConfig(attn_implementation="flash")
    with pytest.raises(ConfigError, match="publish_when_full"):
        WorkerConfig(publish_when_full="block")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="publish_backlog_blocks"):
        WorkerConfig(publish_backlog_blocks=-1)


def test_the_numerics_tag_names_device_torch_and_attention() -> None:
    tag = numerics_tag(torch.device("cpu"), "sdpa")
    kind, version, attn = tag.split("|")
    assert kind.startswith("cpu") and version == f"torch {torch.__version__}" and attn == "sdpa"
    assert numerics_tag(torch.device("cpu"), "eager", "portable") == ""
    assert numerics_tag(torch.device("cpu"), "eager", "cuda sm_90|torch x|sdpa") == \
        "cuda sm_90|torch x|sdpa"
    assert "not bitwise" in describe_numerics("") and "bitwise" in describe_numerics(tag)


def reference_checksum(t: torch.Tensor) -> bytes:
    """The checksum's definition with numpy integers: int16 words times the multipliers, summed
    per row of ROW words (zero-padded), as float64 bytes."""
    raw = t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    if len(raw) % 2:
        raw += b"\0"
    words = np.frombuffer(raw, dtype="<i2").astype(np.int64)
    words = np.concatenate([words, np.zeros(-len(words) % ROW, dtype=np.int64)])
    m = _weights(torch.device("cpu")).numpy().astype(np.int64)
    sums = (words.reshape(-1, ROW) * m).sum(axis=1)
    return sums.astype(np.float64).tobytes()


@pytest.mark.parametrize("dtype, shape", [(torch.float32, (3, 70000)), (torch.bfloat16, (5,)),
                                          (torch.int8, (131073,)), (torch.float16, (2, 3))])
def test_the_weights_checksum_is_the_exact_row_sums(dtype, shape) -> None:
    gen = torch.Generator().manual_seed(1)
    t = (torch.randn(shape, generator=gen) * 50).to(dtype)
    assert tensor_checksum(t) == reference_checksum(t)
    flipped = t.clone()
    flipped.view(torch.uint8).reshape(-1)[-1] ^= 1  # one bit of the last word
    assert tensor_checksum(flipped) != tensor_checksum(t)


def test_the_fingerprint_changes_with_any_weight_and_only_then() -> None:
    model = load_model("tiny")
    again = load_model("tiny")
    assert again.fingerprint == model.fingerprint
    assert load_model("tiny", seed=1).fingerprint != model.fingerprint
    before = weights_digest(model.model)
    with torch.no_grad():
        model.model.model.norm.weight[3] += 1e-3
    assert weights_digest(model.model) != before
    h = hashlib.sha256()
    assert len(before) == len(h.hexdigest())


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("numerics", ["auto", "portable"])
def test_an_eager_writers_blocks_reach_an_sdpa_reader_only_when_portable(numerics: str) -> None:
    """The bitwise promise holds only between equal arithmetic: by default an sdpa worker never
    reads an eager worker's blocks (another namespace); ``portable`` shares them on purpose."""
    config = WorkerConfig(block_size=BS, prefill_chunk_tokens=64, numerics=numerics)
    eager = load_model("tiny", attn_implementation="eager", numerics=numerics)
    sdpa = load_model("tiny", attn_implementation="sdpa", numerics=numerics)
    store = LocalStore()
    writer = Engine(eager, store, config)
    reader = Engine(sdpa, store, config)
    assert (writer.namespace == reader.namespace) == (numerics == "portable")
    tokens = prompt(100, seed=3)
    writer.prefill(tokens, sampling=SamplingParams(max_new_tokens=0))  # a warm-up: published
    assert len(store.blocks) == 100 // BS
    pre = reader.prefill(tokens, sampling=SamplingParams(max_new_tokens=1))
    reader.wait_published()
    if numerics == "auto":
        assert pre.cached_tokens == 0
        assert len(store.blocks) == 2 * (100 // BS)  # the reader published its own
    else:
        assert pre.cached_tokens == 96
    writer.close()
    reader.close()


class _Props:
    def __init__(self, sms: int) -> None:
        self.multi_processor_count = sms


def test_a_gpus_tag_tells_apart_sm_counts_math_libraries_switches_and_the_kernel(
        monkeypatch) -> None:
    """What changes a GPU's arithmetic is in its tag: boards of one architecture with other SM
    counts (an H100 PCIe vs SXM, a MIG slice), cuBLAS/cuDNN builds, reduced-precision
    reductions and TF32, and the pinned SDPA kernel; boards alike share a tag."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    sms = {"n": 132}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: _Props(sms["n"]))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    monkeypatch.setattr(device, "_package_version", lambda *names: "13.1.0.3")
    matmul = torch.backends.cuda.matmul
    monkeypatch.setattr(matmul, "allow_bf16_reduced_precision_reduction", True)
    monkeypatch.setattr(matmul, "allow_fp16_reduced_precision_reduction", True)
    monkeypatch.setattr(matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    attention._preferred_backends.cache_clear()
    h200 = numerics_tag(cuda, "sdpa")
    kind, software, attn = h200.split("|")
    assert kind == "cuda sm_90 x132" and attn == "sdpa cudnn,efficient,math"
    assert software == f"torch {torch.__version__} cublas 13.1.0.3 cudnn 91900 rr bf16,fp16"
    assert numerics_tag(cuda, "sdpa") == h200  # the same board and stack: one namespace
    assert numerics_tag(cuda, "eager").endswith("|eager")
    sms["n"] = 114  # an H100 PCIe
    assert numerics_tag(cuda, "sdpa") != h200
    sms["n"] = 132
    monkeypatch.setattr(matmul, "allow_bf16_reduced_precision_reduction", False)
    assert "rr fp16" in numerics_tag(cuda, "sdpa")
    monkeypatch.setattr(matmul, "allow_tf32", True)
    assert numerics_tag(cuda, "sdpa").split("|")[1].endswith(" tf32")
    # cuDNN attention leads only where torch itself prefers it (cuDNN newer than 9.15).
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91500)
    attention._preferred_backends.cache_clear()
    assert numerics_tag(cuda, "sdpa").endswith("|sdpa efficient,math")
    attention._preferred_backends.cache_clear()
